"""The aggregator: one row per cell, speed-up against fp32, emulated figures marked, corrupt files reported."""

import json

import pandas as pd

from bench.aggregate import EMULATED_MARK, main
from bench.run import run_cell


def test_table_from_real_records_with_a_corrupt_one(make_cfg, tmp_path, capsys):
    records = {fmt: run_cell(make_cfg(f"format={fmt}", "train.max_steps=3", "device=cpu",
                                      "format.backend=emulated" if fmt != "fp32" else "format.backend=auto"))
               for fmt in ("fp32", "fp8")}
    corrupt = tmp_path / "default" / "lenet" / "fp16-mixed" / "none" / "seed0" / "result.json"
    corrupt.parent.mkdir(parents=True)
    corrupt.write_text('{"status": "ok", "config": ')
    out = tmp_path / "tables"
    assert main([str(tmp_path), "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert str(corrupt) in captured.err and "unreadable" in captured.err

    csv = pd.read_csv(out / "default" / "cells.csv")
    assert sorted(csv["setting"]) == ["32-true", "fp8-mixed"]
    fp8 = csv[csv["setting"] == "fp8-mixed"].iloc[0]
    expected = records["fp32"]["timing"]["train_s"] / records["fp8"]["timing"]["train_s"]
    assert abs(fp8["speedup_vs_fp32"] - expected) < 1e-9
    assert fp8["value"] == records["fp8"]["metrics"]["test_accuracy"]

    markdown = (out / "default" / "cells.md").read_text()
    table_rows = [line for line in markdown.splitlines() if line.startswith("| lenet")]
    assert len(table_rows) == 2
    fp8_row = next(r for r in table_rows if "fp8-mixed" in r)
    assert fp8_row.count(EMULATED_MARK) == 3 and "emulated" in fp8_row  # time, speed-up, memory
    assert EMULATED_MARK not in next(r for r in table_rows if "32-true" in r)
    assert f"{records['fp8']['metrics']['test_accuracy'] * 100:.2f}" in fp8_row


def test_no_records_is_an_error(tmp_path, capsys):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "result.json").write_text(json.dumps({"status": "weird"}))
    assert main([str(tmp_path), "--out", str(tmp_path / "t")]) == 1
    assert "no valid records" in capsys.readouterr().err
