"""(Lives in the hydra_plugins namespace because Hydra only instantiates sweepers from there.)

Hydra's basic sweeper with these additions:
- `hydra.sweeper.settings`: a list of override sets ("format=fp16 scaling=static"), each crossed with the swept
  params, for a grid that is not a full product (a paper's columns: FP16 without and with a loss scale, FP32);
- every cell of a sweep is checked before the first one trains (a bad combination anywhere in the
  grid costs nothing); what the device supports is checked here only when the cells run on this machine
  (not for SLURM, whose nodes decide for themselves);
- cells whose record is already finished are not launched at all (on SLURM: no job is submitted),
  and the log names each one; failed or diverged cells re-run with retry_failed=true;
- the sweep ends by judging each finished run against its siblings (the other seeds of its cell): a run that did not
  learn as they did gets `numerics.stalled` in its record (bench/running/learning.py) and is named in the summary;
- the sweep ends with a status summary and a non-zero exit if any cell (run now or before) failed,
  including a SLURM job that ended without a result (cancelled, killed) and a cell stopped by a full or failing
  disk (no record), neither of which ends the sweep;
- a SLURM sweep starts only where `sacct` answers (submitit sees a job end only through SLURM accounting);
- a pre-emption signal sent to a parallel sweep's own process (`kill -INT <pid>`, not only a terminal's Ctrl-C to
  its whole group) reaches the cells its workers run, and the sweep waits for them to save at their next step
  boundary before it exits, rather than killing them mid-step.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any, Sequence

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from omegaconf import OmegaConf, open_dict

from bench.errors import suggestion
from bench.running.command_line import composition_error
from bench.running.config import ConfigError, check_results_dir
from bench.running.identity import cell_path, run_id
from bench.running.learning import judge
from bench.running.record import IN_FLIGHT, RETRY_HINT, STATUSES, STORAGE_ERRNOS, in_flight

log = logging.getLogger(__name__)


@contextlib.contextmanager
def _jobs_without_a_result_count_as_failed():
    """hydra-submitit-launcher collects `[job.results()[0] for job in jobs]`: one job that ends without a result
    (scancel, out of memory, node failure, hard time-out) raises UncompletedJobError there, and the sweep dies
    without waiting for the others or printing its summary. Within this block such a job instead returns a
    failed outcome; it writes no record, so the next launch runs the cell again (from its checkpoint)."""
    try:
        import submitit
        from submitit.core.utils import UncompletedJobError
    except ImportError:  # the local launcher needs neither
        yield
        return
    from hydra.core.utils import JobReturn, JobStatus

    results = submitit.Job.results

    def results_or_failure(job):
        try:
            return results(job)
        except UncompletedJobError as e:
            reason = f"job {job.job_id} ended without a result ({job.state}): {str(e).splitlines()[0]}"
            log.error("%s", reason)
            return [JobReturn(status=JobStatus.COMPLETED,
                              _return_value={"status": "failed", "reason": reason, "skipped": False})]

    submitit.Job.results = results_or_failure
    try:
        yield
    finally:
        submitit.Job.results = results


def _cell_workers() -> list[int]:
    """The pids of this process's joblib (loky) workers, each running a cell: its children whose command line is
    loky's worker's (Linux's /proc; elsewhere none), not loky's and multiprocessing's resource trackers."""
    workers = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])  # "pid (comm) state ppid ..."
            if parent == os.getpid() and b"popen_loky_posix" in (stat.parent / "cmdline").read_bytes():
                workers.append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):  # ended while read
            continue
    return workers


@contextlib.contextmanager
def _cells_stop_at_their_step_boundary():
    """Around a parallel sweep's launch (joblib's workers, each training a cell): a pre-emption signal this process
    receives (checkpoint.PREEMPTION_SIGNALS) is handed to every worker as SIGINT, whose cell saves a checkpoint at
    its next step boundary and returns (a worker between cells keeps it, and its later cells, the queued ones among
    them, return before they train: bench.running.run's run_cells), and the sweep waits for them instead of raising
    at once (Python's KeyboardInterrupt, by which joblib killed its workers mid-step: sent to this process alone,
    `kill -INT <pid>`, no cell saved; a terminal's Ctrl-C, which reaches every worker too, raced the kill). Once they
    have returned, one line and exit 128 + the signal. The same signal again stops at once, as before."""
    from bench.running.checkpoint import PREEMPTION_SIGNALS

    received, previous = None, {}  # the pre-emption signal received (None: none yet), and the handlers before

    def hand_on(signum, frame):
        nonlocal received
        if received == signum:  # asked twice: stop now, without waiting (and without the line below)
            received = None
            signal.signal(signum, previous[signum])
            os.kill(os.getpid(), signum)
            return
        received = signum
        for pid in _cell_workers():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGINT)  # SIGTERM's default would end the worker, and joblib the others
        log.warning("%s: each running cell saves a checkpoint at its next step boundary and stops; the sweep waits "
                    "for them (the same signal again stops at once)", signal.Signals(signum).name)

    for signum in PREEMPTION_SIGNALS:
        previous[signum] = signal.signal(signum, hand_on)
    lost = ""
    try:
        yield
    except BaseException as e:  # joblib's, once stopping: a worker ended before its cell could save
        if received is None:
            raise
        raised = ": ".join([type(e).__name__, *(line[:200] for line in str(e).splitlines()[:1])])
        lost = f" (but not every cell: the launcher raised {raised})"
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if received is not None:
        print(f"interrupted: the sweep's running cells saved their checkpoints at their last step boundary{lost} "
              f"({signal.Signals(received).name}); run the same command again to resume them", file=sys.stderr)
        sys.exit(128 + received)


def check_slurm_accounting() -> None:
    """submitit learns that a job ended (finished, cancelled, killed) only from `sacct`: where accounting is off
    or sacct is missing, it never sees a cancelled job end and the sweep waits forever. Refuse before submitting."""
    fix = ("the cluster needs SLURM accounting (slurmdbd, AccountingStorageType=accounting_storage/slurmdbd); "
           "on one machine, tests/cluster/slurm_up.sh sets one up")
    try:
        out = subprocess.run(["sacct", "--noheader", "-X", "--starttime", "now"], capture_output=True, text=True,
                             timeout=60)
    except FileNotFoundError:
        raise ConfigError(f"hydra/launcher=slurm needs SLURM's sacct, which is not on PATH here: {fix}") from None
    except subprocess.TimeoutExpired:
        raise ConfigError(f"hydra/launcher=slurm: sacct did not answer within 60 s: {fix}") from None
    if out.returncode != 0:
        said = (out.stderr.strip() or out.stdout.strip()).splitlines()[:1] or [f"exit {out.returncode}"]
        raise ConfigError(f"hydra/launcher=slurm needs sacct to answer, and here it fails ({said[0]}): {fix}")


class CheckingSweeper(BasicSweeper):
    def __init__(self, *args, settings: Sequence | None = None, table: str | None = None, **kwargs):
        """settings: override sets, each a string or a mapping whose `overrides` is one (the mapping's other keys,
        and `table`, are the preset's table declaration, read by bench/reporting/experiment_tables.py, not here)."""
        super().__init__(*args, **kwargs)
        self.table = table
        self.settings = [str(s["overrides"] if hasattr(s, "keys") else s).split() for s in settings or []]
        self.already: Counter = Counter()  # statuses of cells skipped because they were recorded before
        self.run_dirs: dict[str, Path] = {}  # every cell of the sweep, run now or before: judged when it ends

    def split_arguments(self, overrides, max_batch_size):
        """Hydra's product of the swept params, each job then repeated once per entry of `settings`."""
        batches = BasicSweeper.split_arguments(overrides, max_batch_size)
        if not self.settings:
            return batches
        swept = {o.get_key_element() for o in overrides}
        for setting in self.settings:
            if clash := sorted(swept & {item.split("=", 1)[0] for item in setting}):
                print(f"config error: {', '.join(clash)} is set by hydra.sweeper.settings ({' '.join(setting)}) "
                      "and also on the command line or in params; set it in one place", file=sys.stderr)
                sys.exit(2)
        return [[job + setting for job in batch for setting in self.settings] for batch in batches]

    def setup(self, *args, **kwargs) -> None:
        super().setup(*args, **kwargs)
        # SLURM cells run on compute nodes: what their device supports is decided there, not on the login node
        self._cells_run_here = "Slurm" not in type(self.launcher).__name__
        launch = self.launcher.launch
        workers = None  # a parallel sweep's n_jobs as configured (joblib's launcher)
        if "Joblib" in type(self.launcher).__name__:
            workers = self.launcher.joblib.get("n_jobs")
            workers = int(workers) if isinstance(workers, str) else workers

        def launch_unless_empty(batch, initial_job_idx):
            if not batch:
                return []  # submitit refuses an empty array
            stopping = contextlib.nullcontext()
            if workers is not None:
                stopping = _cells_stop_at_their_step_boundary()
                # no more workers than cells: a worker that never ran a cell would end on a signal (joblib's loky
                # starts n_jobs of them whatever the batch), and joblib then kills the others mid-step
                from joblib import effective_n_jobs

                self.launcher.joblib["n_jobs"] = min(effective_n_jobs(workers), len(batch))
            try:
                with _jobs_without_a_result_count_as_failed(), stopping:
                    return launch(batch, initial_job_idx=initial_job_idx)
            except OSError as e:  # the launcher's own files (submitit's job pickles) did not fit on the disk
                if e.errno not in STORAGE_ERRNOS:
                    raise
                print(f"storage error: the launcher could not start {len(batch)} cells: {e}", file=sys.stderr)
                from hydra.core.utils import JobReturn, JobStatus

                return [JobReturn(status=JobStatus.COMPLETED, _return_value={
                    "status": "failed", "skipped": False, "recorded": False}) for _ in batch]

        self.launcher.launch = launch_unless_empty

    def _compose(self, overrides: Sequence[str]):
        """A cell's config as its job will see it: its path resolved from its own choices and overrides, then
        without Hydra's own node (which resolves only in the job)."""
        try:
            cfg = self.hydra_context.config_loader.load_sweep_config(master_config=self.config,
                                                                     sweep_overrides=list(overrides))
        except Exception as e:  # a typo in a yaml this cell composes: as the command line's (exit 2)
            if (translated := composition_error(e)) is None:
                raise
            raise translated from None
        with open_dict(cfg):
            if OmegaConf.is_interpolation(cfg, "cell"):  # as config.yaml derives it, unless overridden
                cfg.cell = cell_path(cfg, dict(cfg.hydra.runtime.choices), list(cfg.hydra.overrides.task))
            del cfg["hydra"]
        return cfg

    def _check_batch(self, cells: Sequence[Sequence[str]], places: dict, refused: dict) -> list[Sequence[str]]:
        """Compose each cell once: run the runner's own checks (`preflight`: every check that can refuse a cell, the
        scaling method's rules for the model's layers included), and drop cells already recorded. `places`: each
        cell's place so far, shared by every batch (two configurations at one place are refused); `refused`: each
        refusal's message, with the cells it refused (every cell is checked, so that a command with two bad values
        names both before it exits 2)."""
        from bench.running.run import finished_record, preflight  # the runner's own checks, nothing re-implemented

        batch = []
        for overrides in cells:
            try:
                cfg = self._compose(overrides)
                preflight(cfg, device_checks=self._cells_run_here)
                identity = run_id(OmegaConf.to_container(cfg, resolve=True))
                if places.setdefault(cfg.cell, (identity, overrides))[0] != identity:
                    raise ConfigError(f"cell [{' '.join(places[cfg.cell][1])}] would write to the same place "
                                      f"({cfg.cell}) with another configuration")
                done = finished_record(cfg)
            except ConfigError as e:
                refused.setdefault(str(e), []).append(overrides)
                continue
            self.run_dirs.setdefault(cfg.cell, Path(cfg.results_dir) / cfg.cell)
            if places[cfg.cell][1] is not overrides:
                log.info("skipped [%s]: the same configuration as [%s]", " ".join(overrides),
                         " ".join(places[cfg.cell][1]))
            elif done is None and in_flight(Path(cfg.results_dir) / cfg.cell):
                self.already[IN_FLIGHT] += 1
                log.warning("skipped %s: another process is training it now", cfg.cell)
            elif done is None:
                batch.append(overrides)
            else:
                self.already[done["status"]] += 1
                log.info("skipped %s: already recorded as %s%s", cfg.cell, done["status"],
                         "" if done["status"] == "ok" else f" ({RETRY_HINT})")
        return batch

    def _launch_checked(self, arguments: list[str]) -> list:
        """Hydra's basic sweep, with every cell of every batch checked first: a refused command writes nothing
        (Hydra's own sweep writes multirun.yaml, and so the results directory, before it composes a cell)."""
        from hydra.core.override_parser.overrides_parser import OverridesParser

        params = [*self._parse_config(), *arguments]
        overrides = OverridesParser.create(config_loader=self.hydra_context.config_loader).parse_overrides(params)
        places, refused = {}, {}
        batches = [self._check_batch(cells, places, refused)
                   for cells in self.split_arguments(overrides, self.max_batch_size)]
        for message, cells in refused.items():
            more = f" (and {len(cells) - 1} more cells)" if len(cells) > 1 else ""
            print(f"config error in cell [{' '.join(cells[0])}]{more}: {message}", file=sys.stderr)
        if refused:
            sys.exit(2)
        sweep_dir = Path(self.config.hydra.sweep.dir)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(self.config, sweep_dir / "multirun.yaml")
        returns, first = [], 0
        for batch in batches:
            results = self.launcher.launch(batch, initial_job_idx=first)
            for result in results:
                _ = result.return_value  # raises where a job failed, as Hydra's sweep does
            first += len(batch)
            returns.append(results)
        return returns

    def sweep(self, arguments: list[str]) -> Any:
        try:  # Hydra's basic sweeper creates the sweep directory before it composes any cell
            check_results_dir(Path(self.config.results_dir))
            if self.table is not None:
                from bench.reporting.experiment_tables import DECLARED_TABLES, declared_table

                if self.table not in DECLARED_TABLES:
                    raise ConfigError(f"hydra.sweeper.table={self.table!r} is not a table; valid: "
                                      f"{', '.join(DECLARED_TABLES)}{suggestion(self.table, DECLARED_TABLES)}")
                declared_table(str(self.config.get("experiment_name")))  # its rows: each pairing names a row
            if not self._cells_run_here:
                check_slurm_accounting()
        except ConfigError as e:
            print(f"config error: {e}", file=sys.stderr)
            sys.exit(2)
        returns = self._launch_checked(arguments)
        launched = [job.return_value for batch in returns for job in batch]
        total = Counter(r["status"] for r in launched) + self.already
        busy = total.pop(IN_FLIGHT, 0)
        interrupted = total.pop("interrupted", 0)  # a parallel sweep's worker signalled alone (its sweep went on)
        skipped = sum(n for status, n in self.already.items() if status != IN_FLIGHT) \
            + sum(r.get("skipped", False) and r["status"] != IN_FLIGHT for r in launched)
        unrecorded = sum(r.get("recorded") is False for r in launched)
        stalled = judge(self.run_dirs.values())
        print("sweep: " + ", ".join(f"{total.get(s, 0)} {s}" for s in STATUSES)
              + f" ({skipped} skipped as already recorded"
              + (f"; {unrecorded} failed without a record, the disk being full or failing: run again once it has "
                 "space" if unrecorded else "") + ")"
              + (f"; {busy} in flight in another process, not run here (run again once it ends)" if busy else "")
              + (f"; {interrupted} interrupted by a signal, their checkpoints saved (run again to resume them)"
                 if interrupted else "")
              + (f"; {len(stalled)} ok but stalled, not learning as their siblings did (numerics.stalled): "
                 + ", ".join(stalled) if stalled else "")
              + (f"; {RETRY_HINT}" if total.get("failed") or total.get("diverged") else ""),
              file=sys.stderr)
        if total.get("failed"):
            sys.exit(1)
        if interrupted:
            sys.exit(130)
        return returns
