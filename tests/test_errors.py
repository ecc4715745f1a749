"""The mistakes users make, each answered the same way: exit 2 before anything trains, a message naming the valid
choices (and the nearest one), nothing written; a record already there is never lost."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import CONF

ROOT = CONF.parent


def _run(module: str, *args, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})


@pytest.mark.parametrize("args, says", [
    (["format=fp9"], "format=fp9 is not an option; valid: bf16, bf16-true, fp16, fp16-true, fp32, fp8"),
    (["-m", "format=fp32,fp9"], "(did you mean fp8?)"),
    (["format=FP8"], "(did you mean fp8?)"),  # case aside (a newcomer's capitals had no suggestion)
    # two mistakes, both named at once (a newcomer met the second only after mending the first, 2026-11-30)
    (["-m", "format=fp32,fp9", "scaling=none,bogus"], "(did you mean fp8?); scaling=bogus is not an option"),
    (["train.max_stps=5", "model.optimizr.lr=1"],
     "(did you mean train.max_steps?); unknown config key model.optimizr.lr (did you mean model.optimizer?)"),
    (["-m", "format=tf32,fp8,fp32", "format.backend=native", "device=cpu", "seed=0,1"],
     "seed=0 results_dir={runs}] (and 1 more cells): format.backend=native but fp8 has no native path on cpu"),
    (["scaling=unti"], "(did you mean unit?)"),
    (["seed=-1"], "seed=-1: a seed is a whole number from 0 to 2**32 - 1"),  # trained, failed and was recorded
    (["train.max_stesp=5"], "unknown config key train.max_stesp (did you mean train.max_steps?)"),
    (["model.optimizer.lrr=1"], "(did you mean model.optimizer.lr?)"),
    (["+train.max_stesp=5"], "unknown config key: train.max_stesp (did you mean train.max_steps?)"),
    (["format=fp32", "format.scale_mode=ceil"], "format.scale_mode applies to the block formats only"),
    (["model=charlm", "model.data.source=local", "model.data.path=/nonexistent/input.txt", "train.max_steps=1"],
     "model.data.path=/nonexistent/input.txt: no such file"),
    (["model=bert_tiny", "model.data.files.train=/nonexistent/train.jsonl", "train.max_steps=1"],
     "model.data.files: no such file (train: /nonexistent/train.jsonl)"),
    (["-m", "hydra.sweeper.table=block_format", "format=fp32"],  # a preset's table name, misspelt: no table at all
     "hydra.sweeper.table='block_format' is not a table; valid: unit_scaling_charlm, block_formats, lr_transfer, "
     "labelled_rows, ablation (did you mean block_formats?)"),
])
def test_a_mistake_exits_2_naming_the_choices_and_writes_nothing(tmp_path, args, says):
    out = _run("bench.run", *args, f"results_dir={tmp_path / 'runs'}", cwd=tmp_path)
    assert out.returncode == 2, out.stderr[-1500:]
    assert says.format(runs=tmp_path / "runs") in out.stderr and "Traceback" not in out.stderr, out.stderr[-1500:]
    assert not list(tmp_path.rglob("result.json")) and not (tmp_path / "default").exists()


@pytest.mark.parametrize("results_dir, says", [("", "results_dir= is empty"), ("{file}", "is not a directory"),
                                               ("{file}/below", "is not a directory")])
def test_a_results_dir_that_cannot_hold_records_is_a_config_error(tmp_path, results_dir, says):
    (tmp_path / "a-file").write_text("")
    out = _run("bench.run", f"results_dir={results_dir.format(file=tmp_path / 'a-file')}", "train.max_steps=1",
               cwd=tmp_path)
    assert (out.returncode, says in out.stderr) == (2, True), out.stderr[-1500:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]  # no ./default/ beside it


def test_a_failed_cell_run_again_says_how_to_retry(tmp_path):
    args = ["model=lenet", "train.max_steps=1", f"results_dir={tmp_path / 'runs'}"]
    assert _run("bench.run", *args, cwd=tmp_path).returncode == 0
    path = next((tmp_path / "runs").rglob("result.json"))
    record = json.loads(path.read_text()) | {"status": "failed", "reason": "RuntimeError: a stand-in failure"}
    path.write_text(json.dumps(record))
    again = _run("bench.run", *args, cwd=tmp_path)
    assert again.returncode == 1 and "retry_failed=true runs failed and diverged cells again" in again.stderr
    assert json.loads(path.read_text()) == record  # the record is kept as it was
    sweep = _run("bench.run", "-m", *args, cwd=tmp_path)
    assert "sweep: 0 ok, 0 diverged, 1 failed (1 skipped as already recorded); retry_failed=true" in sweep.stderr


def test_aggregate_mistakes_are_one_line_and_exit_2(tmp_path):
    missing = _run("bench.aggregate", str(tmp_path / "nowhere"), cwd=tmp_path)
    assert (missing.returncode, "not a results directory" in missing.stderr) == (2, True)
    no_key = _run("bench.aggregate", "wandb://someone/project", cwd=tmp_path,
                  env={"WANDB_API_KEY": "", "HOME": str(tmp_path), "WANDB_CONFIG_DIR": str(tmp_path)})
    assert no_key.returncode == 2 and "Traceback" not in no_key.stderr, no_key.stderr[-1500:]
    assert no_key.stderr.strip().count("\n") == 0 and "W&B refused" in no_key.stderr


def test_aggregate_writes_under_results_local_unless_told(tmp_path):
    assert _run("bench.run", "train.max_steps=1", f"results_dir={tmp_path / 'runs'}", cwd=tmp_path).returncode == 0
    out = _run("bench.aggregate", str(tmp_path / "runs"), "--no-plots", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-1500:]
    assert (tmp_path / "results" / "local" / "tables" / "default" / "precision.md").is_file()
    assert not (tmp_path / "results" / "tables").exists()


@pytest.mark.parametrize("sweep", [[], ["-m"]])
def test_a_native_path_refused_while_converting_is_a_setup_error(tmp_path, sweep):
    """Native FP8 on a model torchao converts nothing of (LeNet: no Linear has both sizes multiples of 16) is refused
    only as the model is converted, after the cell has started (bench/numerics/precision.py): still a set-up problem
    like any other, so `python -m bench.run` exits 2 naming the valid choices and leaves nothing behind, as a run
    and as a sweep (whose multirun.yaml it left). A CPU has no native FP8, so the process declares one (the way
    bench.tools.matrix simulates devices) before the command runs."""
    simulated = ("import dataclasses, sys; import bench.numerics.specs as specs; "
                 "from bench.numerics.hardware import NativeSupport; "
                 "specs.FORMAT_SPECS['fp8'] = dataclasses.replace(specs.FORMAT_SPECS['fp8'], "
                 "native=lambda device: NativeSupport(True, True, 'a simulated FP8 device')); "
                 "sys.argv = ['bench.run', *sys.argv[1:]]; from bench.run import main; main()")
    out = subprocess.run([sys.executable, "-c", simulated, *sweep, "model=lenet", "format=fp8", "format.backend=native",
                          "scaling=per_tensor", "train.max_steps=2", f"results_dir={tmp_path / 'runs'}"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 2, out.stderr[-1500:]
    assert "format.backend=native: torchao's float8 training converts only Linear layers whose in and out features " \
           "are multiples of 16, and this model has none" in out.stderr
    assert "valid here: format.backend=auto or emulated" in out.stderr and "Traceback" not in out.stderr
    assert not list(tmp_path.rglob("*.json*")) and not list((tmp_path / "runs").rglob("*"))




def test_make_refuses_a_python_given_as_py_naming_venv_and_python():
    """`make test PY=python3` had every target install into that interpreter (setup's pip into a system Python, a
    newcomer's trial, 2026-11-30): PY is the environment's own, and make now says which settings choose it."""
    outside_make = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}  # make test
    said = subprocess.run(["make", "help", "PY=python3"], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env=outside_make)
    assert said.returncode == 2 and not said.stdout, said.stdout + said.stderr
    assert "choose VENV=<dir>" in said.stderr and "PYTHON=<interpreter>" in said.stderr, said.stderr
