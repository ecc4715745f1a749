"""Telemetry fractions against values counted by hand, and the overflow boundary against ml_dtypes."""

import math

import ml_dtypes
import numpy as np
import pytest
import torch

from bench.numerics.emulation import TensorSite
from bench.numerics.formats import FORMATS
from bench.numerics.telemetry import QuantTelemetry, category_counts


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
    # 10 values: 1e-8 and -1e-8 underflow (< 2^-25); 1e-6 is subnormal; 7e4, the tie -65520 and NaN
    # (not finite) overflow.
    assert step == {"underflow": 2 / 10, "subnormal": 1 / 10, "overflow": 3 / 10}
    site(x[:5])
    telemetry.end_step()
    summary = telemetry.summary()
    assert summary["gradients"]["values_sampled"] == 15
    assert summary["gradients"]["underflow_fraction"] == 4 / 15
    assert summary["weights"] is None and summary["activations"] is None


@pytest.mark.parametrize("fmt,dtype", [("fp16", np.float16), ("bf16", ml_dtypes.bfloat16),
                                       ("fp8_e4m3", ml_dtypes.float8_e4m3fn), ("fp8_e5m2", ml_dtypes.float8_e5m2)])
def test_every_value_is_classified_as_ml_dtypes_rounds_it(fmt, dtype):
    """10^6 random bit patterns plus every edge: zero / underflow / subnormal / normal / overflow counted from
    |x| alone must agree with what ml_dtypes' cast actually produces, in total and value by value at the ties."""
    from tests.test_formats import VALUES

    spec = FORMATS[fmt]
    x = VALUES
    half_ulp = 2.0 ** (spec.emax - spec.man_bits - 1)
    ties = np.array([spec.min_subnormal / 2, spec.min_normal - spec.min_subnormal / 2, spec.max + half_ulp],
                    dtype=np.float32)
    x = np.concatenate([x, ties, -ties, np.nextafter(ties, np.float32(0)), np.nextafter(ties, np.float32(np.inf))])
    with np.errstate(over="ignore", invalid="ignore"):
        r = x.astype(dtype).astype(np.float32)
    finite_in = ~np.isnan(x)  # NaN in counts with overflow ("not finite")
    reference = np.select([(x == 0), finite_in & (r == 0), finite_in & (np.abs(r) < spec.min_normal),
                           finite_in & np.isfinite(r)], [0, 1, 2, 3], default=4)
    assert category_counts(torch.from_numpy(x), spec).tolist() == np.bincount(reference, minlength=5).tolist()
    for value, expected in zip(x[-12:], reference[-12:]):  # the ties and their neighbours, one by one
        assert category_counts(torch.tensor([value]), spec).argmax().item() == expected, value
