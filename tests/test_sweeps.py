"""Sweeps at cluster scale, on one machine: subprocess launcher, skip-finished, failure isolation,
resume after a kill or a preemption signal, and one offline W&B run per cell."""

import json
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from bench.errors import ConfigError
from bench.tools.chaos import raising_cell
from tests.conftest import CONF

OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_SILENT": "true"}


def bench(tmp_path, *args, wait=True, sigint=signal.SIG_DFL):
    """`python -m bench.run ...`; `sigint`: the child's SIGINT disposition at its start (a background job's shell
    ignores it: SIG_IGN)."""
    cmd = [sys.executable, "-m", "bench.run", *args, f"results_dir={tmp_path}"]
    env = os.environ | OFFLINE
    if not wait:
        return subprocess.Popen(cmd, cwd=CONF.parent, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, sigint))
    return subprocess.run(cmd, cwd=CONF.parent, env=env, capture_output=True, text=True, timeout=300)


def records(root):
    return {str(p.parent.relative_to(root)): json.loads(p.read_text()) for p in Path(root).rglob("result.json")}


# A plug-in that makes the cell of seed 1 step slowly (a third of a second a backward pass): a worker whose cell stops
# first must not end the sweep while this one is still in its step.
SLOW_SEED_ONE = """
import time
import torch

_backward = torch.Tensor.backward

def _slowly(self, *args, **kwargs):
    if torch.initial_seed() == 1:
        time.sleep(0.3)
    return _backward(self, *args, **kwargs)
torch.Tensor.backward = _slowly
"""


@pytest.mark.slow
@pytest.mark.parametrize("how, jobs", [(signal.SIGINT, 2), (signal.SIGTERM, 4)])
def test_a_signal_to_a_parallel_sweeps_process_alone_saves_every_running_cell_and_starts_no_other(tmp_path, how,
                                                                                                  jobs):
    """`kill -INT <pid>` (or -TERM) of a parallel sweep's own process, not its process group: each running cell
    saves a checkpoint at its next step boundary, the slow one (seed 1) too, after a fast one has stopped; with two
    workers the queued third cell never starts; with four, none is left without a cell (a worker that never ran one
    would end on the signal, and joblib then kill the others); one line, no traceback, exit 128 + the signal. (It
    raised KeyboardInterrupt, and joblib killed its workers mid-step, with no checkpoint saved.)"""
    (tmp_path / "slow_seed_one.py").write_text(SLOW_SEED_ONE)
    results = tmp_path / "results"
    cmd = [sys.executable, "-m", "bench.run", "-m", "hydra/launcher=parallel", "model=lenet", "seed=0,1,2",
           "train.epochs=200", "train.checkpoint_every=100000", "plugins=[slow_seed_one]", f"results_dir={results}",
           f"hydra.sweep.dir={tmp_path / 'multirun'}"]
    env = os.environ | OFFLINE | {"BENCH_PARALLEL_JOBS": str(jobs),
                                  "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    sweep = subprocess.Popen(cmd, cwd=CONF.parent, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, start_new_session=True,  # its own group: the signal reaches it alone
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.time() + 120
    while time.time() < deadline and sweep.poll() is None:
        logs = list(results.rglob("metrics.jsonl"))
        if len(logs) == min(jobs, 3) and all(log.read_text().count("\n") >= 2 for log in logs):  # all training
            break
        time.sleep(0.05)
    assert sweep.poll() is None, "the sweep ended before it could be signalled"
    sweep.send_signal(how)
    output = sweep.communicate(timeout=120)[0]
    assert sweep.returncode == 128 + how, output[-3000:]
    assert "interrupted: the sweep's running cells saved their checkpoints" in output and "Traceback" not in output
    assert "not every cell" not in output  # no worker ended before its cell saved
    cells = {path.parent.name.split(",")[0]: path.parent for path in results.rglob("metrics.jsonl")}
    assert sorted(cells) == ["seed0", "seed1", "seed2"][:jobs]  # with two workers seed 2, queued, never started
    for seed, cell in cells.items():
        steps = torch.load(cell / "checkpoint.pt", weights_only=False)["loop"]["steps"]
        assert steps > 0 and not (cell / "result.json").exists(), seed


@pytest.mark.slow  # end to end through submitit's local executor; the SLURM tests run the same plug-in on a cluster
def test_submitit_local_runs_cells_as_subprocesses_and_a_rerun_skips_them(tmp_path):
    grid = ["-m", "hydra/launcher=submitit_local", "format=fp32,fp16", "scaling=none,static", "train.max_steps=3"]
    first = bench(tmp_path, *grid)
    assert first.returncode == 0, first.stderr[-3000:]
    found = records(tmp_path)
    assert len(found) == 4 and all(r["status"] == "ok" for r in found.values())
    pids = {r["env"]["pid"] for r in found.values()}
    assert len(pids) == 4 and os.getpid() not in pids  # four processes, none of them this one
    before = {p: p.read_bytes() for p in Path(tmp_path).rglob("result.json")}
    again = bench(tmp_path, *grid)
    assert again.returncode == 0 and "4 skipped as already recorded" in again.stderr
    assert {p: p.read_bytes() for p in Path(tmp_path).rglob("result.json")} == before


def _raising_grid(tmp_path, good) -> list[str]:
    """A truncated checkpoint (its cells raise while building) and a good one (its cells succeed)."""
    truncated = raising_cell(tmp_path / "truncated")[2].split("=", 1)[1]
    return ["-m", "model=bert_tiny", "model.pretrained=true", f"model.hub_name={truncated},{good}",
            "train.max_steps=3"]


def test_a_failing_cell_is_recorded_and_the_others_go_on(tmp_path, make_checkpoint):
    results = tmp_path / "runs"
    grid = [*_raising_grid(tmp_path, make_checkpoint("bert")), "format=fp32,fp16"]
    out = bench(results, *grid)
    assert out.returncode == 1
    assert "sweep: 2 ok, 0 diverged, 2 failed" in out.stderr, out.stderr[-2000:]
    failed = [r for r in records(results).values() if r["status"] == "failed"]
    assert len(failed) == 2 and all("Traceback" in r["traceback"] for r in failed), [r["reason"] for r in failed]
    skipped = bench(results, *grid)
    assert skipped.returncode == 1 and "4 skipped" in skipped.stderr  # a failed record is still a failure
    retried = bench(results, *grid, "retry_failed=true")
    assert "(2 skipped" in retried.stderr  # the ok cells stay skipped, the failed ones ran again


def test_fail_fast_stops_the_sweep_at_the_first_exception(tmp_path, make_checkpoint):
    results = tmp_path / "runs"
    out = bench(results, *_raising_grid(tmp_path, make_checkpoint("bert")), "fail_fast=true")
    assert out.returncode != 0 and "Traceback" in out.stderr
    assert [r["status"] for r in records(results).values()] == ["failed"]  # the good checkpoint's cell never ran


def test_a_corrupt_record_is_reported_and_its_cell_runs_again(tmp_path):
    first = bench(tmp_path, "-m", "format=fp32,fp16", "train.max_steps=3")
    written = sorted(Path(tmp_path).rglob("result.json"))
    assert first.returncode == 0 and len(written) == 2
    assert all(f"record: {path}" in first.stdout for path in written), first.stdout  # each cell's line says where
    corrupt = next(Path(tmp_path).rglob("fp16-mixed/none/seed0,train.max_steps=3/result.json"))
    corrupt.write_text('{"status": "ok", "conf')
    out = bench(tmp_path, "-m", "format=fp32,fp16", "train.max_steps=3")
    assert out.returncode == 0 and str(corrupt) in out.stdout + out.stderr and "1 skipped" in out.stderr
    assert json.loads(corrupt.read_text())["status"] == "ok"


def _final_weights(run_dir: Path) -> dict:
    return torch.load(run_dir / "checkpoint.pt", weights_only=False)["model"]


# SIGUSR2 and SIGTERM are what SLURM sends: the cluster tests pre-empt and requeue real jobs with them, so here they
# run with the slow tests, as does Ctrl-C (SIGINT: the checkpoint path SIGKILL's resumption shares, plus a handler);
# the kill stays in make test
# the run's SIGINT at default (a terminal's Ctrl-C) and ignored (a background job's shell ignores it; kill -INT then)
@pytest.mark.parametrize("how, sigint", [(signal.SIGKILL, signal.SIG_DFL),
                                         pytest.param(signal.SIGUSR2, signal.SIG_DFL, marks=pytest.mark.slow),
                                         pytest.param(signal.SIGTERM, signal.SIG_DFL, marks=pytest.mark.slow),
                                         pytest.param(signal.SIGINT, signal.SIG_DFL, marks=pytest.mark.slow),
                                         pytest.param(signal.SIGINT, signal.SIG_IGN, marks=pytest.mark.slow)])
def test_an_interrupted_run_resumes_to_bitwise_the_same_weights(tmp_path, how, sigint):
    args = ["format=fp32", "train.checkpoint_every=40", "train.keep_checkpoint=true", "train.max_steps=600"]
    reference_dir, interrupted_dir = tmp_path / "reference", tmp_path / "interrupted"
    assert bench(reference_dir, *args).returncode == 0
    cell = next(reference_dir.rglob("result.json")).parent
    proc = bench(interrupted_dir, *args, wait=False, sigint=sigint)
    checkpoint = interrupted_dir / cell.relative_to(reference_dir) / "checkpoint.pt"
    deadline = time.time() + 120
    while not checkpoint.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.005)
    assert proc.poll() is None, "the run finished before it could be interrupted"
    proc.send_signal(how)
    output = proc.communicate(timeout=60)[0]
    assert proc.returncode != 0 and not (checkpoint.parent / "result.json").exists()
    if how == signal.SIGINT:  # Ctrl-C: one line saying what stopped and how to resume, no traceback
        assert "interrupted: default/lenet" in output and "run the same command again" in output
        assert "Traceback" not in output
    stopped_at = torch.load(checkpoint, weights_only=False)["loop"]["steps"]
    assert 0 < stopped_at < 600
    resumed = bench(interrupted_dir, *args)
    assert resumed.returncode == 0
    assert f"resuming from its checkpoint at step {stopped_at}" in resumed.stdout + resumed.stderr
    reference, result = _final_weights(cell), _final_weights(checkpoint.parent)
    assert all(torch.equal(reference[k], result[k]) for k in reference)
    logged = [json.loads(line) for line in (checkpoint.parent / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in logged if "loss" in r]
    assert steps == sorted(set(steps)) == list(range(0, 600, 10))  # no step lost or logged twice
    evaluations = [r for r in logged if "loss" not in r]  # the quality curve's, after each epoch: as uninterrupted
    reference_log = [json.loads(line) for line in (cell / "metrics.jsonl").read_text().splitlines()]
    assert len(evaluations) > 1 and evaluations == [r for r in reference_log if "loss" not in r]
    ours, theirs = (json.loads((d / "result.json").read_text()) for d in (checkpoint.parent, cell))
    assert ours["metrics"] == theirs["metrics"] and ours["timing"]["steps"] == 600


def _wandb_records(path: Path) -> list:
    """Records of an offline .wandb file: wandb's LevelDB-style log (7-byte header, 32 KiB blocks)."""
    from wandb.proto import wandb_internal_pb2

    data, pos, out, pending = path.read_bytes(), 7, [], b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            break
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            out.append(record)
            pending = b""
    return out


def test_each_cell_gets_its_own_offline_wandb_run_with_config_and_summary(tmp_path):
    out = bench(tmp_path, "-m", "logger=wandb", "format=fp32,fp8", "train.max_steps=3")
    assert out.returncode == 0, out.stderr[-3000:]
    for cell, record in records(tmp_path).items():
        runs = list((Path(tmp_path) / cell / "wandb").glob("offline-run-*/*.wandb"))
        assert len(runs) == 1, cell
        logged = _wandb_records(runs[0])
        run = next(r.run for r in logged if r.WhichOneof("record_type") == "run")
        assert run.run_id == record["run_id"] and run.run_group == "default" and run.job_type == "lenet"
        assert set(run.tags) == {record["config"]["format"]["name"], record["config"]["format"]["mode"],
                                 record["env"]["precision"]["backend"], "none"}
        config = {i.key: json.loads(i.value_json) for i in run.config.update}
        assert config["format"] == record["config"]["format"] and config["seed"] == 0
        summary = {}
        for r in logged:
            if r.WhichOneof("record_type") == "summary":
                summary |= {i.key: i.value_json for i in r.summary.update if i.key}
        assert json.loads(summary["status"]) == "ok" and json.loads(summary["run_id"]) == record["run_id"]
    assert not list(CONF.parent.glob("wandb"))  # nothing in the repository root


def test_two_sweeps_into_one_directory_at_once_train_each_cell_once(tmp_path):
    grid = ["-m", "format=fp32,fp16", "scaling=none,static", "train.max_steps=300"]  # long enough that they overlap
    first = bench(tmp_path, *grid, wait=False)
    deadline = time.time() + 120
    while not list(Path(tmp_path).rglob(".lock")) and time.time() < deadline:
        time.sleep(0.05)  # the first sweep is training its first cell
    second = bench(tmp_path, *grid, wait=False)
    outputs = [p.communicate(timeout=300)[0] for p in (first, second)]
    assert first.returncode == 0 and second.returncode == 0, outputs
    both = "\n".join(outputs)
    trained = [line.split(" - ")[1].split(":")[0] for line in both.splitlines() if ": ok {" in line]
    assert len(trained) == 4 and len(set(trained)) == 4, trained  # four cells, each trained by one sweep
    assert "another process is training it now" in both
    assert len(records(tmp_path)) == 4


def test_a_signal_handler_that_returns_does_not_keep_the_cell_training(tmp_path):
    """submitit's SIGTERM handler only logs: after the checkpoint the cell stops all the same (SIGKILL would
    otherwise end it mid-step)."""
    from bench.running.checkpoint import Checkpointer

    logged = []
    previous = signal.signal(signal.SIGTERM, lambda *a: logged.append("bypassed"))
    try:
        saved = []
        with Checkpointer(tmp_path, "id", None, False) as checkpointer:
            os.kill(os.getpid(), signal.SIGTERM)
            with pytest.raises(SystemExit) as stop:
                checkpointer.after_step(7, lambda: saved.append(7))
        assert saved == [7] and logged == ["bypassed"] and stop.value.code == 128 + signal.SIGTERM
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_the_checkpoint_outlives_the_final_evaluation_and_goes_with_the_record(make_cfg, tmp_path, monkeypatch):
    """A pre-emption during a long evaluation (BERT on SQuAD's dev set) must not retrain from step 0."""
    import bench.running.run

    seen = {}
    build = bench.running.run.build_task

    def build_watching(*args):
        task = build(*args)
        evaluate = task.evaluate

        def watched(model, inputs):
            seen["checkpoint during evaluation"] = any(Path(tmp_path).rglob("checkpoint.pt"))
            return evaluate(model, inputs)

        task.evaluate = watched
        return task

    monkeypatch.setattr(bench.running.run, "build_task", build_watching)
    record = bench.running.run.run_cell(make_cfg("train.max_steps=20"))
    assert record["status"] == "ok" and seen == {"checkpoint during evaluation": True}
    assert not any(Path(tmp_path).rglob("checkpoint.pt"))  # keep_checkpoint=false: gone once the record is written


def test_a_cell_killed_during_its_final_evaluation_resumes_there_without_retraining(tmp_path):
    args = ["train.max_steps=200", "train.keep_checkpoint=true"]
    assert bench(tmp_path, *args).returncode == 0
    record = next(Path(tmp_path).rglob("result.json"))
    first = json.loads(record.read_text())
    record.unlink()  # as if the job was killed while evaluating: the final checkpoint is there, no record
    again = bench(tmp_path, *args)
    assert again.returncode == 0 and "resuming from its checkpoint at step 200" in again.stdout + again.stderr
    second = json.loads(record.read_text())
    assert second["metrics"] == first["metrics"] and second["timing"]["steps"] == 200


def _submitit_jobs() -> list[int]:
    """PIDs of submitit's local job processes (python -m submitit.core._submit ...)."""
    pids = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if b"submitit.core._submit" in cmdline.read_bytes():
                pids.append(int(cmdline.parent.name))
        except OSError:
            continue
    return pids


@pytest.mark.slow  # make test-cluster cancels a real SLURM job the same way (tests/cluster, in CI)
def test_a_job_that_ends_without_a_result_fails_its_cell_and_the_sweep_finishes(tmp_path):
    """As scancel, an out-of-memory kill or a node failure: the sweep waits for the others, prints its summary
    with that cell failed, exits 1; the next launch completes the cell with exactly one record."""
    grid = ["-m", "hydra/launcher=submitit_local", "format=fp32,fp16", "train.max_steps=400"]
    proc = bench(tmp_path, *grid, wait=False)
    deadline = time.time() + 120
    while not (list(Path(tmp_path).rglob(".lock")) and _submitit_jobs()) and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(1.0)  # training
    victim = _submitit_jobs()[0]
    os.kill(victim, signal.SIGKILL)
    output = proc.communicate(timeout=300)[0]
    assert proc.returncode == 1, output[-3000:]
    assert "sweep: 1 ok, 0 diverged, 1 failed" in output and "ended without a result" in output, output[-3000:]
    assert len(records(tmp_path)) == 1  # the killed cell wrote nothing
    again = bench(tmp_path, *grid)
    assert again.returncode == 0 and "sweep: 2 ok" in again.stderr, again.stderr[-3000:]
    assert len(records(tmp_path)) == 2


@pytest.mark.parametrize("sacct", ["missing", "accounting off"])
def test_a_slurm_sweep_without_accounting_stops_before_submitting(tmp_path, sacct):
    """submitit sees a job end only through sacct: without it a cancelled cell would keep the sweep waiting
    forever, so the sweep refuses to start (exit 2) and submits nothing."""
    stubs = tmp_path / "bin"
    stubs.mkdir()
    (stubs / "sbatch").write_text(f"#!/bin/sh\ntouch {tmp_path}/submitted\nexit 1\n")
    if sacct == "accounting off":
        (stubs / "sacct").write_text("#!/bin/sh\necho 'Slurm accounting storage is disabled' >&2\nexit 1\n")
    for stub in stubs.iterdir():
        stub.chmod(0o755)
    cmd = [sys.executable, "-m", "bench.run", "-m", "hydra/launcher=slurm", "format=fp32,bf16",
           f"results_dir={tmp_path / 'runs'}"]
    out = subprocess.run(cmd, cwd=CONF.parent, env=os.environ | OFFLINE | {"PATH": str(stubs)}, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    expected = "which is not on PATH" if sacct == "missing" else "Slurm accounting storage is disabled"
    assert "needs SLURM" in out.stderr or "needs sacct" in out.stderr
    assert expected in out.stderr and "slurmdbd" in out.stderr, out.stderr[-2000:]
    assert not (tmp_path / "submitted").exists() and not records(tmp_path)


def test_sweeper_settings_cross_each_override_set_with_the_swept_params():
    """hydra.sweeper.settings: a grid that is not a full product (the Unit Scaling paper's columns), every setting
    once per combination of the swept params, the settings varying fastest."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from hydra_plugins.bench_sweeper.checking_sweeper import CheckingSweeper

    sweeper = CheckingSweeper(max_batch_size=None, params=None,
                              settings=["format=fp16 scaling=static", "format=fp32 scaling=unit"])
    overrides = OverridesParser.create().parse_overrides(["seed=0,1", "train.max_steps=3"])
    assert sweeper.split_arguments(overrides, None) == [[
        ["seed=0", "train.max_steps=3", "format=fp16", "scaling=static"],
        ["seed=0", "train.max_steps=3", "format=fp32", "scaling=unit"],
        ["seed=1", "train.max_steps=3", "format=fp16", "scaling=static"],
        ["seed=1", "train.max_steps=3", "format=fp32", "scaling=unit"]]]
    plain = CheckingSweeper(max_batch_size=None, params=None)
    assert plain.split_arguments(overrides, None) == [[["seed=0", "train.max_steps=3"],
                                                       ["seed=1", "train.max_steps=3"]]]


def test_a_key_set_by_both_the_settings_and_the_command_line_stops_the_sweep(tmp_path):
    done = bench(tmp_path, "-m", "experiment=unit_scaling_charlm", "format=fp32")
    assert done.returncode == 2
    assert ("format is set by hydra.sweeper.settings (format=fp16 scaling=none) and also on the command line"
            in done.stderr)
    assert not list(tmp_path.rglob("result.json"))


def test_unit_scaling_charlm_preset_is_the_papers_columns_plus_fp8_and_every_cell_passes_the_checks(make_cfg):
    from hydra import compose, initialize_config_dir

    from bench.running.config import check

    cfg = make_cfg("experiment=unit_scaling_charlm")
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        sweep = compose("config", overrides=["experiment=unit_scaling_charlm"], return_hydra_config=True).hydra.sweeper
    settings = [tuple(s.split()) for s in sweep.settings]
    assert settings == [("format=fp16", "scaling=none"), ("format=fp16", "scaling=static"),
                        ("format=fp16", "scaling=unit"),
                        ("format=fp32", "scaling=none"), ("format=fp32", "scaling=unit"),
                        ("format=fp8", "scaling=dynamic"), ("format=fp8", "scaling=per_tensor"),
                        ("format=fp8", "scaling=unit")]
    assert dict(sweep.params) == {"model.arch.norm": "pre,post", "seed": "0,1,2"}
    assert cfg.model.name == "charlm" and cfg.model.iterations == 2000
    for setting in settings:
        cell = make_cfg("experiment=unit_scaling_charlm", *setting, "model.arch.norm=post")
        check(cell)
        if "scaling=static" in setting:
            assert cell.scaling.init_scale == 2048  # the paper's FP16 baseline
        if "scaling=unit" in setting:
            assert cell.scaling.lr_rule == "relative"


def test_block_formats_preset_declares_each_row_once_and_every_cell_passes_the_checks(make_cfg):
    """The preset's settings are its table's rows (label, bits): the cell each row selects, as the tables read it
    from the declaration, is the cell the runner makes of that setting on each model, and each passes the checks."""
    from hydra import compose, initialize_config_dir

    from bench.reporting.aggregate import format_options
    from bench.reporting.experiment_tables import declared_table
    from bench.running.config import check
    from bench.running.run import build_precision

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        sweep = compose("config", overrides=["experiment=block_formats"], return_hydra_config=True).hydra.sweeper
    assert dict(sweep.params) == {"model": "lenet,distilbert_tiny,bert_tiny", "seed": "0,1,2"}
    layout, rows = declared_table("block_formats")
    assert layout == "block_formats" and len(rows) == len(sweep.settings) == 16
    for setting, row in zip(sweep.settings, rows):
        for model in ("lenet", "distilbert_tiny", "bert_tiny"):
            cell = make_cfg("experiment=block_formats", f"model={model}", *setting.overrides.split())
            check(cell)
            precision = build_precision(cell, torch.device("cpu"))
            made = (precision.setting, cell.scaling.name, cell.format.rounding, format_options(cell.format))
            assert made == (row.setting, row.scaling, row.rounding, row.options) and row.label == setting.label


def test_nvfp4_recipe_preset_rows_are_the_cells_it_makes_and_each_pairing_names_a_row(make_cfg, monkeypatch):
    """Each labelled setting selects the cell the runner makes of it (on the char-LM's config, unbuilt); every
    `against` names a row; one that names none stops the table's declaration with the labels there are."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from bench.reporting import experiment_tables
    from bench.reporting.aggregate import format_options
    from bench.running.run import build_precision

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        sweep = compose("config", overrides=["experiment=nvfp4_recipe"], return_hydra_config=True).hydra.sweeper
    layout, rows = experiment_tables.declared_table("nvfp4_recipe")
    assert layout == "ablation" and len(rows) == len(sweep.settings) == 12
    assert {row.against for row in rows} == {"", "full recipe"}
    for setting, row in zip(sweep.settings, rows):
        cell = make_cfg("experiment=nvfp4_recipe", *setting.overrides.split())
        precision = build_precision(cell, torch.device("cpu"))
        options = format_options(OmegaConf.to_container(cell.format))  # as a record's config holds it
        made = (precision.setting, cell.scaling.name, cell.format.rounding, options)
        assert made == (row.setting, row.scaling, row.rounding, row.options) and row.label == setting.label
    # the same preset over 2,000 iterations takes its settings through its defaults list: the same rows
    longer_layout, longer_rows = experiment_tables.declared_table("nvfp4_recipe_2000")
    assert longer_layout == layout and [r._replace(bits=0) for r in longer_rows] == [r._replace(bits=0) for r in rows]
    typo = OmegaConf.create({"table": "ablation", "settings": [
        {"overrides": "format=bf16", "label": "BF16"},
        {"overrides": "format=nvfp4", "label": "plain", "against": "ful recipe"}]})
    monkeypatch.setattr(experiment_tables, "preset_sweeper", lambda experiment: typo)
    with pytest.raises(ConfigError, match="'plain' is paired against 'ful recipe', which labels no setting; "
                                          "valid: BF16, plain"):
        experiment_tables.declared_table("typo")
