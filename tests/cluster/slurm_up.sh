#!/usr/bin/env bash
# Bring up a single-node SLURM on this machine, with accounting (submitit polls `sacct` to see jobs end):
# Debian's munge, slurm-wlm, slurmdbd and mariadb-server, daemons started directly (no systemd). Needs root.
# Idempotent: a cluster that already answers `sinfo` and `sacct` is left as it is. About 70 s from nothing.
#
#   sudo tests/cluster/slurm_up.sh        # then: make test-cluster
#
# The node offers this machine's cores and memory, no GPU; partition "debug"; jobs run as the submitting user.
set -euo pipefail

if sinfo -h >/dev/null 2>&1 && sacct -n -X -S now >/dev/null 2>&1; then
    echo "slurm_up: a SLURM cluster with accounting already answers here"; exit 0
fi
if [ "$(id -u)" != 0 ]; then
    echo "slurm_up: needs root (it installs Debian packages and starts daemons)" >&2; exit 1
fi

if ! command -v slurmctld >/dev/null || ! command -v slurmdbd >/dev/null || ! command -v mariadbd >/dev/null; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq munge slurm-wlm slurmdbd mariadb-server >/dev/null
fi

node=$(hostname -s)
cpus=$(nproc)
memory_mb=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 - 1024 ))  # leave 1 GiB to the system
mkdir -p /etc/slurm /var/spool/slurmctld /var/spool/slurmd /var/log/slurm /run/munge /run/mysqld /run/slurm

# munge: the package created /etc/munge/munge.key
chown munge:munge /run/munge
pgrep -x munged >/dev/null || runuser -u munge -- /usr/sbin/munged

# mariadb: the accounting database
chown mysql:mysql /run/mysqld
if ! pgrep -x mariadbd >/dev/null; then
    runuser -u mysql -- /usr/sbin/mariadbd --skip-networking=0 --bind-address=127.0.0.1 \
        >/var/log/slurm/mariadb.log 2>&1 &
fi
for _ in $(seq 60); do mysqladmin ping >/dev/null 2>&1 && break; sleep 0.5; done
mysql -e "CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY 'slurm';
          GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost'; FLUSH PRIVILEGES;"

cat >/etc/slurm/slurmdbd.conf <<EOF
AuthType=auth/munge
DbdHost=localhost
SlurmUser=root
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=slurm
StoragePass=slurm
StorageLoc=slurm_acct_db
LogFile=/var/log/slurm/slurmdbd.log
PidFile=/run/slurm/slurmdbd.pid
EOF
chmod 600 /etc/slurm/slurmdbd.conf

# KillWait: seconds between SIGTERM and SIGKILL when a job is cancelled or requeued (time to checkpoint).
cat >/etc/slurm/slurm.conf <<EOF
ClusterName=bench
SlurmctldHost=$node
SlurmUser=root
AuthType=auth/munge
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurm/slurmctld.pid
SlurmdPidFile=/run/slurm/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU_Memory
ReturnToService=2
KillWait=30
SchedulerParameters=sched_interval=1
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
NodeName=$node CPUs=$cpus RealMemory=$memory_mb State=UNKNOWN
PartitionName=debug Nodes=$node Default=YES MaxTime=INFINITE State=UP
EOF

pgrep -x slurmdbd >/dev/null || slurmdbd
for _ in $(seq 60); do sacctmgr -n list cluster >/dev/null 2>&1 && break; sleep 0.5; done
sacctmgr -n list cluster format=cluster | grep -qw bench || sacctmgr -i add cluster bench >/dev/null
pgrep -x slurmctld >/dev/null || slurmctld
pgrep -x slurmd >/dev/null || slurmd
for _ in $(seq 60); do
    state=$(sinfo -h -n "$node" -o %t 2>/dev/null || true)
    [ "$state" = idle ] && break
    sleep 0.5
done
[ "$state" = idle ] || { echo "slurm_up: node $node is '$state', not idle (see /var/log/slurm/)" >&2; exit 1; }
sacct -n -X -S now >/dev/null || { echo "slurm_up: sacct does not answer (see /var/log/slurm/slurmdbd.log)" >&2; exit 1; }
echo "slurm_up: cluster 'bench' up: node $node, $cpus CPUs, $memory_mb MB, partition debug, accounting on"
