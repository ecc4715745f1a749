"""`python -m bench.compare`: cells pair with a committed folder's by configuration and training length, and each
is within or outside the committed cell's 95% interval (computed here by hand)."""

import pandas as pd
import pytest
from scipy import stats

from bench.reporting.compare import main as compare
from bench.reporting.report import main as aggregate
from tests.test_aggregate import record, write


@pytest.fixture
def committed(tmp_path):
    """A committed folder made by bench.aggregate from three seeds of fp32 and bf16-mixed LeNet."""
    root = tmp_path / "committed-runs"
    for seed, (fp32, bf16) in enumerate([(0.90, 0.85), (0.92, 0.87), (0.94, 0.89)]):
        write(root, record(seed=seed, metrics={"test_accuracy": fp32}))
        write(root, record(fmt="bf16", mode="mixed", setting="bf16-mixed", seed=seed, metrics={"test_accuracy": bf16}))
    assert aggregate([str(root), "--out", str(tmp_path / "tables"), "--no-plots"]) == 0
    return tmp_path / "tables" / "t"


def test_a_cell_is_within_or_outside_the_committed_interval(committed, tmp_path, capsys):
    half = stats.t.ppf(0.975, 2) * 0.02 / 3 ** 0.5  # the committed fp32 mean 0.92, std 0.02, n = 3
    mine = tmp_path / "mine"
    write(mine, record(seed=0, metrics={"test_accuracy": 0.92 + 0.9 * half}))  # inside, near the edge
    write(mine, record(fmt="bf16", mode="mixed", setting="bf16-mixed", seed=0, metrics={"test_accuracy": 0.80}))
    assert compare([str(mine), "--against", str(committed)]) == 1  # something is outside
    out = capsys.readouterr().out
    rows = {line.split("|")[2].strip(): line for line in out.splitlines() if line.startswith("| lenet")}
    assert ("| within" in rows["32-true"] and "92.00 [" in rows["32-true"]
            and f"{100 * 0.9 * half:+.2f}" in rows["32-true"])
    assert "| outside (worse)" in rows["bf16-mixed"] and "-7.00" in rows["bf16-mixed"]
    assert "2 cells paired: 1 within" in out


def test_only_cells_of_the_same_training_length_pair(committed, tmp_path, capsys):
    mine = tmp_path / "mine"
    rec = record(seed=0, metrics={"test_accuracy": 0.10})
    rec["timing"]["steps"] = 2  # a smoke run
    write(mine, rec)
    # nothing compared is no pass: exit 2, saying where the nearest committed cells part from yours (it exited 0)
    assert compare([str(mine), "--against", str(committed)]) == 2
    said = capsys.readouterr().err
    assert "none of the cells" in said and ("variant (none), steps 2: the reference cells of the same experiment, "
                                            "model, setting, scaling, variant have steps 30") in said, said


def test_bad_input_exits_2(tmp_path, capsys):
    assert compare([str(tmp_path / "nowhere")]) == 2
    (tmp_path / "mine").mkdir()
    assert compare([str(tmp_path / "mine"), "--against", str(tmp_path / "not-a-folder")]) == 2


def test_outside_says_better_or_worse_by_the_models_declared_direction():
    import pandas as pd

    from bench.reporting.compare import compare as pair

    cell = {"experiment": "t", "model": "charlm", "model_label": "charlm", "setting": "32-true", "scaling": "none",
            "variant": "", "steps": 10, "metric": "val_loss", "value_std": 0.0, "value_n": 1, "device": "d",
            "backend": "native"}
    mine = pd.DataFrame([cell | {"value": 1.0, "value_ci_lo": None, "value_ci_hi": None}])
    committed = pd.DataFrame([cell | {"value": 1.5, "value_ci_lo": 1.4, "value_ci_hi": 1.6, "published_value": None}])
    assert pair(mine, committed, {"charlm": False})["verdict"][0] == "outside (better)"  # a lower loss
    assert pair(mine, committed, {"charlm": True})["verdict"][0] == "outside (worse)"
    # the setting as precision.md labels it: BF16 outside the GEMMs said, emulation marked
    options = {"setting": "fp8-mixed", "format_options": "elsewhere=bf16", "backend": "emulated"}
    mine, committed = (frame.assign(**options) for frame in (mine, committed))
    assert pair(mine, committed)["setting"][0] == "fp8-mixed (bf16 elsewhere) †"


def test_a_cpu_without_the_committed_runs_bf16_units_is_named_as_the_reason(tmp_path, capsys):
    """With records committed beside the tables (--keep-records), the comparison knows the committed CPU's bf16
    units and says that rows differ because of the device, not the code; with the same units it says nothing."""
    root = tmp_path / "committed-runs"
    for seed in range(3):
        for fmt, mode, setting in (("fp32", "true", "32-true"), ("bf16", "mixed", "bf16-mixed")):
            rec = record(fmt=fmt, mode=mode, setting=setting, seed=seed, metrics={"test_accuracy": 0.9 + seed / 100})
            rec["env"] |= {"device_type": "cpu", "cpu_16bit_units": ["amx_bf16", "avx512_bf16"]}
            write(root, rec)
    assert aggregate([str(root), "--out", str(tmp_path / "tables"), "--no-plots", "--keep-records"]) == 0
    for units, said in (([], True), (["amx_bf16", "avx512_bf16"], False)):
        mine = tmp_path / f"mine-{len(units)}"
        rec = record(fmt="bf16", mode="mixed", setting="bf16-mixed", seed=0, metrics={"test_accuracy": 0.91})
        rec["env"] |= {"device_type": "cpu", "cpu_16bit_units": units}
        write(mine, rec)
        compare([str(mine), "--against", str(tmp_path / "tables" / "t")])
        out = capsys.readouterr().out
        assert ("Your CPU's bf16/fp16 units: none; the reference run's: amx_bf16, avx512_bf16. Rows in bf16 or fp16 "
                "that differ did so because of the device" in out) == said, out
        # tables of your own are a reference, not committed ones (#58)
        assert "reference [95% interval]" in out and "mine − reference" in out and "committed" not in out, out


def test_the_committed_default_records_pair_cell_by_cell_and_a_shifted_cell_is_outside(tmp_path, capsys):
    """MINE may be a committed folder's records.jsonl.gz. The default folder's own records, one cell shifted by 30
    points (fp32 none, every seed), against the folder's tables: that one cell is outside (better), the other 24
    within. Comparing the records unshifted with the tables made from them could not fail: a mean lies in its own
    interval; the shift shows the pairing and the verdict work cell by cell. The interval of the cell with a stalled
    run, which the t interval took past 100%, is printed clipped and marked."""
    import gzip
    import json
    from pathlib import Path

    folder = Path(__file__).resolve().parents[1] / "results" / "tables" / "default"
    records = [json.loads(line) for line in gzip.open(folder / "records.jsonl.gz", "rt")]
    for r in records:
        if (r["config"]["format"]["name"], r["config"]["scaling"]["name"]) == ("fp32", "none"):
            r["metrics"]["test_accuracy"] -= 0.30
    shifted = tmp_path / "records.jsonl.gz"
    shifted.write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in records).encode()))
    assert compare([str(shifted), "--against", str(folder)]) == 1
    out = capsys.readouterr().out
    rows = {tuple(cell.strip() for cell in line.split("|")[2:4]): line for line in out.splitlines()
            if line.startswith("| lenet")}
    assert "outside (worse)" in rows[("32-true", "none")] and "-30.00" in rows[("32-true", "none")]
    assert all("| within" in line for key, line in rows.items() if key != ("32-true", "none")) and len(rows) == 25
    assert "25 cells paired: 24 within the committed cell's 95% interval of its mean, 1 outside" in out
    assert "[0.00, 100.00]§" in rows[("bf16-mixed", "unit")]


def _committed_records(name: str) -> list[dict]:
    import gzip
    import json
    from pathlib import Path

    folder = Path(__file__).resolve().parents[1] / "results" / "tables" / name
    return [json.loads(line) for line in gzip.open(folder / "records.jsonl.gz", "rt")]


def test_a_full_run_pairs_with_its_committed_cell_whatever_shorter_runs_sit_beside_it(tmp_path, capsys):
    """A newcomer's results (2026-11-30): one full default cell beside two 50-step runs of another. Read among your
    runs alone, the usual train.max_steps was 50 and the full run the variant (`train.max_steps=null`), which no
    committed cell is; read against the committed runs' usual settings it is the usual cell, and pairs."""
    import copy
    from pathlib import Path

    from bench.running.record import write_json_atomic

    folder = Path(__file__).resolve().parents[1] / "results" / "tables" / "default"
    records = _committed_records("default")
    pick = {(r["config"]["format"]["name"], r["config"]["scaling"]["name"], r["config"]["seed"]): r for r in records}
    mine = tmp_path / "mine"
    write_json_atomic(mine / "full" / "result.json", pick[("bf16", "dynamic", 1)])
    for seed in (0, 1):
        short = copy.deepcopy(pick[("fp16", "none", seed)])
        short["config"]["train"]["max_steps"], short["timing"]["steps"] = 50, 50
        short["run_id"] += "-50"
        write_json_atomic(mine / f"short{seed}" / "result.json", short)
    assert compare([str(mine), "--against", str(folder)]) == 0
    out = capsys.readouterr().out
    assert "1 cells paired: 1 within" in out, out
    assert "| lenet (digits) | bf16-mixed | dynamic" in out


def test_a_full_run_pairs_beside_shorter_runs_of_the_same_cell_which_are_labelled_by_their_length(tmp_path, capsys):
    """A second newcomer (2026-11-30): a 50-step run of the very cell a full run was, in the same folder. The
    committed runs leave train.max_steps out (null), so it was not compared: all three runs were the usual cell,
    their steps' median 425, and the full run paired with nothing. A key the committed runs lack is compared where a
    run's command line set it (its cell's place names it)."""
    import copy
    from pathlib import Path

    from bench.running.record import write_json_atomic

    folder = Path(__file__).resolve().parents[1] / "results" / "tables" / "default"
    full = next(r for r in _committed_records("default") if (r["config"]["format"]["name"], r["config"]["scaling"][
        "name"], r["config"]["seed"]) == ("bf16", "dynamic", 1))
    mine = tmp_path / "mine"
    write_json_atomic(mine / "full" / "result.json", full)
    for steps in (50, 1):
        short = copy.deepcopy(full)
        short["config"]["train"]["max_steps"], short["timing"]["steps"] = steps, steps
        short["config"]["cell"] += f",train.max_steps={steps}"
        short["run_id"] += f"-{steps}"
        write_json_atomic(mine / f"short{steps}" / "result.json", short)
    assert compare([str(mine), "--against", str(folder)]) == 0
    out = capsys.readouterr().out
    assert "1 cells paired: 1 within" in out, out
    assert "| lenet (digits) | bf16-mixed | dynamic" in out


def test_a_folders_own_records_pair_with_its_tables_cell_for_cell_whatever_order_their_variants_name_keys(capsys):
    """Variants of two or more keys (`parallel.name=ddp, parallel.gradient_compression=bf16`): read against the
    committed runs, the keys come in the order of those runs as the comparison holds them, which need not be that of
    the folder's cells.csv; every cell still pairs."""
    from pathlib import Path

    folder = Path(__file__).resolve().parents[1] / "results" / "tables" / "distributed_precision"  # (block_formats too)
    cells = len(pd.read_csv(folder / "cells.csv"))
    assert compare([str(folder / "records.jsonl.gz"), "--against", str(folder)]) == 0
    assert f"{cells} cells paired: {cells} within" in capsys.readouterr().out
