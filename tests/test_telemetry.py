"""Telemetry fractions against values counted by hand, and the overflow boundary against ml_dtypes."""

import math

import ml_dtypes
import numpy as np
import pytest
import torch

from bench.formats import FORMATS
from bench.precision import TensorSite
from bench.telemetry import QuantTelemetry


def test_fractions_match_a_hand_count():
    telemetry = QuantTelemetry()
    site = TensorSite("gradients", "fp16", None, False, telemetry)
    x = torch.tensor([0.0, 1e-8, -1e-8, 1e-6, 1.0, 7e4, -65520.0, 65519.0, math.nan, 3.0])
    telemetry.sampling = False
    site(x)
    assert telemetry.end_step() == {}  # nothing counted off the sampled steps
    telemetry.sampling = True
    site(x)
    step = telemetry.end_step()["gradients"]
    # 10 values: 1e-8 and -1e-8 underflow (< 2^-25); 1e-6 is subnormal; 7e4 and the tie -65520 overflow.
    assert step == {"underflow": 2 / 10, "subnormal": 1 / 10, "overflow": 2 / 10}
    site(x[:5])
    telemetry.end_step()
    summary = telemetry.summary()
    assert summary["gradients"]["values_sampled"] == 15
    assert summary["gradients"]["underflow_fraction"] == 4 / 15
    assert summary["weights"] is None and summary["activations"] is None


@pytest.mark.parametrize("fmt,dtype", [("fp16", np.float16), ("bf16", ml_dtypes.bfloat16),
                                       ("fp8_e4m3", ml_dtypes.float8_e4m3fn), ("fp8_e5m2", ml_dtypes.float8_e5m2)])
def test_overflow_boundary_is_where_ml_dtypes_stops_being_finite(fmt, dtype):
    spec = FORMATS[fmt]
    half_ulp = 2.0 ** (spec.emax - spec.man_bits - 1)
    probes = np.array([spec.max, spec.max + half_ulp * 0.99, spec.max + half_ulp, spec.max + half_ulp * 1.01,
                       np.inf], dtype=np.float32)
    probes = np.concatenate([probes, -probes])
    with np.errstate(over="ignore", invalid="ignore"):
        reference = ~np.isfinite(probes.astype(dtype).astype(np.float32))
    assert spec.overflows(torch.from_numpy(probes)).numpy().tolist() == reference.tolist()
