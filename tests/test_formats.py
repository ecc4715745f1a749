"""`bench.numerics.formats.quantise` against independent references: ml_dtypes, and integer-bit RNE for TF32."""

import ml_dtypes
import numpy as np
import pytest
import torch

from bench.numerics.formats import FORMATS, quantise, quantise_value

ML_DTYPES = {
    "fp16": np.float16,
    "bf16": ml_dtypes.bfloat16,
    "fp8_e4m3": ml_dtypes.float8_e4m3fn,
    "fp8_e5m2": ml_dtypes.float8_e5m2,
}


def _values() -> np.ndarray:
    """10^6 random float32 bit patterns (every exponent, NaN and inf included) plus the edge cases."""
    rng = np.random.default_rng(1234)
    random = rng.integers(0, 2**32, size=1_000_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    edges = []
    for spec in FORMATS.values():
        ulp_at_max = 2.0 ** (spec.emax - spec.man_bits)
        for v in (spec.max, spec.max + ulp_at_max / 2, spec.max + ulp_at_max / 4, spec.max * 1.01,
                  spec.min_normal, spec.min_subnormal, spec.min_subnormal / 2, spec.min_subnormal * 0.75,
                  spec.min_subnormal * 1.5, spec.min_subnormal * 2.5, 1 + 2.0 ** -(spec.man_bits + 1),
                  1 + 3 * 2.0 ** -(spec.man_bits + 1)):
            edges += [v, -v]
    edges += [0.0, -0.0, np.inf, -np.inf, np.nan, 1000.0, -1000.0, 3.4e38]
    with np.errstate(over="ignore"):  # 1.01 * FP32 max is inf, on purpose
        return np.concatenate([random, np.array(edges, dtype=np.float32)])


VALUES = _values()


def _same_bits(ours: np.ndarray, ref: np.ndarray) -> np.ndarray:
    both_nan = np.isnan(ours) & np.isnan(ref)
    return (ours.view(np.uint32) == ref.view(np.uint32)) | both_nan


def _ml(x: np.ndarray, fmt: str) -> np.ndarray:
    with np.errstate(over="ignore", invalid="ignore"):
        return x.astype(ML_DTYPES[fmt]).astype(np.float32)


def _ours(x: np.ndarray, fmt: str, **kw) -> np.ndarray:
    return quantise_value(torch.from_numpy(x.copy()), fmt, **kw).numpy()


def _reference(x: np.ndarray, fmt: str, policy: str) -> np.ndarray:
    """What ml_dtypes says each policy means (ml_dtypes itself is IEEE for fp16/bf16/e5m2, NaN for e4m3)."""
    spec = FORMATS[fmt]
    if policy == "saturate":
        return _ml(np.clip(x, -spec.max, spec.max), fmt)
    ref = _ml(x, fmt)
    overflowed = ~np.isnan(x) & (np.isnan(ref) | np.isinf(ref)) & ~np.isinf(x)
    if policy == "inf":
        ref = np.where(overflowed | np.isinf(x), np.copysign(np.float32(np.inf), x), ref)
    elif policy == "nan" and spec.has_inf:
        ref = np.where(overflowed, np.float32(np.nan), ref)
    return ref.astype(np.float32)


@pytest.mark.parametrize("fmt", sorted(ML_DTYPES))
@pytest.mark.parametrize("policy", ["saturate", "inf", "nan"])
def test_bit_exact_against_ml_dtypes(fmt, policy):
    mismatches = ~_same_bits(_ours(VALUES, fmt, overflow=policy), _reference(VALUES, fmt, policy))
    assert mismatches.sum() == 0, VALUES[mismatches][:10]


@pytest.mark.parametrize("fmt", sorted(ML_DTYPES))
def test_default_policy_is_ml_dtypes_cast_where_ml_dtypes_is_ieee(fmt):
    ours = _ours(VALUES, fmt)
    if fmt == "fp8_e4m3":  # default saturate, the documented exception
        assert not _same_bits(ours, _ml(VALUES, fmt)).all()
        assert (_ours(np.array([1000.0, -np.inf], np.float32), fmt) == [448.0, -448.0]).all()
    else:
        assert _same_bits(ours, _ml(VALUES, fmt)).all()


def _tf32_reference(x: np.ndarray) -> np.ndarray:
    """RNE to 10 mantissa bits written on the integer bit pattern, independently of the implementation."""
    bits = x.view(np.uint32).astype(np.uint64)
    low, base = bits & 0x1FFF, bits & ~np.uint64(0x1FFF)
    odd = (base >> 13) & 1
    up = (low > 0x1000) | ((low == 0x1000) & (odd == 1))
    out = ((base + np.where(up, np.uint64(0x2000), np.uint64(0))) & np.uint64(0xFFFFFFFF)).astype(np.uint32).view(np.float32)
    return np.where(np.isnan(x), x, out)


def test_tf32_against_integer_reference():
    assert _same_bits(_ours(VALUES, "tf32"), _tf32_reference(VALUES)).all()
    assert _ours(np.array([1 + 2**-11, 1 + 3 * 2**-11], np.float32), "tf32").tolist() == [1.0, 1 + 2**-9]


def test_hand_computed_edges():
    e4m3 = lambda v, **kw: _ours(np.array(v, np.float32), "fp8_e4m3", **kw).tolist()
    assert e4m3([464.0, 465.0], overflow="inf") == [448.0, np.inf]  # 464 is the tie: even mantissa 448
    assert e4m3([2**-10, 2**-10 * 1.01, 3 * 2**-10]) == [0.0, 2**-9, 2**-8]  # half the min subnormal ties to 0
    fp16 = _ours(np.array([65519.0, 65520.0, 2**-25, 2**-25 * 1.01], np.float32), "fp16").tolist()
    assert fp16 == [65504.0, np.inf, 0.0, 2**-24]
    neg_zero = _ours(np.array([-0.0, -(2.0**-30)], np.float32), "fp16")
    assert (neg_zero == 0).all() and np.signbit(neg_zero).all()


@pytest.mark.parametrize("fmt", ["fp16", "bf16", "fp8_e4m3", "fp8_e5m2"])
def test_ftz_flushes_subnormal_results_to_signed_zero(fmt):
    spec = FORMATS[fmt]
    ml = _ml(np.clip(VALUES, -spec.max, spec.max) if fmt == "fp8_e4m3" else VALUES, fmt)
    expected = np.where(np.abs(ml) < spec.min_normal, np.copysign(np.float32(0), VALUES), ml).astype(np.float32)
    ours = _ours(VALUES, fmt, ftz=True)
    assert _same_bits(ours, expected).all()
    tiny = _ours(np.array([spec.min_subnormal * 3, -spec.min_normal / 2, spec.min_normal], np.float32), fmt, ftz=True)
    assert tiny.tolist() == [0.0, 0.0, spec.min_normal] and np.signbit(tiny[1])


def test_gradient_passes_straight_through_and_dtype_is_kept():
    x = torch.tensor([1000.0, 1e-9, 0.3], requires_grad=True)
    quantise(x, "fp8_e4m3").sum().backward()
    assert x.grad.tolist() == [1.0, 1.0, 1.0]
    assert quantise(torch.ones(3, dtype=torch.bfloat16), "fp8_e5m2").dtype == torch.bfloat16


def test_unknown_format_and_policy_name_the_valid_choices():
    with pytest.raises(ValueError, match="fp8_e4m3"):
        quantise(torch.ones(1), "fp12")
    with pytest.raises(ValueError, match="saturate"):
        quantise(torch.ones(1), "fp16", overflow="wrap")


@pytest.mark.parametrize("fmt,dtype", [("fp16", torch.float16), ("bf16", torch.bfloat16),
                                       ("fp8_e5m2", torch.float8_e5m2), ("fp8_e4m3", torch.float8_e4m3fn)])
def test_equals_torch_casts(fmt, dtype):
    """torch's own casts agree with ours wherever they are IEEE; for E4M3 we clamp first, because what
    torch's cast does past 448 differs between platforms (it saturates on this CPU, ml_dtypes gives NaN)."""
    x = torch.from_numpy(VALUES.copy())
    policy = "saturate" if fmt == "fp8_e4m3" else "inf"
    reference = (x.clamp(-448, 448) if fmt == "fp8_e4m3" else x).to(dtype).float().numpy()
    assert _same_bits(_ours(VALUES, fmt, overflow=policy), reference).all()


MX_ELEMENT_DTYPES = {"fp6_e2m3": ml_dtypes.float6_e2m3fn, "fp6_e3m2": ml_dtypes.float6_e3m2fn,
                     "fp4_e2m1": ml_dtypes.float4_e2m1fn}


@pytest.mark.parametrize("fmt", sorted(MX_ELEMENT_DTYPES))
def test_mx_element_formats_bit_exact_against_ml_dtypes_saturating(fmt):
    """FP6 and FP4 have neither inf nor NaN: MX saturates their elements (a NaN stays NaN in the FP32 carrier; the
    block's scale carries it). Every float32 bit pattern, clipped to +-max, against ml_dtypes' RNE cast."""
    spec = FORMATS[fmt]
    finite = VALUES[~np.isnan(VALUES)]
    reference = np.clip(finite, -spec.max, spec.max).astype(MX_ELEMENT_DTYPES[fmt]).astype(np.float32)
    assert _same_bits(_ours(finite, fmt, overflow="saturate"), reference).all()
    assert np.isnan(_ours(np.array([np.nan], np.float32), fmt, overflow="saturate")).all()
