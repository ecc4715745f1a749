"""The SLURM path against a real single-node SLURM (tests/cluster/slurm_up.sh; `make test-cluster`).

Each test runs `python -m bench.run -m hydra/launcher=slurm ...` as a user types it, on small LeNet cells, and
checks what SLURM, submitit and the records did: skip on re-run, no cell trained twice by two sweeps at
once, a cancelled job failing its cell without ending the sweep, and a pre-empted or timed-out job requeued
and resumed to bitwise the result of an uninterrupted run.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import CONF

pytestmark = pytest.mark.cluster

# The node has no GPU and few cores: one core and 2 GB per cell. A 30-minute limit, so that submitit calls a
# manual SIGUSR2 a pre-emption (it calls any signal in the last 10 minutes of the limit a time-out).
SLURM_ENV = {"BENCH_SLURM_GPUS": "0", "BENCH_SLURM_CPUS": "1", "BENCH_SLURM_MEM_GB": "2",
             "BENCH_SLURM_TIMEOUT_MIN": "30", "BENCH_SLURM_PARTITION": "debug",
             "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
CELL = ["format=fp32", "scaling=none"]
MEDIUM, LONG = 60, 400  # epochs of LeNet: 2400 and 16000 steps, about 11 s and 75 s on one core (LONG must
# outlast a 1-minute time limit whatever the loop's speed: at 150 epochs a faster loop finished inside it)


@pytest.fixture(scope="module", autouse=True)
def cluster():
    if shutil.which("sinfo") is None or subprocess.run(["sinfo", "-h"], capture_output=True).returncode != 0:
        pytest.fail("no SLURM cluster answers here: run tests/cluster/slurm_up.sh (as root) first")


RELEASE_AFTER_S = 3.0


@pytest.fixture(scope="module", autouse=True)
def requeued_jobs_start_at_once():
    """SLURM holds a requeued job back for about two minutes (pending, reason BeginTime). What is tested is that
    it is requeued and resumes, not the wait: once the job's previous run has left the node (no slurmstepd of
    it) for RELEASE_AFTER_S, release it, as an administrator would with `scontrol update JobId=... StartTime=now`.
    Not sooner: slurmd revokes the previous run's credential with one-second resolution, and a relaunch whose
    credential is made in the same second is killed as "non-startable: Job credential revoked" (FAILED; a CI run
    lost the pre-empted cell that way)."""
    done = threading.Event()
    left_the_node: dict[str, float] = {}

    def still_on_the_node(job: str) -> bool:
        return subprocess.run(["pgrep", "-f", rf"^slurmstepd: \[{job}\."], capture_output=True).returncode == 0

    def release():
        while not done.wait(0.5):
            pending = subprocess.run(["squeue", "-h", "-t", "PD", "-o", "%A %r"], capture_output=True, text=True)
            for job, reason in (line.split() for line in pending.stdout.splitlines() if line.strip()):
                if reason != "BeginTime" or still_on_the_node(job):
                    left_the_node.pop(job, None)
                elif time.time() - left_the_node.setdefault(job, time.time()) >= RELEASE_AFTER_S:
                    subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], capture_output=True)

    thread = threading.Thread(target=release, daemon=True)
    thread.start()
    yield
    done.set()
    thread.join()


@pytest.fixture(scope="module", autouse=True)
def uninterrupted(tmp_path_factory):
    """The MEDIUM and LONG cells trained without interruption, outside SLURM: started in the background when the
    module starts, waited for by the first test that reads them."""
    results = tmp_path_factory.mktemp("uninterrupted")
    proc = subprocess.Popen([sys.executable, "-m", "bench.run", "-m", *CELL, f"model.epochs={MEDIUM},{LONG}",
                             f"results_dir={results}"], cwd=CONF.parent, env=os.environ | SLURM_ENV,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    def result(epochs: int) -> Path:
        assert proc.wait(timeout=600) == 0, proc.stderr.read()[-3000:]
        return next(cell for cell in cell_dirs(results) if cell.name.endswith(f"epochs={epochs}"))

    yield result
    proc.kill()
    proc.wait()


def sweep(results: Path, *overrides: str, wait: bool = True):
    cmd = [sys.executable, "-m", "bench.run", "-m", "hydra/launcher=slurm", *overrides, f"results_dir={results}"]
    kwargs = dict(cwd=CONF.parent, env=os.environ | SLURM_ENV, text=True)
    if not wait:
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, **kwargs)
    return subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=600, **kwargs)


def cell_dirs(results: Path) -> list[Path]:
    return sorted(p.parent for p in results.rglob("run.log"))


def starts(cell: Path) -> list[str]:
    """The run.log lines that say a process started training the cell (one per attempt)."""
    return [line for line in (cell / "run.log").read_text().splitlines() if "] start on " in line]


def last_step(cell: Path) -> int:
    steps = re.findall(r"\[progress\] step (\d+)/", (cell / "run.log").read_text())
    return int(steps[-1]) if steps else -1


def slurm_job(cell: Path) -> str:
    return re.findall(r"SLURM job (\S+?)\)", starts(cell)[-1])[0]


def wait_until(condition, timeout: float, what: str):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if value := condition():
            return value
        time.sleep(0.2)
    pytest.fail(f"waited {timeout:.0f} s for {what}")


def training(results: Path, min_step: int):
    """The cell directory under `results` whose training has passed `min_step`, else None."""
    def check():
        return next((c for c in cell_dirs(results) if starts(c) and last_step(c) >= min_step), None)
    return check


def record(cell: Path) -> dict:
    return json.loads((cell / "result.json").read_text())


def losses(cell: Path) -> list:
    return [(row["step"], row["loss"]) for row in map(json.loads, (cell / "metrics.jsonl").read_text().splitlines())
            if "loss" in row]


def assert_same_result(cell: Path, reference: Path):
    """Bitwise the same weights' outcome: metrics and every logged loss equal the uninterrupted run's."""
    assert record(cell)["status"] == "ok"
    assert record(cell)["metrics"] == record(reference)["metrics"]
    assert losses(cell) == losses(reference)


def test_a_sweep_trains_each_cell_once_beside_a_second_sweep_and_a_rerun_submits_nothing(tmp_path):
    grid = ["format=fp32", "scaling=none,dynamic", "seed=0,1", "model.epochs=20"]
    first = sweep(tmp_path, *grid, wait=False)
    wait_until(training(tmp_path, 10), 180, "a cell of the first sweep to train")
    second = sweep(tmp_path, *grid)  # two cells run (one per core), two wait in the queue
    output = first.communicate(timeout=600)[0]
    assert first.returncode == 0 and "sweep: 4 ok, 0 diverged, 0 failed" in output, output[-3000:]
    assert second.returncode == 0, second.stdout[-3000:]
    assert "in flight in another process" in second.stdout or "already recorded" in second.stdout, second.stdout
    cells = cell_dirs(tmp_path)
    assert len(cells) == 4
    for cell in cells:  # trained once, from step 0, by a SLURM job, whichever sweep's job got there first
        assert len(starts(cell)) == 1 and starts(cell)[0].endswith("from step 0"), starts(cell)
        assert record(cell)["status"] == "ok" and record(cell)["env"]["slurm_job"]
    written = {c: (c / "result.json").read_bytes() for c in cells}

    again = sweep(tmp_path, *grid)
    assert again.returncode == 0 and "(4 skipped as already recorded)" in again.stdout, again.stdout[-3000:]
    assert "Submitit 'slurm' sweep output dir" not in again.stdout  # nothing was submitted
    assert {c: (c / "result.json").read_bytes() for c in cells} == written


def test_a_cancelled_cell_fails_the_sweep_which_finishes_and_a_rerun_completes_it_once(tmp_path):
    proc = sweep(tmp_path, *CELL, "model.epochs=5,40", wait=False)
    victim = wait_until(training(tmp_path, 300), 180, "the long cell to train")
    assert "epochs=40" in victim.name
    subprocess.run(["scancel", slurm_job(victim)], check=True)
    output = proc.communicate(timeout=600)[0]
    assert proc.returncode == 1, output[-3000:]
    assert ("sweep: 1 ok, 0 diverged, 1 failed" in output
            and "ended without a result (CANCELLED" in output), output[-3000:]
    assert not (victim / "result.json").exists()
    assert (victim / "checkpoint.pt").exists()  # scancel sends SIGTERM first: the cell saved its state

    again = sweep(tmp_path, *CELL, "model.epochs=5,40")
    assert again.returncode == 0, again.stdout[-3000:]
    assert "sweep: 2 ok, 0 diverged, 0 failed (1 skipped as already recorded)" in again.stdout, again.stdout[-3000:]
    assert record(victim)["status"] == "ok" and len(list(tmp_path.rglob("result.json"))) == 2
    assert re.search(r"resuming at step [1-9]", starts(victim)[-1]), starts(victim)
    assert not (victim / "checkpoint.pt").exists()


@pytest.mark.parametrize("how", ["scancel --signal=USR2", "scontrol requeue"])
def test_a_preempted_cell_is_requeued_and_resumes_to_the_uninterrupted_result(tmp_path, uninterrupted, how):
    """SIGUSR2 (a scheduler's pre-emption warning): checkpoint, then submitit requeues the job. `scontrol requeue`
    (pre-emption with REQUEUE): SIGTERM, checkpoint and stop, SLURM requeues the job. Either way it resumes."""
    proc = sweep(tmp_path, *CELL, f"model.epochs={MEDIUM}", wait=False)
    cell = wait_until(training(tmp_path, 300), 180, "the cell to train")
    subprocess.run([*how.split(), slurm_job(cell)], check=True)
    output = proc.communicate(timeout=600)[0]
    assert proc.returncode == 0 and "sweep: 1 ok" in output, output[-3000:]
    assert len(starts(cell)) == 2 and re.search(r"resuming at step [1-9]", starts(cell)[1]), starts(cell)
    assert_same_result(cell, uninterrupted(MEDIUM))


def test_a_cell_past_its_time_limit_is_requeued_and_resumes_to_the_uninterrupted_result(tmp_path, uninterrupted):
    """A 1-minute limit with SIGUSR2 20 s before it (SLURM sends it up to 30 s earlier still): the cell
    checkpoints, submitit requeues it as timed out, and it resumes until done."""
    proc = sweep(tmp_path, *CELL, f"model.epochs={LONG}", "hydra.launcher.timeout_min=1",
                 "hydra.launcher.signal_delay_s=20", "hydra.launcher.max_num_timeout=8", wait=False)
    output = proc.communicate(timeout=600)[0]
    assert proc.returncode == 0 and "sweep: 1 ok" in output, output[-3000:]
    cell = cell_dirs(tmp_path)[0]
    assert len(starts(cell)) >= 2 and all("resuming at step" in line for line in starts(cell)[1:]), starts(cell)
    assert_same_result(cell, uninterrupted(LONG))


def test_a_two_task_job_trains_a_distributed_cell_each_task_a_rank(tmp_path):
    """BENCH_SLURM_TASKS=2 (hydra.launcher.tasks_per_node): submitit starts two tasks of one job, each joins the
    cell's process group as a rank through submitit's TorchDistributedEnvironment, and rank 0 writes the record. The
    same DDP cell trained by the elastic launcher outside SLURM ends with the same loss, bit for bit."""
    overrides = ["model=lenet", "parallel=ddp", "train.max_steps=30"]
    done = subprocess.run([sys.executable, "-m", "bench.run", "-m", *overrides, f"results_dir={tmp_path / 'here'}"],
                          cwd=CONF.parent, env=os.environ | SLURM_ENV, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    out = subprocess.run([sys.executable, "-m", "bench.run", "-m", "hydra/launcher=slurm", *overrides,
                          f"results_dir={tmp_path / 'slurm'}"], cwd=CONF.parent,
                         env=os.environ | SLURM_ENV | {"BENCH_SLURM_TASKS": "2"}, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:]
    (cell,) = cell_dirs(tmp_path / "slurm")
    (here,) = cell_dirs(tmp_path / "here")
    found, reference = record(cell), record(here)
    assert found["status"] == "ok" and found["env"]["slurm_job"] and found["parallel"]["world_size"] == 2
    assert found["parallel"]["ranks"] == "SLURM tasks (submitit)"
    assert reference["parallel"]["ranks"] == "torch's elastic launcher"
    assert len(found["parallel"]["peak_bytes_per_rank"]) == 2
    assert found["parallel"]["collective_bytes_first_step"] == {"all_reduce": 4 * 61_706}
    assert found["metrics"]["final_train_loss"] == reference["metrics"]["final_train_loss"]
    assert len(list((tmp_path / "slurm").rglob("result.json"))) == 1
