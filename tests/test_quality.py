"""Time to quality (bench/reporting/quality.py): steps to a target on made-up curves at every edge, the default target
(the 32-true run of the same seed), the tables, and `python -m bench.predict`'s table and refusals."""

import math

import numpy as np
import pandas as pd
import pytest

from bench.reporting.quality import steps_to_target, targets


@pytest.mark.parametrize("points, target, higher, steps", [
    ([[0, 0.1], [10, 0.5], [20, 0.9], [30, 0.95]], 0.9, True, 20),  # reached at a later evaluation
    ([[0, 0.1], [10, 0.5], [20, 0.89]], 0.9, True, None),  # never reached: no number
    ([[0, 0.95], [10, 0.97]], 0.9, True, 0),  # reached at step 0, before training
    ([[0, 0.5], [10, 0.9], [20, 0.9]], 0.9, True, 10),  # a tie with the target reaches it, at its first evaluation
    ([[0, 4.2], [250, 2.1], [500, 1.9], [750, 1.95]], 1.95, False, 500),  # a loss: at or below
    ([[0, 4.2], [250, float("nan")], [500, 1.9]], 2.0, False, 500),  # an evaluation without a value is passed over
])
def test_steps_to_target_on_made_up_curves(points, target, higher, steps):
    assert steps_to_target(points, target, higher) == steps


def _frame(rows) -> pd.DataFrame:
    return pd.DataFrame([{"experiment": "t", "baseline_id": "b", "design_id": "d", "scaling": "none",
                          "higher_is_better": False, "status": "ok"} | r for r in rows])


def test_the_default_target_is_the_final_value_of_the_32_true_run_of_the_same_seed():
    frame = _frame([
        {"setting": "32-true", "seed": 0, "curve": [[0, 4.0], [100, 2.0], [200, 1.5]]},
        {"setting": "32-true", "seed": 1, "curve": [[0, 4.0], [100, 2.5], [200, 1.8]]},
        {"setting": "fp8-mixed", "seed": 0, "curve": [[0, 4.0], [100, 1.5], [200, 1.4]]},  # sooner than its FP32
        {"setting": "fp8-mixed", "seed": 1, "curve": [[0, 4.0], [100, 2.0], [200, 1.9]]},  # never
        {"setting": "fp8-mixed", "seed": 2, "curve": [[0, 4.0], [200, 1.0]]},  # no 32-true run of seed 2
        {"setting": "bf16-mixed", "seed": 0, "curve": []},  # a record without a curve
        {"setting": "bf16-mixed", "seed": 1, "curve": [[0, 4.0], [200, 1.0]], "status": "diverged"},
    ])
    found = targets(frame)
    assert found["target"].tolist()[:4] == [1.5, 1.8, 1.5, 1.8] and math.isnan(found["target"][4])
    assert found["reached"].tolist() == [True, True, True, False, None, None, None]
    assert found["steps_to_target"].tolist()[:3] == [200, 200, 100]
    assert np.isnan(found["steps_to_target"].tolist()[3:]).all()


def test_without_a_32_true_run_of_its_scaling_method_a_run_takes_the_unscaled_one_s_target():
    """block_formats runs FP32 unscaled only: its rowwise FP8 cells aim at the unscaled FP32 run's value; a cell whose
    scaling method has its own FP32 run (unit scaling) aims at that one's, and another model's FP32 gives none."""
    frame = _frame([
        {"setting": "32-true", "seed": 0, "curve": [[0, 4.0], [200, 1.5]]},
        {"setting": "32-true", "seed": 0, "curve": [[0, 4.0], [200, 1.9]], "scaling": "unit", "baseline_id": "u"},
        {"setting": "fp8-mixed", "seed": 0, "curve": [[0, 4.0], [200, 1.6]], "scaling": "rowwise",
         "baseline_id": "r"},
        {"setting": "fp8-mixed", "seed": 0, "curve": [[0, 4.0], [200, 1.6]], "scaling": "unit", "baseline_id": "u"},
        {"setting": "fp8-mixed", "seed": 0, "curve": [[0, 4.0], [200, 1.6]], "scaling": "rowwise",
         "baseline_id": "r2", "design_id": "another model"},
    ])
    found = targets(frame)
    assert found["target"].tolist()[:4] == [1.5, 1.9, 1.5, 1.9] and math.isnan(found["target"][4])
    assert found["reached"].tolist() == [True, True, False, True, None]


def test_a_preset_may_declare_its_own_target(monkeypatch):
    from bench.reporting import quality

    monkeypatch.setattr(quality, "declared_target", lambda experiment: 2.0)
    frame = _frame([{"setting": "32-true", "seed": 0, "curve": [[0, 4.0], [100, 2.0], [200, 1.5]]}])
    assert targets(frame)[["target", "steps_to_target"]].values.tolist() == [[2.0, 100]]


def test_the_time_to_target_table_says_how_many_seeds_reached_it_and_makes_no_number_up(tmp_path):
    """LeNet records with curves: 32-true reaches its own final value; bf16 in 2 of 3 seeds (one at a later epoch);
    fp16 never. (These made-up records cannot be traced: no predicted time, and no number made up for it.)"""
    from bench.reporting.report import main as aggregate
    from tests.test_aggregate import record, write

    curves = {"32-true": [[[36, 0.5], [72, 0.9]]] * 3,
              "bf16-mixed": [[[36, 0.95], [72, 0.97]], [[36, 0.8], [72, 0.9]], [[36, 0.8], [72, 0.85]]],
              "16-mixed": [[[36, 0.5], [72, 0.6]]] * 3}
    formats = {"32-true": ("fp32", "true"), "bf16-mixed": ("bf16", "mixed"), "16-mixed": ("fp16", "mixed")}
    for setting, per_seed in curves.items():
        for seed, points in enumerate(per_seed):
            rec = record(fmt=formats[setting][0], mode=formats[setting][1], setting=setting, seed=seed,
                         metrics={"test_accuracy": 0.9, "curve": {"metric": "val_accuracy", "points": points}})
            write(tmp_path / "runs", rec)
    assert aggregate([str(tmp_path / "runs"), "--out", str(tmp_path / "tables"), "--no-plots"]) == 0
    rows = {line.split("|")[2].strip(): line for line in (tmp_path / "tables" / "t" / "time_to_target.md")
            .read_text().splitlines() if line.startswith("| lenet")}
    assert "| 90.00 " in rows["32-true"] and "| 72 [72, 72] (3 of 3)" in rows["32-true"]
    bf16 = next(v for k, v in rows.items() if k.startswith("bf16-mixed"))
    # 36 and 72: mean 54, t interval 54 ± 12.706 · 25.456 / √2 = [-174.7, 282.7], clipped at 0 steps
    assert "| 54 [0, 283] (2 of 3)" in bf16
    fp16 = next(v for k, v in rows.items() if k.startswith("16-mixed"))
    assert "not reached (0 of 3)" in fp16 and fp16.rstrip(" |").endswith("–")


def test_bench_predict_tables_every_cell_on_every_gpu_it_names(capsys):
    from bench.reporting.predict_cells import main as predict

    assert predict(["model=lenet", "format=fp32,bf16,fp8", "scaling=none", "gpu=A100,H100"]) == 0
    out = capsys.readouterr().out
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in out.splitlines() if line.startswith("| lenet")]
    assert [(r[1], r[3]) for r in rows] == [("32-true", "A100"), ("32-true", "H100"), ("bf16-mixed", "A100"),
                                           ("bf16-mixed", "H100"), ("fp8-mixed", "A100"), ("fp8-mixed", "H100")]
    assert rows[0][6] == "1.00×"
    # each printed step is the speed model's for that cell, traced at full length (here: LeNet's batch as it is)
    from hydra import compose, initialize_config_dir

    from bench.running.config import CONF_DIR
    from bench.speed.model import predict as step
    from bench.speed.model import recipe_on
    from bench.speed.profiles import gpu
    from bench.speed.trace import trace_cell

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        for row, fmt in zip(rows[:4], ("fp32", "fp32", "bf16", "bf16")):
            cfg = compose("config", overrides=["model=lenet", f"format={fmt}", "scaling=none"])
            traced, target = trace_cell(cfg, full_length=True), gpu(row[3])
            recipe = recipe_on(cfg, traced, target)
            assert row[4] == f"{step(traced, recipe, target, compiled=True).step_s * 1e3:.3g} ms", row
            assert row[5] == f"{step(traced, recipe, target, compiled=False).step_s * 1e3:.3g} ms", row
    assert "no native path on A100: compute capability 8.0 < 8.9" in rows[4][-1]
    assert "FP8 without per-tensor scales exists only as emulation" in rows[5][-1]
    assert "predicted, not measured" in out


def test_bench_predict_gives_a_cell_its_gpu_would_emulate_the_memory_the_format_holds_where_it_is_native(capsys):
    """NVFP4 has no native path on an H100, but the bytes of its step do not depend on the GPU: the H100 row carries
    the B200's memory and says so; a setting native nowhere (FP8 without per-tensor scales, MXFP6) gets the memory of
    its format's storage, and says so."""
    from bench.reporting.predict_cells import main as predict

    assert predict(["model=lenet", "format=nvfp4,fp8,mxfp6", "scaling=none", "gpu=H100,B200"]) == 0
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in capsys.readouterr().out.splitlines()
            if line.startswith("| lenet")]
    by = {(r[1], r[3]): r for r in rows}
    h100, b200 = by["nvfp4-mixed", "H100"], by["nvfp4-mixed", "B200"]
    assert h100[4] == "–" and h100[8] == b200[8] != "–" and "memory as B200 stores the format" in h100[-1]
    for setting in ("fp8-mixed", "mxfp6-mixed"):
        assert by[setting, "H100"][4] == "–" and by[setting, "H100"][8] == by[setting, "B200"][8] != "–"
        assert "memory as the format stores it (no GPU runs it natively)" in by[setting, "H100"][-1]
    assert float(by["mxfp6-mixed", "H100"][8]) < float(by["fp8-mixed", "H100"][8])  # 6-bit operands: fewer bytes


@pytest.mark.parametrize("fmt", ["fp8", "mxfp6"])
def test_the_memory_model_of_a_format_no_gpu_runs_is_the_memory_its_emulated_run_counts(fmt, make_cfg, tmp_path):
    """bench.predict's storage-only memory for a setting native nowhere against the record's memory.step of the same
    LeNet cell run for a step (bench/numerics/memory.py counts each emulated tensor at its format's width): the
    parameters, gradients and optimiser state to the byte, the step within 10%."""
    from bench.running.run import run_cell
    from bench.speed.model import step_memory, storage_recipe
    from bench.speed.trace import trace_cell

    cfg = make_cfg("model=lenet", f"format={fmt}", "scaling=none", "train.max_steps=1", f"results_dir={tmp_path}")
    counted = run_cell(cfg)["memory"]["step"]
    modelled = step_memory(trace_cell(cfg), storage_recipe(cfg))
    for part in ("parameters", "gradients", "optimizer_state"):
        assert modelled[part] == counted[part], (part, modelled, counted)
    assert modelled["total"] == pytest.approx(counted["total"], rel=0.10), (modelled, counted)


@pytest.mark.parametrize("args, says", [(["gpu=H900"], "unknown GPU 'H900'; known: V100, A100, H100, H200, B200"),
                                        (["format=fp9"], "format=fp9 is not an option"),
                                        (["model.optimizer.lrr=1"], "did you mean model.optimizer.lr?"),
                                        (["gpus", "H100"], "not key=value overrides"),
                                        (["--gemm"], "--gemm: not an option of python -m bench.predict; valid: "
                                                     "--gemms"),
                                        (["gpu="], "gpu= names no GPU; valid: V100, A100, H100, H200, B200"),
                                        (["train.max_steps=abc"], "train.max_steps: Value 'abc' of type 'str' could "
                                                                  "not be converted to Integer"),
                                        (["model.batch_size=-3"], "model.batch_size=-3 must be >= 1")])
def test_bench_predict_refuses_bad_input_with_exit_2(args, says, capsys):
    from bench.reporting.predict_cells import main as predict

    assert predict(args) == 2
    assert says in capsys.readouterr().err


def test_bench_predict_says_how_far_off_it_has_been_on_each_gpu_out_of_sample(tmp_path, capsys):
    """A prediction says how far off the model has been out of sample, per GPU of its table: the median |error| of
    the scorecard's validate rows, steps and speed-ups apart, fit rows and kernels timed alone left out; a GPU
    without a validate row says it was never scored (a newcomer read B200 steps without their 50% miss)."""
    from bench.reporting.predict_cells import main as predict
    from bench.reporting.predict_cells import out_of_sample

    card = tmp_path / "card.csv"
    card.write_text("use,source,model,GPU,setting,mode,measured or published,predicted,error\n"
                    "validate,a,m,H100,s,compiled,10 ms,7 ms,-30%\n"
                    "validate,a,m,H100,s,compiled,10 ms,9 ms,-10%\n"
                    "validate,b,m,H100,s,kernels,1.25×,1.2×,-4%\n"
                    "fit,c,m,H100,s,eager,10 ms,10 ms,+90%\n"
                    "validate,d,m,H100,s,one GEMM,1 ms,2 ms,+100%\n"
                    "validate,e,m,B200,s,compiled,10 ms,5 ms,-50%\n")
    assert out_of_sample(["H100", "B200", "H200"], card) == (
        "median |error| out of sample, by GPU: H100 steps 20% (2), speed-ups 4% (1); B200 steps 50% (1); "
        "H200 never scored")
    assert predict(["model=lenet", "gpu=H100,H200"]) == 0
    assert "median |error| out of sample, by GPU: H100 steps" in capsys.readouterr().out
