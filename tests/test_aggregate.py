"""Tables and plots from records the test writes, checked against values computed by hand."""

import json
import re
from pathlib import Path

import pytest

from bench.aggregate import main  # the entry point users type
from bench.reporting.aggregate import load_wandb, summarise, to_frame
from bench.running.record import write_json_atomic

MiB = 2**20


def record(model="lenet", fmt="fp32", mode="true", setting="32-true", scaling="none", seed=0, status="ok",
           metrics=None, train_s=10.0, peak=100 * MiB, backend="native", data=None, pretrained=True):
    data = data or ({"source": "digits", "name": "ylecun/mnist"} if model == "lenet" else
                    {"source": "local",
                     "name": {"distilbert": "stanfordnlp/imdb", "bert_base": "rajpurkar/squad"}[model]})
    return {
        "status": status, "reason": None if status == "ok" else status,
        "config": {"experiment_name": "t", "seed": seed,
                   "model": {"name": model, "data": data, "pretrained": pretrained},
                   "format": {"name": fmt, "mode": mode}, "scaling": {"name": scaling}},
        "env": {"device_name": "cpu-x", "precision": {"setting": setting, "backend": backend}},
        "metrics": metrics if metrics is not None else {}, "timing": {"train_s": train_s, "steps": 30},
        "memory": {"peak_bytes": peak},
        "numerics": {"skipped_steps": 0, "final_loss_scale": 1.0,
                     "diverged_at_step": 5 if status == "diverged" else None,
                     "loss_scale": {"history": [[0, 1.0]]},
                     "quantisation": {"gradients": {"underflow_fraction": 0.01 * seed, "subnormal_fraction": 0.0,
                                                    "overflow_fraction": 0.0}}},
    }


def write(root: Path, rec: dict) -> None:
    cfg = rec["config"]
    d = root / cfg["model"]["name"] / rec["env"]["precision"]["setting"] / cfg["scaling"]["name"] / f"seed{cfg['seed']}"
    write_json_atomic(d / "result.json", rec)
    (d / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 2.0 / (s + 1)}) + "\n"
                                             for s in range(0, 30, 10))
                                     + '{"step": 30, "lo')  # a torn last line, as after a kill


RECORDS = [
    record(seed=0, metrics={"test_accuracy": 0.90}, train_s=10),
    record(seed=1, metrics={"test_accuracy": 0.92}, train_s=12),
    record(seed=2, metrics={"test_accuracy": 0.94}, train_s=14),
    # fp8: seed 2 missing
    record(fmt="fp8", mode="mixed", setting="fp8-mixed", seed=0, metrics={"test_accuracy": 0.80}, train_s=20,
           backend="emulated"),
    record(fmt="fp8", mode="mixed", setting="fp8-mixed", seed=1, metrics={"test_accuracy": 0.84}, train_s=22,
           backend="emulated"),
    # 16-mixed dynamic: one diverged, one ok
    record(fmt="fp16", mode="mixed", setting="16-mixed", scaling="dynamic", seed=0, status="diverged",
           metrics={"test_accuracy": 0.10}, backend="emulated"),
    record(fmt="fp16", mode="mixed", setting="16-mixed", scaling="dynamic", seed=1, metrics={"test_accuracy": 0.90},
           backend="emulated"),
    # bf16 static: failed, no metrics
    record(fmt="bf16", mode="mixed", setting="bf16-mixed", scaling="static", status="failed"),
    # SQuAD cells
    record(model="bert_base", seed=0, metrics={"exact_match": 80.0, "f1": 88.0}),
    record(model="bert_base", seed=1, metrics={"exact_match": 82.0, "f1": 89.0}),
    record(model="bert_base", scaling="unit", seed=0, metrics={"exact_match": 79.0, "f1": 87.0}),
]


@pytest.fixture
def results(tmp_path):
    root = tmp_path / "runs"
    for rec in RECORDS:
        write(root, rec)
    corrupt = root / "lenet" / "corrupt" / "result.json"
    corrupt.parent.mkdir(parents=True)
    corrupt.write_text('{"status": "ok", "config": {')
    return root, corrupt


def _row(markdown: str, *needles) -> str:
    rows = [line for line in markdown.splitlines() if line.startswith("|") and all(n in line for n in needles)]
    assert len(rows) == 1, (needles, rows)
    return rows[0]


def test_tables_hold_the_hand_computed_statistics(results, tmp_path, capsys):
    root, corrupt = results
    out = tmp_path / "tables"
    assert main([str(root), "--out", str(out)]) == 0
    assert str(corrupt) in capsys.readouterr().err

    grid = (out / "t" / "scaling_grid.md").read_text()
    # 32-true none: 90, 92, 94 -> mean 92.00, sample std 2.00, n 3
    assert "92.00 ± 2.00 (n=3)" in _row(grid, "lenet", "32-true")
    # fp8 none (seed 2 missing): 80, 84 -> mean 82.00, sample std sqrt(8) = 2.83, n 2
    assert "82.00 ± 2.83 (n=2)" in _row(grid, "lenet", "fp8-mixed †")
    # 16-mixed dynamic: the diverged run is counted beside the mean, not averaged into it (90 alone)
    assert "90.00 (n=1) [1 diverged]" in _row(grid, "lenet", "| 16-mixed")
    assert "– [1 failed]" in _row(grid, "lenet", "bf16-mixed")
    body = [line for line in grid.splitlines() if line.startswith("| lenet") or line.startswith("| bert")]
    assert len(body) == 5  # one row per (model, setting): 4 LeNet settings + 1 BERT

    precision = (out / "t" / "precision.md").read_text()
    fp8 = _row(precision, "fp8-mixed", "none")
    assert "0.57×†" in fp8  # 12 s / mean(20, 22) s
    assert "21.0 [20.0–22.0] (n=2)†" in fp8  # median [min–max] over seeds
    # paired by seed against 32-true: 80 - 90 = -10 and 84 - 92 = -8 -> mean -9.00, sample std sqrt(2), 95% t
    # interval -9 ± t(0.975, 1) * sqrt(2) / sqrt(2) = -9 ± 12.706; it holds 0: no mark
    assert "| -9.00 [-21.71, +3.71] (n=2) |" in fp8
    assert "1.00×" in _row(precision, "lenet", "32-true", "none")

    squad = (out / "t" / "squad.md").read_text()
    assert "81.00 / 88.50" in _row(squad, "bert_base", "32-true")
    assert "79.00 / 87.00" in _row(squad, "bert_base", "32-true")

    numerics = (out / "t" / "numerics.md").read_text()
    assert "1% / 0%" in _row(numerics, "lenet", "32-true", "none")  # mean underflow of 0, 1, 2 % = 1 %

    cells = (out / "t" / "cells.csv").read_text().splitlines()
    assert len(cells) == 1 + 6  # header + six cells


def test_latex_is_balanced_and_uses_booktabs(results, tmp_path):
    root, _ = results
    main([str(root), "--out", str(tmp_path / "tables"), "--no-plots"])
    for tex in (tmp_path / "tables" / "t").glob("*.tex"):
        text = tex.read_text()
        for env in ("table", "tabular"):
            assert text.count(rf"\begin{{{env}}}") == text.count(rf"\end{{{env}}}") == 1, tex
        assert text.index(r"\toprule") < text.index(r"\midrule") < text.index(r"\bottomrule"), tex
        assert "_" not in re.sub(r"\\_", "", text.replace(r"\begin", "").replace(r"\end", "")), tex
        columns = re.search(r"\\begin\{tabular\}\{(l+)\}", text).group(1)
        for line in text.split(r"\midrule")[1].split(r"\bottomrule")[0].strip().splitlines():
            assert line.count(" & ") == len(columns) - 1, line


def test_every_plot_is_written_and_not_empty(results, tmp_path):
    root, _ = results
    main([str(root), "--out", str(tmp_path / "tables")])
    for model in ("lenet", "bert_base"):
        for kind in ("metric_vs_time", "heatmap", "loss_curves", "loss_scale"):
            for ext in ("png", "svg"):
                path = tmp_path / "tables" / "t" / f"{model}_{kind}.{ext}"
                assert path.stat().st_size > 1000, path


def test_ours_beside_published_where_model_task_and_setting_match(tmp_path):
    root = tmp_path / "runs"
    write(root, record(model="distilbert", fmt="bf16", mode="true", setting="bf16-true", seed=0,
                       metrics={"test_accuracy": 0.92}, data={"source": "hub", "name": "stanfordnlp/imdb"}))
    write(root, record(model="distilbert", fmt="bf16", mode="true", setting="bf16-true", seed=1,
                       metrics={"test_accuracy": 0.93}, data={"source": "local", "name": "stanfordnlp/imdb"}))
    main([str(root), "--out", str(tmp_path / "tables"), "--no-plots"])
    table = (tmp_path / "tables" / "t" / "vs_published.md").read_text()
    row = _row(table, "raschka2023", "bf16-true")
    assert "92.69" in row and "92.00 (n=1)" in row and "-0.69" in row  # the fixture run does not match
    assert "native / cpu-x" in row



def charlm_record(val_loss, seed=0, arch=None, optimizer=None, max_steps=None, scaling="none"):
    """A char-LM run on Tiny Shakespeare, by default with nanoGPT README's CPU command (4 layers, 4 heads, width
    128, block 64, batch 12, 2000 iterations, dropout 0) and config/train_shakespeare_char.py's optimiser."""
    rec = record(metrics={"val_loss": val_loss}, seed=seed, scaling=scaling)
    rec["config"]["model"] = {
        "name": "charlm", "batch_size": 12, "iterations": 2000,
        "data": {"source": "local", "sha256": "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"},
        "arch": {"layers": 4, "heads": 4, "embedding": 128, "block_size": 64, "dropout": 0.0, "bias": False,
                 "norm": "pre"} | (arch or {}),
        "optimizer": {"lr": 1e-3, "min_lr": 1e-4, "warmup_steps": 100, "beta2": 0.99, "weight_decay": 0.1,
                      "grad_clip": 1.0} | (optimizer or {})}
    rec["config"]["train"] = {"max_steps": max_steps}
    return rec


def test_a_published_run_stands_only_beside_cells_trained_as_it_was(tmp_path):
    """nanoGPT's 1.88 is one configuration: a wider model, another learning rate, post-norm, a run cut short or a
    unit-scaled model is not set beside it (they were, one row each, in every char-LM preset's vs_published; the
    unit-scaled ones until 2026-11-30)."""
    root = tmp_path / "runs"
    for i, rec in enumerate([charlm_record(1.90), charlm_record(1.91, seed=1), charlm_record(1.69, scaling="unit"),
                             charlm_record(1.70, arch={"embedding": 256}), charlm_record(1.71, arch={"norm": "post"}),
                             charlm_record(1.72, optimizer={"lr": 2e-3, "min_lr": 2e-4}),
                             charlm_record(1.73, optimizer={"weight_decay": 0.0}), charlm_record(2.5, max_steps=100)]):
        write_json_atomic(root / f"run{i}" / "result.json", rec)
    main([str(root), "--out", str(tmp_path / "tables"), "--no-plots"])
    table = (tmp_path / "tables" / "t" / "vs_published.md").read_text()
    row = _row(table, "nanogpt")
    assert "1.905 ± 0.007 (n=2)" in row and "+0.025" in row, row

class FakeRun:
    def __init__(self, rec, i):
        self.id, self.summary = f"run{i}", rec


class FakeApi:
    """Stands in for wandb.Api(): same `runs(path, filters)` interface, summaries hold the records."""

    def __init__(self, records):
        self.records, self.calls = records, []

    def runs(self, path, filters=None):
        self.calls.append((path, filters))
        return [FakeRun(r, i) for i, r in enumerate(self.records)]


def test_a_wandb_source_gives_the_same_cells_as_local_records(results):
    root, _ = results
    api = FakeApi(RECORDS + [{"status": "ok"}])
    found, problems = load_wandb("wandb://me/precision-bench/t", api=api)
    assert api.calls == [("me/precision-bench", {"group": "t"})]
    assert len(found) == len(RECORDS) and problems == ["wandb://me/precision-bench/t: run run11 lacks reason, "
                                                       "config, env, metrics, timing, memory, numerics"]
    from bench.reporting.aggregate import load_directory

    local, _ = load_directory(root)
    columns = ["model", "setting", "scaling", "backend", "value", "value_std", "value_n", "train_s", "ok", "failed"]
    assert summarise(to_frame(found))[columns].equals(summarise(to_frame(local))[columns])


def test_no_records_is_an_error(tmp_path, capsys):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "result.json").write_text(json.dumps({"status": "weird"}))
    assert main([str(tmp_path), "--out", str(tmp_path / "t")]) == 1
    assert "no valid records" in capsys.readouterr().err


def _with(rec: dict, **config) -> dict:
    """`rec` with extra config sections (e.g. train={...}), as a run with other settings writes them."""
    rec["config"] |= config
    return rec


def test_runs_of_other_settings_are_never_averaged_or_compared_as_if_alike(tmp_path):
    """The README's 50-step single-cell example after a full sweep: its own row, labelled, no speed-up against a
    full-length baseline; and two learning rates stay two cells."""
    root = tmp_path / "runs"
    full = {"max_steps": None, "loss_multiplier": 1.0}
    recs = [_with(record(seed=s, metrics={"test_accuracy": a}, train_s=10), train=full) for s, a in ((0, .9), (1, .92))]
    recs.append(_with(record(fmt="fp16", mode="true", setting="16-true", metrics={"test_accuracy": 0.25}, train_s=0.02,
                             backend="emulated"), train={"max_steps": 50, "loss_multiplier": 1.0}))
    recs.append(_with(record(fmt="fp16", mode="mixed", setting="16-mixed", metrics={"test_accuracy": 0.91}, train_s=20,
                             backend="emulated"), train=full))
    for rec in recs:
        d = root / rec["config"]["format"]["mode"] / rec["env"]["precision"]["setting"] / f"seed{rec['config']['seed']}"
        write_json_atomic(d / "result.json", rec)
    assert main([str(root), "--out", str(tmp_path / "tables"), "--no-plots"]) == 0
    precision = (tmp_path / "tables" / "t" / "precision.md").read_text()
    short = _row(precision, "16-true")
    assert "train.max_steps=50" in short and "| –" in short.split("×")[0]  # no speed-up without a like baseline
    assert "0.50×†" in _row(precision, "16-mixed")  # 10 s / 20 s against the same-length 32-true
    baseline = _row(precision, "| lenet", "| 32-true")
    assert "91.00 ± 1.41 (n=2)" in baseline and "usual" in baseline


def test_malformed_records_are_reported_by_file_and_the_rest_aggregated(tmp_path, capsys):
    root = tmp_path / "runs"
    write(root, record(metrics={"test_accuracy": 0.9}))
    bad_time = record(fmt="fp8", mode="mixed", setting="fp8-mixed", metrics={"test_accuracy": 0.8})
    bad_time["timing"]["train_s"] = "fast"
    write(root, bad_time)
    old_schema = record(scaling="static", metrics={"test_accuracy": 0.8})
    del old_schema["config"]["model"]["data"]
    write(root, old_schema)
    assert main([str(root), "--out", str(tmp_path / "tables"), "--no-plots"]) == 0
    err = capsys.readouterr().err
    assert "fp8-mixed/none/seed0/result.json: record: timing.train_s is 'fast', expected a number" in err
    assert "32-true/static/seed0/result.json: record lacks config.model.data" in err
    assert "92" not in (tmp_path / "tables" / "t" / "scaling_grid.md").read_text().split("fp8")[0]


def test_models_are_labelled_as_configured_and_a_record_found_twice_counts_once(tmp_path):
    root = tmp_path / "runs"
    tiny = record(model="bert_base", metrics={"exact_match": 10.0, "f1": 15.0}, pretrained=False)
    tiny["config"]["model"]["arch"] = {"layers": 2, "hidden": 64}
    tiny["run_id"] = "same"
    write(root, tiny)
    write_json_atomic(root / "copy" / "result.json", tiny)  # the same run under another path
    assert main([str(root), "--out", str(tmp_path / "tables"), "--no-plots"]) == 0
    squad = (tmp_path / "tables" / "t" / "squad.md").read_text()
    assert "bert_base (2L×64 random init, squad_fixture)" in _row(squad, "32-true")
    cells = (tmp_path / "tables" / "t" / "cells.csv").read_text()
    assert ",1,1,0,0," in cells.replace(".0,", ",")  # runs 1, ok 1: the copy is not a second seed


def test_the_same_runs_on_two_devices_make_two_cells_each_paired_with_its_own_fp32(tmp_path):
    """A CPU sweep and an H100 sweep of one config, aggregated together (or one sweep over a cluster of two GPU
    types): neither device's records are dropped as duplicates of the other's run_id, times are never averaged
    across devices, and each fp16 run is paired with the fp32 run of its own device."""
    root = tmp_path / "runs"
    for device, fp32, fp16, seconds in (("AMD EPYC", 0.90, 0.85, 100.0), ("NVIDIA H100 80GB HBM3", 0.94, 0.93, 2.0)):
        for fmt, setting, accuracy in (("fp32", "32-true", fp32), ("fp16", "16-mixed", fp16)):
            rec = record(fmt=fmt, mode="true" if fmt == "fp32" else "mixed", setting=setting, train_s=seconds,
                         metrics={"test_accuracy": accuracy})
            rec["env"]["device_name"], rec["run_id"] = device, f"{fmt}-seed0"  # run_id: the config's, not the device's
            write_json_atomic(root / device / setting / "result.json", rec)
    assert main([str(root), "--out", str(tmp_path / "tables"), "--no-plots"]) == 0
    precision = (tmp_path / "tables" / "t" / "precision.md").read_text()
    cpu, gpu = _row(precision, "16-mixed", "AMD EPYC"), _row(precision, "16-mixed", "H100")
    assert "-5.00" in cpu and "100.0" in cpu  # 85 - 90, the CPU's own time
    assert "-1.00" in gpu and "2.0" in gpu  # 93 - 94
    assert "device_name=NVIDIA H100 80GB HBM3" in gpu


def test_a_native_fp8_time_says_it_is_torchao_in_eager_mode(tmp_path):
    root = tmp_path / "runs"
    write(root, record(metrics={"test_accuracy": 0.9}))
    write(root, record(fmt="fp8", mode="mixed", setting="fp8-mixed", scaling="per_tensor", backend="emulated",
                       metrics={"test_accuracy": 0.9}))
    assert main([str(root), "--out", str(tmp_path / "tables"), "--no-plots"]) == 0
    assert "torchao's float8 training in eager mode" not in (tmp_path / "tables" / "t" / "precision.md").read_text()
    write(root, record(fmt="fp8", mode="mixed", setting="fp8-mixed", scaling="per_tensor", seed=1, backend="native",
                       metrics={"test_accuracy": 0.9}))
    assert main([str(root), "--out", str(tmp_path / "tables"), "--no-plots"]) == 0
    assert "torchao's float8 training in eager mode" in (tmp_path / "tables" / "t" / "precision.md").read_text()


def test_a_cell_whose_timing_was_disturbed_is_flagged(tmp_path):
    root = tmp_path / "runs"
    quiet = record(seed=0, metrics={"test_accuracy": 0.9}, train_s=10)
    loud = record(seed=1, metrics={"test_accuracy": 0.9}, train_s=30)
    for rec, disturbed in ((quiet, False), (loud, True)):
        rec["timing"]["conditions"] = {"threads": 1, "cores": 2, "other_processes_cores": 1.9 if disturbed else 0.0,
                                       "disturbed": disturbed}
        write(root, rec)
    assert main([str(root), "--out", str(tmp_path / "tables"), "--no-plots"]) == 0
    precision = (tmp_path / "tables" / "t" / "precision.md").read_text()
    assert "20.0 [10.0–30.0] (n=2)‡" in _row(precision, "| lenet", "| 32-true")
    assert "‡ timing disturbed" in precision


def test_a_difference_the_paired_seeds_tell_from_noise_is_marked(tmp_path):
    """32-true 90 / 92 / 94 against bf16-mixed 85 / 87 / 90 on seeds 0-2: differences -5, -5, -4, mean -4.67,
    sample std 0.577, 95% interval -4.67 ± t(0.975, 2) * 0.577 / sqrt(3) = -4.67 ± 1.43, which excludes 0. The
    unpaired means' difference is the same, but its spread (std 2.0 and 2.5 per cell) would hide it."""
    root = tmp_path / "runs"
    for seed, (fp32, bf16) in enumerate([(0.90, 0.85), (0.92, 0.87), (0.94, 0.90)]):
        write(root, record(seed=seed, metrics={"test_accuracy": fp32}))
        write(root, record(fmt="bf16", mode="mixed", setting="bf16-mixed", seed=seed, metrics={"test_accuracy": bf16}))
    assert main([str(root), "--out", str(tmp_path / "tables"), "--no-plots"]) == 0
    precision = (tmp_path / "tables" / "t" / "precision.md").read_text()
    assert "| -4.67 [-6.10, -3.23] (n=3)* |" in _row(precision, "bf16-mixed")
    assert "excludes 0" in precision


def test_unit_scaling_charlm_table_is_the_papers_layout_with_paired_differences_in_bpc(tmp_path):
    """Two seeds per cell; BPC = nats / ln 2; the difference to FP32 regular is paired by seed (computed here by
    hand), the paper's WikiText-103 figures and their differences beside."""
    import math

    from bench.reporting.aggregate import EVALUATED_WITHOUT_AUTOCAST
    from bench.running.config import CharDataConfig

    root = tmp_path / "runs"
    losses = {("16-mixed", "fp16", "mixed", "none"): (1.20, 1.30),
              ("16-mixed", "fp16", "mixed", "static"): (1.10, 1.12),
              ("16-mixed", "fp16", "mixed", "unit"): (1.05, 1.09),
              ("32-true", "fp32", "true", "none"): (1.08, 1.10),
              ("32-true", "fp32", "true", "unit"): (1.04, 1.08)}
    for (setting, fmt, mode, scaling), values in losses.items():
        for seed, loss in enumerate(values):
            rec = record(fmt=fmt, mode=mode, setting=setting, scaling=scaling, seed=seed, metrics={"val_loss": loss},
                         backend="native" if fmt == "fp32" else "emulated")
            if scaling == "static":  # a record evaluated outside the autocast it trained under
                rec["metrics"]["evaluated_in"] = EVALUATED_WITHOUT_AUTOCAST
            rec["config"]["model"] = {"name": "charlm", "arch": {"layers": 4, "embedding": 128, "norm": "pre"},
                                      "data": {"source": "local", "sha256": CharDataConfig.sha256}}
            rec["config"]["experiment_name"] = "unit_scaling_charlm"  # its table is the preset's
            write(root, rec)
    main([str(root), "--out", str(tmp_path / "tables"), "--no-plots"])
    table = (tmp_path / "tables" / "unit_scaling_charlm" / "unit_scaling_charlm.md").read_text()
    header = [c.strip()
              for c in next(line for line in table.splitlines() if line.startswith("| norm")).split("|")[1:-1]]
    assert header == ["norm", "rows", "FP16 regular", "FP16 regular, static loss scale", "FP16 unit", "FP32 regular",
                      "FP32 unit"]
    ours = _row(table, "ours: val BPC")
    assert f"{1.25 / math.log(2):.3f} ± {math.sqrt(0.005) / math.log(2):.3f} (n=2) †" in ours
    # the cell evaluated outside its autocast carries its mark here too, and the table its note (it had neither)
    assert [c.strip().endswith("(n=2)° †") for c in ours.split("|")[3:8]] == [False, True, False, False, False]
    assert "\n° evaluated without the autocast" in table
    delta = _row(table, "ours: Δ vs FP32 regular")
    cells = [c.strip() for c in delta.split("|")[1:-1]]
    assert cells[2].startswith(f"{(0.12 + 0.20) / 2 / math.log(2):+.3f} [")  # FP16 regular: (1.20-1.08, 1.30-1.10)
    assert cells[5] == "baseline" and cells[6].startswith(f"{-0.03 / math.log(2):+.3f} [")
    assert [c.strip() for c in _row(table, "paper: test BPC").split("|")[3:8]] == \
        ["1.661", "1.587", "1.567", "1.582", "1.562"]
    assert [c.strip() for c in _row(table, "paper: Δ vs FP32 regular").split("|")[3:8]] == \
        ["+0.079", "+0.005", "-0.015", "baseline", "-0.020"]


def test_unit_scaling_charlm_table_pairs_each_learning_rate_with_its_own_fp32_regular(tmp_path):
    """A learning-rate sweep (unit_scaling_charlm_lr): one seed, two lrs per column. Each lr is its own row pair,
    paired with the FP32-regular run of the same lr; one seed gives a difference without an interval; the paper's
    rows come once per norm."""
    import math

    from bench.running.config import CharDataConfig

    root = tmp_path / "runs"
    losses = {("none", 1e-3): 1.90, ("none", 4e-3): 1.77, ("unit", 1e-3): 1.72, ("unit", 4e-3): 2.02}
    for (scaling, lr), loss in losses.items():
        rec = record(scaling=scaling, seed=0, metrics={"val_loss": loss})
        rec["config"]["model"] = {"name": "charlm", "arch": {"layers": 4, "embedding": 128, "norm": "pre"},
                                  "optimizer": {"lr": lr}, "data": {"source": "local", "sha256": CharDataConfig.sha256}}
        rec["config"]["experiment_name"] = "unit_scaling_charlm_lr"  # its table is the preset's
        d = root / f"{scaling}-{lr}"
        write_json_atomic(d / "result.json", rec)
    assert main([str(root), "--out", str(tmp_path / "tables"), "--no-plots"]) == 0
    table = (tmp_path / "tables" / "unit_scaling_charlm_lr" / "unit_scaling_charlm.md").read_text()
    lines = [line for line in table.splitlines() if line.startswith("| pre")]
    assert [line.split("|")[2].strip().split(" (")[0] for line in lines] == \
        ["ours: val BPC", "ours: Δ vs FP32 regular"] * 2 + ["paper: test BPC", "paper: Δ vs FP32 regular"]
    for lr, line, delta in [(1e-3, lines[0], lines[1]), (4e-3, lines[2], lines[3])]:
        assert f"model.optimizer.lr={lr}" in line
        cells = [c.strip() for c in delta.split("|")[1:-1]]
        assert cells[2] == "baseline"  # columns: norm, rows, FP32 regular, FP32 unit
        assert cells[3] == f"{(losses[('unit', lr)] - losses[('none', lr)]) / math.log(2):+.3f} (n=1)"


def test_one_model_in_two_configurations_gets_two_sets_of_plots(tmp_path):
    """charlm pre- and post-norm in one experiment: each its own files (they overwrote each other)."""
    from bench.running.config import CharDataConfig

    root = tmp_path / "runs"
    for norm in ("pre", "post"):
        rec = record(seed=0, metrics={"val_loss": 1.9})
        rec["config"]["model"] = {"name": "charlm", "arch": {"layers": 4, "embedding": 128, "norm": norm},
                                  "data": {"source": "local", "sha256": CharDataConfig.sha256}}
        write_json_atomic(root / norm / "result.json", rec)
    assert main([str(root), "--out", str(tmp_path / "tables")]) == 0
    for norm in ("pre", "post"):
        path = tmp_path / "tables" / "t" / f"charlm_4L_128_{norm}-norm_shakespeare_char_heatmap.png"
        assert path.stat().st_size > 1000, sorted(p.name for p in path.parent.iterdir())


def test_block_formats_table_orders_by_bits_tells_rounding_and_recipes_apart_and_pairs_each_seed_with_fp32(tmp_path):
    """FP32, FP8 rowwise, MXFP8 in its own and in torchao's recipe, MXFP4 with nearest and stochastic gradients, two
    seeds: rows by bits per element (32, 8.25, 8.25, 8.25, 4.25, 4.25), roundings and recipes their own rows,
    differences to FP32 of the same seed by hand."""
    root = tmp_path / "runs"
    torchaos = {"gradients": "fp8_e4m3", "scale_mode": "rceil"}
    accuracy = {("32-true", "fp32", "none", "nearest", ()): (0.90, 0.94),
                ("fp8-mixed", "fp8", "rowwise", "nearest", ()): (0.89, 0.95),
                ("mxfp8-mixed", "mxfp8", "none", "nearest", ()): (0.60, 0.62),
                ("mxfp8-mixed", "mxfp8", "none", "nearest", tuple(torchaos.items())): (0.91, 0.93),
                ("mxfp4-mixed", "mxfp4", "none", "nearest", ()): (0.70, 0.80),
                ("mxfp4-mixed", "mxfp4", "none", "stochastic", ()): (0.85, 0.87)}
    for (setting, fmt, scaling, rounding, options), values in accuracy.items():
        for seed, value in enumerate(values):
            rec = record(fmt=fmt, mode="mixed", setting=setting, scaling=scaling, seed=seed,
                         metrics={"test_accuracy": value}, backend="native" if fmt == "fp32" else "emulated")
            elsewhere = {} if fmt == "fp32" else {"elsewhere": "bf16"}  # the formats' yaml default since 0.2.0
            rec["config"]["format"] |= {"rounding": rounding, **elsewhere, **dict(options)}
            rec["numerics"]["quantisation"]["gradients"]["blocks"] = {"relative_mse": 0.01,
                                                                      "clipped_block_fraction": 0.2}
            rec["config"]["experiment_name"] = "block_formats"  # its table is the preset's
            write_json_atomic(root / f"{setting}-{scaling}-{rounding}-{len(options)}-{seed}" / "result.json", rec)
    assert main([str(root), "--out", str(tmp_path / "tables"), "--no-plots"]) == 0
    table = (tmp_path / "tables" / "block_formats" / "block_formats.md").read_text()
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in table.splitlines() if line.startswith("| lenet")]
    assert [(r[1].rstrip(" †"), r[2]) for r in rows] == [
        ("FP32", "32"), ("FP8 rowwise (E4M3, FP32 scale per row)", "8.25"), ("MXFP8 (E4M3/E5M2, E8M0 per 32)", "8.25"),
        ("MXFP8, torchao's recipe (E4M3 gradients, rceil)", "8.25"), ("MXFP4 (E2M1, E8M0 per 32)", "4.25"),
        ("MXFP4, stochastic gradients", "4.25")]
    assert rows[0][3] == "test_accuracy" and rows[0][4] == "92.00 ± 2.83 (n=2)"
    assert rows[2][4] == "61.00 ± 1.41 (n=2)" and rows[3][4] == "92.00 ± 1.41 (n=2)"
    assert rows[4][5].startswith(f"{-100 * (0.20 + 0.14) / 2:+.2f} [")  # (0.70 - 0.90, 0.80 - 0.94)
    assert rows[5][5].startswith(f"{-100 * (0.05 + 0.07) / 2:+.2f} [")
    assert rows[5][6] == "1.00e-02" and rows[5][7] == "– / 20%" and rows[0][5] == "baseline"
    assert main([str(root), "--out", str(tmp_path / "plotted")]) == 0
    assert (tmp_path / "plotted" / "block_formats" / "lenet_metric_vs_bits.png").stat().st_size > 1000


def test_a_presets_own_table_comes_from_its_declaration_not_from_the_data(tmp_path):
    """The same block-format records make block_formats.md under the preset's experiment_name and not under another
    one: tables read the declaration (conf/experiment/<name>.yaml) instead of guessing from the cells."""
    root = tmp_path / "runs"
    for experiment in ("block_formats", "mine"):
        for seed in (0, 1):
            for setting, fmt, rounding in (("32-true", "fp32", "nearest"), ("mxfp4-mixed", "mxfp4", "stochastic")):
                rec = record(fmt=fmt, mode="mixed", setting=setting, seed=seed, metrics={"test_accuracy": 0.9})
                rec["config"]["format"] |= {"rounding": rounding}
                rec["config"]["experiment_name"] = experiment
                write_json_atomic(root / experiment / f"{fmt}-{seed}" / "result.json", rec)
    assert main([str(root), "--out", str(tmp_path / "tables"), "--no-plots"]) == 0
    assert (tmp_path / "tables" / "block_formats" / "block_formats.md").is_file()
    assert not (tmp_path / "tables" / "mine" / "block_formats.md").exists()


def test_a_compiled_cells_time_and_speed_up_leave_out_its_compiling_steps(tmp_path):
    """A compiled bf16 run took 20 s, 12 of them in the steps that compiled: its time is 8 s beside 12 s compiling,
    its speed-up over an eager 10 s FP32 is 10 / 8, and the table says so."""
    root = tmp_path / "runs"
    write(root, record(metrics={"test_accuracy": 0.9}, train_s=10.0))
    compiled = record(fmt="bf16", mode="mixed", setting="bf16-mixed", metrics={"test_accuracy": 0.9}, train_s=20.0)
    compiled["timing"] |= {"train_s_without_compile": 8.0, "compile": {"steps": [1], "seconds": 12.0}}
    compiled["env"]["compile"] = {"requested": True, "compiled": True}
    write(root, compiled)
    assert main([str(root), "--out", str(tmp_path / "tables"), "--no-plots"]) == 0
    precision = (tmp_path / "tables" / "t" / "precision.md").read_text()
    row = _row(precision, "bf16-mixed")
    assert "| 8.0 (n=1), compiled (+12.0 s compiling) |" in row and "| 1.25× " in row
    assert "| 10.0 (n=1) " in _row(precision, "| 32-true")  # eager: its time as it was
    assert "leave out the steps during which it compiled" in precision


def test_a_key_one_run_leaves_unset_is_named_null_in_its_variant():
    """A null key is left out of a run's identity; beside runs that set it, its variant says `=null`, not `=nan`."""
    with_clip, without = record(seed=0, metrics={"test_accuracy": 0.9}), record(seed=1, metrics={"test_accuracy": 0.9})
    for rec, clip in ((with_clip, 1.0), (without, None)):
        rec["config"]["model"]["optimizer"] = {"lr": 0.01, "grad_clip": clip}
    extra = record(seed=2, metrics={"test_accuracy": 0.9})
    extra["config"]["model"]["optimizer"] = {"lr": 0.01, "grad_clip": 1.0}
    frame = to_frame([with_clip, without, extra])
    assert sorted(frame["variant"]) == ["", "", "model.optimizer.grad_clip=null"]


def test_a_baseline_at_chance_is_flagged_instead_of_quoted():
    """LeNet declares chance 0.1 (conf/model/lenet.yaml model.task.chance): a 32-true cell at 12% (within a tenth of
    the way from 10% to 100%) has learned nothing, so Δ and time to target say so instead of quoting a difference
    and a target it set itself; a 32-true cell at 90% is a baseline as before (#58)."""
    from bench.reporting.tables import precision_table, time_to_target_table

    def runs(fp32: float) -> list[dict]:
        found = []
        for seed in range(3):
            for fmt, mode, setting, value in (("fp32", "true", "32-true", fp32), ("fp8", "mixed", "fp8-mixed", 0.11)):
                curve = {"metric": "val_accuracy", "points": [[0, 0.1], [30, value]]}
                found.append(record(fmt=fmt, mode=mode, setting=setting, seed=seed,
                                    metrics={"test_accuracy": value + seed / 1000, "curve": curve}))
        return found

    cells = summarise(to_frame(runs(0.12)))
    fp8 = precision_table(cells).set_index("setting").loc["fp8-mixed"]
    note = "32-true at 12.10, near chance (10.00): nothing learned to compare against"
    assert fp8["Δ vs 32-true"] == f"– ({note})"
    assert precision_table(cells).set_index("setting").loc["32-true"]["Δ vs 32-true"] == f"baseline {note}"
    assert time_to_target_table(cells).set_index("setting").loc["fp8-mixed"]["steps to target"] == f"– ({note})"
    learned = precision_table(summarise(to_frame(runs(0.9)))).set_index("setting")
    assert learned.loc["32-true"]["Δ vs 32-true"] == "baseline"
    assert learned.loc["fp8-mixed"]["Δ vs 32-true"].startswith("-79.00")


def test_a_heatmap_whose_cells_differ_in_the_fifth_digit_reads_them_on_its_colour_bar_without_an_offset(
        tmp_path, monkeypatch):
    """Values 0.98000 to 0.98002: matplotlib's default ticks would print an offset ("1e-5+9.8e-1") above the colour
    bar, over the title; the bar's ticks read as plain numbers instead."""
    import bench.reporting.plots as plots

    figures = []
    monkeypatch.setattr(plots.plt, "close", figures.append)
    root = tmp_path / "runs"
    for (fmt, mode, setting), value in zip([("fp32", "true", "32-true"), ("fp8", "mixed", "fp8-mixed"),
                                            ("bf16", "mixed", "bf16-mixed")], (0.98, 0.98001, 0.98002)):
        write(root, record(fmt=fmt, mode=mode, setting=setting, metrics={"test_accuracy": value}))
    assert main([str(root), "--out", str(tmp_path / "tables")]) == 0
    [heatmap] = [f for f in figures if "by format and scaling" in f.axes[0].get_title()]
    bar = heatmap.axes[1]
    assert bar.yaxis.get_offset_text().get_text() == ""
    labels = [t.get_text() for t in bar.get_yticklabels()]
    assert labels and all(label.replace(".", "", 1).replace("−", "").isdigit() for label in labels), labels


def test_an_emulated_cells_time_leaves_out_making_its_fused_graphs_and_says_so(tmp_path):
    """An emulated FP8 run took 20 s, 12 of them making fused graphs (a fresh clone's empty inductor cache): its time
    is 8 s beside those 12 s, its speed-up over an eager 10 s FP32 10 / 8, and the table says why."""
    root = tmp_path / "runs"
    write(root, record(metrics={"test_accuracy": 0.9}, train_s=10.0))
    emulated = record(fmt="fp8", mode="mixed", setting="fp8-mixed", metrics={"test_accuracy": 0.9}, train_s=20.0)
    emulated["timing"] |= {"train_s_without_compile": 8.0,
                           "compile": {"steps": [1, 2], "seconds": 12.0, "in_validation_s": 3.0}}
    write(root, emulated)
    assert main([str(root), "--out", str(tmp_path / "tables"), "--no-plots"]) == 0
    precision = (tmp_path / "tables" / "t" / "precision.md").read_text()
    assert "| 8.0 (n=1), +12.0 s making fused graphs" in _row(precision, "fp8-mixed")
    assert "| 10.0 (n=1) " in _row(precision, "| 32-true") and "+" not in _row(precision, "| 32-true").split("|")[4]
    assert "making fused graphs: the emulated cell's" in precision and "compiled: the cell" not in precision


def test_a_model_whose_module_is_not_importable_here_is_described_generically_without_an_error(caplog):
    """A user's model aggregated where its module is not on PYTHONPATH: `<name> (<data source>)`, and nothing said
    at error level (Hydra's lookup logged "Error getting callable" though the tables were fine)."""
    import logging

    from bench.reporting.aggregate import describe

    caplog.set_level(logging.DEBUG)
    model = {"name": "mlp", "data": {"source": "digits"}, "task": {"describe": "no_such_module_here.describe"}}
    assert describe(model) == ("digits", "mlp (digits)")
    model["task"]["describe"] = "bench.tasks.base.no_such_function"
    assert describe(model) == ("digits", "mlp (digits)")
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.records


def test_a_variants_integer_stays_an_integer_where_another_run_leaves_the_key_unset():
    """A key one run leaves unset made its column a float's: `parallel.world_size=2.0`, `train.max_steps=50.0` in
    a newcomer's tables and plot names (2026-11-30)."""
    import copy
    import gzip

    folder = Path(__file__).resolve().parents[1] / "results" / "tables" / "default"
    record = json.loads(next(iter(gzip.open(folder / "records.jsonl.gz", "rt"))))
    runs = []
    for steps in (None, 50):
        run = copy.deepcopy(record)
        run["config"]["train"]["max_steps"], run["run_id"] = steps, f"{record['run_id']}-{steps}"
        runs.append(run)
    assert sorted(to_frame(runs)["variant"]) == ["train.max_steps=50", "train.max_steps=null"]


def test_every_table_names_the_machines_that_made_its_cells(tmp_path):
    """A table's notes open with its cells' machines: the device, and on a CPU its 16-bit units (bf16 native or
    emulated, and how fast, depend on them); a CPU without any says so (the committed tables named none)."""
    root = tmp_path / "runs"
    for seed, units in enumerate((["avx512_bf16"], [])):
        rec = record(seed=seed, metrics={"test_accuracy": 0.9})
        rec["env"] |= {"device_name": f"CPU {seed}", "device_type": "cpu", "cpu_16bit_units": units}
        write(root, rec)
    main([str(root), "--out", str(tmp_path / "tables"), "--no-plots"])
    for name in ("precision", "scaling_grid", "numerics"):
        table = (tmp_path / "tables" / "t" / f"{name}.md").read_text()
        assert "\nmade on CPU 0 (16-bit units: avx512_bf16); CPU 1 (no 16-bit units).\n" in table, name
