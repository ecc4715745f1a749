"""Disk faults: a full or failing results disk stops a cell with one line and the sweep goes on to its summary; a
checkpoint that cannot be resumed from is moved aside and the cell completes from the previous one or from step 0."""

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.running.checkpoint import Checkpointer
from bench.running.record import StorageError, require_free_space, write_json_atomic
from bench.tools.chaos import file_size_limit
from tests.conftest import CONF
from tests.test_sweeps import OFFLINE, records

GRID = ["-m", "format=fp32,bf16", "train.max_steps=20", "train.checkpoint_every=10"]

# Run bench.run with one writer patched to fail with ENOSPC, as a full disk makes it fail: after writing part of
# the file, for the cells whose path contains FAIL_IN.
FULL_DISK = """
import errno, json, os, runpy, sys
import torch
import bench.running.checkpoint as checkpoint, bench.running.record as record

def full(f):
    if os.environ["FAIL_IN"] in os.readlink(f"/proc/self/fd/{f.fileno()}"):
        f.write(b"partial" if "b" in f.mode else "partial")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

if os.environ["WRITER"] == "checkpoint":
    save = torch.save
    checkpoint.torch.save = lambda obj, f, *a, **k: (full(f), save(obj, f, *a, **k))
else:
    dump = json.dump
    record.json.dump = lambda obj, f, *a, **k: (
        full(f) if ".result.json." in os.readlink(f"/proc/self/fd/{f.fileno()}") else None, dump(obj, f, *a, **k))
sys.argv = ["bench.run", *sys.argv[1:]]
runpy.run_module("bench.run", run_name="__main__")
"""


def run(results: Path, *args, patch: str | None = None, fail_in: str = "", file_limit: int | None = None):
    """bench.run into `results`, with a writer patched (patch="checkpoint" or "record") or a file-size limit."""
    env = os.environ | OFFLINE | {"WRITER": patch or "", "FAIL_IN": fail_in, "RESULTS": str(results)}
    if patch:
        script = results.parent / "full_disk.py"
        script.write_text(FULL_DISK)
        cmd = [sys.executable, str(script), *args, f"results_dir={results}"]
        env["PYTHONPATH"] = os.pathsep.join([str(CONF.parent), env.get("PYTHONPATH", "")])
    else:
        cmd = [sys.executable, "-m", "bench.run", *args, f"results_dir={results}"]
    return subprocess.run(cmd, cwd=CONF.parent, env=env, capture_output=True, text=True, timeout=300,
                          preexec_fn=file_size_limit(file_limit))


def temporaries(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.name.endswith(".tmp")]


@pytest.mark.slow  # ENOSPC mid-sweep: the real write limit below (parallel launcher) runs the same path by default
def test_enospc_during_a_checkpoint_write_stops_that_cell_and_the_sweep_goes_on_to_its_summary(tmp_path):
    results = tmp_path / "runs"
    out = run(results, *GRID, patch="checkpoint", fail_in="fp32-true")
    assert out.returncode == 1, out.stderr[-3000:]
    assert "Traceback" not in out.stderr
    line = next(line for line in out.stderr.splitlines() if line.startswith("storage error:"))
    assert "fp32-true" in line and ".checkpoint.pt.tmp" in line and "No space left on device (ENOSPC)" in line
    assert "sweep: 1 ok, 0 diverged, 1 failed (0 skipped as already recorded; 1 failed without a record" in out.stderr
    assert [r["config"]["format"]["name"] for r in records(results).values()] == ["bf16"]
    assert not temporaries(results)
    again = run(results, *GRID)  # with space again: the stopped cell runs, the recorded one is skipped
    assert again.returncode == 0 and "sweep: 2 ok, 0 diverged, 0 failed (1 skipped" in again.stderr


# ENOSPC on the record: test_a_record_write_that_fails_leaves_the_old_record_and_no_temporary covers the write
# by default
@pytest.mark.slow
def test_enospc_during_the_record_write_leaves_no_record_and_the_next_launch_resumes_at_the_evaluation(tmp_path):
    results = tmp_path / "runs"
    out = run(results, *GRID, patch="record", fail_in="fp32-true")
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert "result.json" in out.stderr and "ENOSPC" in out.stderr and "1 failed without a record" in out.stderr
    assert not temporaries(results) and len(records(results)) == 1
    again = run(results, *GRID)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resuming from its checkpoint at step 20" in again.stdout + again.stderr  # trained once, not twice
    resumed = next(r for r in records(results).values() if r["config"]["format"]["name"] == "fp32")
    assert resumed["status"] == "ok" and resumed["resumed_from"] == {"checkpoint": "checkpoint.pt", "step": 20}


@pytest.mark.parametrize("launcher", [pytest.param("local", marks=pytest.mark.slow), "parallel",
                                      pytest.param("submitit_local", marks=pytest.mark.slow)])
def test_a_real_write_limit_fails_every_cell_with_one_line_whatever_the_launcher(tmp_path, launcher):
    """RLIMIT_FSIZE makes every write past 64 KiB fail with EFBIG, in the sweep and in every process it starts:
    torch.save reports it as a RuntimeError ('unexpected pos'), which the checkpoint still recognises; submitit
    cannot even write its job files, and the sweep says so in one line."""
    results = tmp_path / "runs"
    out = run(results, *GRID, f"hydra/launcher={launcher}", file_limit=64 * 2**10)
    assert out.returncode == 1, out.stderr[-3000:]
    assert "Traceback" not in out.stderr and "File too large" in out.stderr, out.stderr[-3000:]
    assert out.stderr.count("storage error:") == (1 if launcher == "submitit_local" else 2)
    assert "sweep: 0 ok, 0 diverged, 2 failed (0 skipped as already recorded; 2 failed without a record" in out.stderr
    assert not records(results) and not temporaries(results)


def test_too_little_free_space_fails_the_cell_before_training_naming_path_free_and_needed(make_cfg, monkeypatch):
    from bench.running.run import run_cell

    cfg = make_cfg("train.max_steps=5")
    usage = type("Usage", (), {"free": 5 * 2**20})
    monkeypatch.setattr("bench.running.record.shutil.disk_usage", lambda path: usage)
    trained = []
    monkeypatch.setattr("bench.running.run.train", lambda *a, **k: trained.append(1))
    with pytest.raises(StorageError, match=r"has 5.0 MiB free; this cell .* needs 3\d\.\d MiB"):
        run_cell(cfg)
    assert not trained and not list(Path(cfg.results_dir).rglob("result.json"))


def test_a_record_write_that_fails_leaves_the_old_record_and_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "result.json"
    write_json_atomic(path, {"status": "ok"})

    def full(obj, f, **kwargs):
        f.write("{\"status\": ")
        raise OSError(errno.EDQUOT, "Disk quota exceeded")

    monkeypatch.setattr("bench.running.record.json.dump", full)
    with pytest.raises(StorageError, match=r"cannot write .*result.json: Disk quota exceeded \(EDQUOT\)"):
        write_json_atomic(path, {"status": "failed"})
    assert json.loads(path.read_text()) == {"status": "ok"} and os.listdir(tmp_path) == ["result.json"]
    with pytest.raises(StorageError):
        require_free_space(tmp_path, 2**62, "everything")


def _cell_dir(results: Path) -> Path:
    return next(results.rglob("result.json")).parent


KEPT = ["train.max_steps=60", "train.checkpoint_every=20", "train.keep_checkpoint=true"]


@pytest.mark.parametrize("previous", [True, pytest.param(False, marks=pytest.mark.slow)],
                         ids=["from the previous checkpoint", "from step 0"])
def test_a_truncated_checkpoint_is_moved_aside_and_the_cell_completes_as_an_uninterrupted_run(tmp_path, previous):
    """keep_checkpoint=true keeps the last two; the newest truncated to half (an interrupted copy, a full quota),
    the cell resumes from the one before it, or without it from step 0, and ends as the uninterrupted run did."""
    results = tmp_path / "runs"
    assert run(results, *KEPT).returncode == 0
    cell = _cell_dir(results)
    reference = json.loads((cell / "result.json").read_text())
    assert reference["resumed_from"] is None and reference["discarded_checkpoints"] == []
    assert (cell / "checkpoint.previous.pt").exists()
    (cell / "result.json").unlink()
    data = (cell / "checkpoint.pt").read_bytes()
    (cell / "checkpoint.pt").write_bytes(data[: len(data) // 2])
    if not previous:
        (cell / "checkpoint.previous.pt").unlink()
    out = run(results, *KEPT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "cannot resume from it" in out.stdout + out.stderr
    record = json.loads((cell / "result.json").read_text())
    assert record["status"] == "ok" and record["metrics"] == reference["metrics"]
    assert record["resumed_from"] == ({"checkpoint": "checkpoint.previous.pt", "step": 60} if previous else None)
    (discarded,) = record["discarded_checkpoints"]
    assert discarded["moved_to"].startswith("checkpoint.pt.unreadable-") and (cell / discarded["moved_to"]).exists()
    assert "zip archive" in discarded["reason"] or "RuntimeError" in discarded["reason"]


def test_another_runs_checkpoint_is_moved_aside_not_overwritten(make_cfg, tmp_path):
    from bench.running.run import build_cell, device_preflight

    cfg = make_cfg("train.max_steps=5")
    device, precision = device_preflight(cfg)
    cell = build_cell(cfg, precision)
    other = Checkpointer(tmp_path, "another-run", None, False)
    other.save(cell.task.model, cell.optimizer, cell.scaler, cell.schedule, {"steps": 3})
    weights = {k: v.clone() for k, v in cell.task.model.state_dict().items()}
    with torch.no_grad():
        next(cell.task.model.parameters()).add_(1.0)  # this run's weights differ from the other's
    mine = {k: v.clone() for k, v in cell.task.model.state_dict().items()}
    checkpointer = Checkpointer(tmp_path, "this-run", None, False)
    assert checkpointer.restore(cell.task.model, cell.optimizer, cell.scaler, cell.schedule) is None
    assert "another configuration's (run_id another-run, this run this-run)" in checkpointer.discarded[0]["reason"]
    assert not (tmp_path / "checkpoint.pt").exists() and (tmp_path / checkpointer.discarded[0]["moved_to"]).exists()
    assert all(torch.equal(v, mine[k]) for k, v in cell.task.model.state_dict().items())
    assert not all(torch.equal(v, weights[k]) for k, v in mine.items())


def test_a_checkpoint_that_fails_half_way_through_loading_leaves_the_model_as_it_was(make_cfg, tmp_path):
    """The model takes its weights, then the optimiser refuses its state: the model must not keep them."""
    from bench.running.run import build_cell, device_preflight

    cfg = make_cfg("train.max_steps=5")
    cell = build_cell(cfg, device_preflight(cfg)[1])
    before = {k: v.clone() for k, v in cell.task.model.state_dict().items()}
    state = {"run_id": "r", "model": {k: v + 1 for k, v in before.items()}, "optimizer": {"state": {}},
             "schedule": None, "scaler": {}, "rng": {}, "loop": {"steps": 1}}
    torch.save(state, tmp_path / "checkpoint.pt")
    checkpointer = Checkpointer(tmp_path, "r", None, False)
    assert checkpointer.restore(cell.task.model, cell.optimizer, cell.scaler, cell.schedule) is None
    assert all(torch.equal(v, before[k]) for k, v in cell.task.model.state_dict().items())
    assert checkpointer.discarded[0]["reason"].startswith("KeyError")
