"""The roofline speed model against figures worked by hand and against the committed H100 measurements."""

import json

import pytest

from bench.reporting.speed_model import DEVICES, Encoder, gemm_seconds, predict
from bench.tools.benchmark import ENCODERS, MEASURED_ON_H100, speed_model_rows

H100 = DEVICES["H100"]


def test_one_gemm_by_hand_compute_bound_and_memory_bound():
    # 4096^3 in BF16: 2 * 4096^3 = 1.374e11 FLOPs at 989.4 TFLOP/s * 0.75 = 0.1852 ms; its 1.0e8 bytes would take
    # 0.0376 ms at 3.35 TB/s * 0.8, so compute decides
    assert gemm_seconds(4096, 4096, 4096, "bf16", 2, H100) == pytest.approx(2 * 4096**3 / (989.4e12 * 0.75))
    # 16 tokens through a 4096 x 4096 weight: 5.4e8 FLOPs (0.7 us) but the weight's 33.6 MB take 12.5 us: memory
    moved = (16 * 4096 + 4096 * 4096) * 2 + 16 * 4096 * 2
    assert gemm_seconds(16, 4096, 4096, "bf16", 2, H100) == pytest.approx(moved / (3.35e12 * 0.8))


def test_fp32_steps_are_predicted_within_20_percent_of_the_h100_measurements():
    """FP32 at the papers' shapes is GEMM-bound even eagerly (the launch overhead is small beside 50-70 ms), so
    the committed eager measurements test the model there; 16-bit and FP8 eager steps are overhead-bound."""
    measured = {r["metric"]: r["value"] for r in json.loads(MEASURED_ON_H100.read_text())["rows"]}
    for model, shape in ENCODERS.items():
        predicted = predict(shape, "H100")
        assert predicted["fp32"]["total"] == pytest.approx(measured[f"native.{model}.fp32.step_s"], rel=0.2)
        steps = [predicted[s]["total"] for s in ("fp32", "tf32", "bf16-mixed")]
        assert steps == sorted(steps, reverse=True)
        errors = {r["metric"]: r["value"] for r in speed_model_rows() if r["metric"].endswith("error_vs_eager")}
        assert abs(errors[f"predicted.H100.{model}.fp32.error_vs_eager"]) < 0.2


def test_fp8_wins_only_where_its_gemms_outweigh_its_casts():
    """At the papers' shapes (768 wide) FP8's casts cost more than its GEMMs save, even with BF16 elsewhere; a
    wide layer over many tokens is where torchao reports its gains."""
    for shape in ENCODERS.values():
        assert predict(shape, "H100")["fp8-bf16-elsewhere"]["speedup_vs_bf16-mixed"] < 1
    wide = Encoder(layers=1, hidden=8192, heads=64, intermediate=32768, seq=2048, batch=8)
    assert predict(wide, "H100")["fp8-bf16-elsewhere"]["speedup_vs_bf16-mixed"] > 1.2
    assert "fp8" not in predict(wide, "A100")  # no FP8 tensor cores: not predicted


def test_every_device_profile_names_its_source():
    assert set(DEVICES) == {"V100", "A100", "H100", "H200", "B200"}
    assert all(profile["source"] and profile["tb_s"] > 0 and profile["tflops"]["fp32"] > 0 for profile in DEVICES.values())
