"""One cell per accelerator: LAUNCHER=parallel runs as many cells at once as there are GPUs, each process holding
a GPU of its own; GPUs are simulated by CUDA_VISIBLE_DEVICES (what SLURM and users set), no GPU needed."""

import os
import subprocess
import sys

import pytest
from hydra import compose, initialize_config_dir

from bench.running import device as devices
from tests.conftest import CONF

CLAIM = """
import sys, time
from bench.running.device import claim_gpu
print(claim_gpu(), claim_gpu(), flush=True)  # a second call keeps the first answer
time.sleep(float(sys.argv[1]))
"""


@pytest.mark.parametrize("listed,expected", [("0,1", ["0", "1"]), ("3", ["3"]), ("", []), ("2,-1,5", ["2"]),
                                             (" 4 , 6 ", ["4", "6"])])
def test_visible_gpus_are_the_ones_cuda_visible_devices_lists(monkeypatch, listed, expected):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", listed)
    assert devices.visible_gpus() == expected


@pytest.mark.parametrize("listed,override,jobs", [("0,1", None, 2), ("0", None, 1), ("", None, -1), ("0,1", "6", 6)])
def test_the_parallel_launcher_runs_one_cell_per_gpu_else_one_per_core(monkeypatch, listed, override, jobs):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", listed)
    if override is None:
        monkeypatch.delenv("BENCH_PARALLEL_JOBS", raising=False)
    else:
        monkeypatch.setenv("BENCH_PARALLEL_JOBS", override)
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=["hydra/launcher=parallel"], return_hydra_config=True)
    assert cfg.hydra.launcher.n_jobs == jobs


def test_each_process_holds_its_own_gpu_for_its_life_and_one_too_many_shares(tmp_path):
    """Two processes on two simulated GPUs take one each; a third, started while both hold theirs, finds none
    free and shares one; once the first exits, a new process gets its GPU back."""
    script = tmp_path / "claim.py"
    script.write_text(CLAIM)
    env = os.environ | {"CUDA_VISIBLE_DEVICES": "7,9", "TMPDIR": str(tmp_path)}

    def start(seconds):
        return subprocess.Popen([sys.executable, str(script), str(seconds)], cwd=CONF.parent, env=env,
                                stdout=subprocess.PIPE, text=True)

    def claimed(proc):
        first, again = proc.stdout.readline().split()
        assert first == again
        return int(first)

    holders = [start(30), start(30)]
    first, second = (claimed(p) for p in holders)
    assert sorted([first, second]) == [0, 1]
    assert sorted(p.name for p in tmp_path.glob("precision-bench-gpu-*.lock")) == \
        [f"precision-bench-gpu-{os.getuid()}-{gpu}.lock" for gpu in (7, 9)]
    extra = start(0)
    assert claimed(extra) in (0, 1)  # none free: it shares one
    extra.wait()
    holders[0].kill()
    holders[0].wait()
    newcomer = start(0)
    assert claimed(newcomer) == first  # the kernel released the dead process's GPU
    newcomer.wait()
    holders[1].kill()
    holders[1].wait()


def test_a_timing_is_disturbed_when_another_process_used_its_gpu(monkeypatch):
    """torch.cuda.list_gpu_processes's report, before and after training: any pid but this one marks the timing."""
    me, other = os.getpid(), os.getpid() + 1
    reports = iter([f"GPU:0\nprocess {me:>10d} uses 812.000 MB GPU memory",
                    f"GPU:0\nprocess {me:>10d} uses 812.000 MB GPU memory\n"
                    f"process {other:>10d} uses 20.000 MB GPU memory"])
    monkeypatch.setattr(devices.torch.cuda, "clock_rate", lambda device: 1980)
    monkeypatch.setattr(devices.torch.cuda, "list_gpu_processes", lambda device: next(reports))
    conditions = devices.TimingConditions(devices.torch.device("cuda", 0))
    conditions.start()
    measured = conditions.finish()
    assert measured["gpu_shared_with"] == [other] and measured["disturbed"]
    assert devices._other_gpu_processes({"other_processes": "no processes are running"}) == set()
