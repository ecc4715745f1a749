"""A model and a format defined outside bench/ (tests/plugin: a module on PYTHONPATH, a yaml for each on Hydra's
search path) run through a sweep and its resumption, unit scaling, the tables, the plots and the dashboard with no
edit to bench/ (tests/test_layout.py checks that bench/ lists no model by name)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parents[1]
PLUGIN = ROOT / "tests" / "plugin"
SEARCHPATH = f"hydra.searchpath=[file://{PLUGIN / 'conf'}]"


def _bench(module: str, *args, cwd: Path) -> subprocess.CompletedProcess:
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(PLUGIN), str(ROOT)])}
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=600)


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    """The user's model swept over two formats (one the user's) and three scaling methods (one the user's), then the
    same sweep launched again."""
    tmp = tmp_path_factory.mktemp("plugin")
    args = ["-m", SEARCHPATH, "model=mlp", "format=fp32,fp8e3m4", "scaling=none,unit,channel_scale", "seed=0",
            f"results_dir={tmp / 'runs'}"]
    first, again = _bench("bench.run", *args, cwd=tmp), _bench("bench.run", *args, cwd=tmp)
    return tmp, first, again


def test_a_users_model_sweeps_and_resumes_without_editing_bench(swept):
    tmp, first, again = swept
    assert first.returncode == 0, first.stderr[-2000:]
    assert "sweep: 6 ok, 0 diverged, 0 failed (0 skipped" in first.stderr
    assert "(6 skipped as already recorded)" in again.stderr
    records = [json.loads(p.read_text()) for p in sorted((tmp / "runs").rglob("result.json"))]
    assert sorted(r["config"]["scaling"]["name"] for r in records) == ["channel_scale"] * 2 + ["none"] * 2 + ["unit"] * 2
    assert sorted(r["env"]["precision"]["setting"] for r in records) == ["32-true"] * 3 + ["fp8e3m4-mixed"] * 3
    assert all(r["status"] == "ok" and r["config"]["model"]["task"]["_target_"] == "mlp_digits.mlp_task"
               for r in records)
    assert all(r["metrics"]["test_accuracy"] > 0 for r in records)
    # its validate() gives the quality curve: after each of the 2 epochs (the second, the final evaluation's value)
    steps = records[0]["timing"]["steps"]
    assert all(r["metrics"]["curve"]["metric"] == "val_accuracy" and [p[0] for p in r["metrics"]["curve"]["points"]]
               == [steps // 2, steps] for r in records)
    unit = next(r for r in records if r["config"]["scaling"]["name"] == "unit")
    assert unit["numerics"]["unit_conversion"]["why"].startswith("fresh unit-variance init")  # converted, from scratch
    # the user's scaling method scaled each weight row into E3M4's range: no weight fell below its normal range, where
    # unscaled the small ones did; activations and gradients it leaves alone (no scale recorded for them)
    fp8 = {r["config"]["scaling"]["name"]: r["numerics"]["quantisation"] for r in records
           if r["env"]["precision"]["setting"] == "fp8e3m4-mixed"}
    assert fp8["channel_scale"]["weights"]["subnormal_fraction"] < fp8["none"]["weights"]["subnormal_fraction"]
    assert fp8["channel_scale"]["weights"]["scale_max"] > 1 and "scale_max" not in fp8["channel_scale"]["gradients"]


def test_a_users_model_gets_tables_plots_and_a_dashboard(swept):
    tmp = swept[0]
    tables = _bench("bench.aggregate", str(tmp / "runs"), "--out", str(tmp / "tables"), cwd=tmp)
    assert tables.returncode == 0, tables.stderr[-2000:]
    precision = (tmp / "tables" / "default" / "precision.md").read_text()
    assert "mlp (32 hidden, digits)" in precision and "test_accuracy" in precision  # its describe() and metric
    assert "| fp8e3m4-mixed †" in precision  # the user's format, marked emulated
    grid = (tmp / "tables" / "default" / "scaling_grid.md").read_text().splitlines()[2]
    assert grid.split("|")[-2].strip() == "channel_scale"  # the user's scaling method: a column, after the built-ins'
    assert "channel_scale" in (tmp / "tables" / "default" / "mlp_heatmap.svg").read_text()
    to_target = pd.read_csv(tmp / "tables" / "default" / "time_to_target.csv")  # read from its curve
    fp32 = to_target[(to_target["setting"] == "32-true") & (to_target["scaling"] == "none")].iloc[0]
    steps, reached = fp32["steps to target"].split(" ", 1)  # the FP32 run reaches its own final value, by its end
    assert reached == "(1 of 1)" and int(steps) in (40, 80)
    assert (tmp / "tables" / "default" / "mlp_heatmap.png").is_file()
    board = _bench("bench.reporting.dashboard", "default", "--results", str(tmp / "runs"), "--tables",
                   str(tmp / "tables"), "--out", str(tmp / "dash"), cwd=tmp)
    assert board.returncode == 0, board.stderr[-2000:]
    assert "metrics.test_accuracy" in (tmp / "dash" / "default" / "workspace.json").read_text()


def test_a_users_model_check_refuses_a_bad_key_before_training(tmp_path):
    out = _bench("bench.run", SEARCHPATH, "model=mlp", "model.arch.hidden=0", f"results_dir={tmp_path / 'runs'}",
                 cwd=tmp_path)
    assert out.returncode == 2 and "model.arch.hidden=0 must be >= 1" in out.stderr
    assert not list(tmp_path.rglob("result.json"))
