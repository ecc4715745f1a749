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
    out = (((base + np.where(up, np.uint64(0x2000), np.uint64(0))) & np.uint64(0xFFFFFFFF))
           .astype(np.uint32).view(np.float32))
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


# --- a user's element format: docs/extending.md's worked one, AMD's FNUZ FP8, built with the public constructor ---

PLUGIN = __import__("pathlib").Path(__file__).resolve().parent / "plugin"


@pytest.fixture
def amd_fp8(monkeypatch):
    """tests/plugin/amd_fp8.py imported as the suite imports a plug-in; the registries restored afterwards."""
    import importlib
    import sys

    from bench.numerics import specs

    monkeypatch.setattr(specs, "FORMAT_SPECS", dict(specs.FORMAT_SPECS))
    monkeypatch.setattr(sys, "path", [str(PLUGIN), *sys.path])
    saved = dict(FORMATS)
    sys.modules.pop("amd_fp8", None)
    yield importlib.import_module("amd_fp8")
    sys.modules.pop("amd_fp8", None)
    FORMATS.clear()
    FORMATS.update(saved)


def _adversarial(dtype) -> np.ndarray:
    """Every code of `dtype`, every midpoint between neighbouring finite codes (the ties), and one float32 ulp either
    side of each; signed zeros, the smallest subnormal's half and quarter, past max, +-inf and NaN."""
    codes = np.arange(256, dtype=np.uint8).view(dtype).astype(np.float32)
    finite = np.unique(codes[np.isfinite(codes)])
    ties = (finite[:-1].astype(np.float64) + finite[1:]) / 2
    points = np.concatenate([finite, ties.astype(np.float32)])
    with np.errstate(over="ignore"):
        around = np.concatenate([np.nextafter(points, np.float32(np.inf)), np.nextafter(points, np.float32(-np.inf))])
        tiny = float(finite[finite > 0].min())
        extra = np.array([0.0, -0.0, tiny / 2, -tiny / 2, tiny / 4, -tiny / 4, finite.max() * 2, -finite.max() * 2,
                          np.inf, -np.inf, np.nan], dtype=np.float32)
    return np.concatenate([points, around.astype(np.float32), extra])


@pytest.mark.parametrize("element, dtype", [("fp8_e4m3fnuz", ml_dtypes.float8_e4m3fnuz),
                                            ("fp8_e5m2fnuz", ml_dtypes.float8_e5m2fnuz)])
def test_a_users_fnuz_format_rounds_bit_for_bit_as_ml_dtypes(amd_fp8, element, dtype):
    """ml_dtypes' cast is RNE with overflow to NaN (the only NaN, 0x80) and no -0: the format's `nan` policy. Signed
    zero included: -0 and negatives rounding to zero come out +0. 0 mismatches over every family."""
    spec = FORMATS[element]
    assert (spec.bias, spec.max, spec.has_inf, spec.negative_zero) == \
        ((8, 240.0, False, False) if element == "fp8_e4m3fnuz" else (16, 57344.0, False, False))
    x = _adversarial(dtype)
    with np.errstate(over="ignore", invalid="ignore"):
        reference = x.astype(dtype).astype(np.float32)
    ours = _ours(x, element, overflow="nan")
    mismatched = ~_same_bits(ours, reference)
    assert mismatched.sum() == 0, list(zip(x[mismatched][:5], ours[mismatched][:5], reference[mismatched][:5]))
    assert len(x) > 1500 and (np.signbit(ours) & (ours == 0)).sum() == 0  # the families ran; no -0 anywhere
    # saturation (the training default) is ml_dtypes' cast of the value clipped to +-max; stochastic rounding never
    # makes a -0 either
    clipped = np.clip(x[~np.isnan(x)], -spec.max, spec.max)
    np.testing.assert_array_equal(_ours(x[~np.isnan(x)], element).view(np.uint32),
                                  clipped.astype(dtype).astype(np.float32).view(np.uint32))
    from bench.numerics.formats import quantise_stochastic

    small = -torch.rand(10_000) * spec.min_subnormal
    assert not torch.signbit(quantise_stochastic(small, element)[small.abs() < spec.min_subnormal / 2 ** 30]).any()
    assert not (torch.signbit(r := quantise_stochastic(small, element)) & (r == 0)).any()


def test_element_formats_built_from_bits_are_the_shipped_ones():
    """The public constructor derives each shipped format's range from its bias and NaN encoding: the values the
    formats were written with by hand before it existed."""
    written = {"fp32": (-126, 127, 3.4028234663852886e38, True, "inf"), "fp16": (-14, 15, 65504.0, True, "inf"),
               "bf16": (-126, 127, 3.3895313892515355e38, True, "inf"), "fp8_e4m3": (-6, 8, 448.0, False, "saturate"),
               "fp8_e5m2": (-14, 15, 57344.0, True, "inf"), "fp6_e2m3": (0, 2, 7.5, False, "saturate"),
               "fp6_e3m2": (-2, 4, 28.0, False, "saturate"), "fp4_e2m1": (0, 2, 6.0, False, "saturate")}
    for name, values in written.items():
        f = FORMATS[name]
        assert (f.emin, f.emax, f.max, f.has_inf, f.default_overflow) == values, name


def test_the_element_constructor_refuses_what_no_format_is():
    from bench.numerics.formats import ElementFormat

    with pytest.raises(ValueError, match="valid: ieee, all_ones, negative_zero, none"):
        ElementFormat.from_bits("x", 4, 3, nan="0x80")
    with pytest.raises(ValueError, match="go together"):
        ElementFormat.from_bits("x", 4, 3, nan="negative_zero")  # NaN on -0's code, yet -0 kept
    from bench.numerics.formats import register_element

    with pytest.raises(ValueError, match="already declared, differently"):
        register_element(ElementFormat.from_bits("fp8_e4m3", 4, 3))  # the OCP one is not IEEE-like


def test_a_users_declarations_are_refused_where_they_would_train_something_else():
    """A newcomer's plug-ins (2026-11-30) trained without a word: an E9M2 (float32 holds 8 exponent bits: the run
    failed mid-way), an E4M0 whose all-ones NaN left no finite value (max 0: every value rounded to 0, recorded ok),
    an E1M2 with no normal numbers, a format named fp8 that replaced the built-in (and took its records), and a
    scaling method with site_scales but no site_scale (recorded as the method, trained unscaled)."""
    import dataclasses

    from bench.numerics.formats import ElementFormat
    from bench.numerics.scaling_methods import ScalingMethod, register
    from bench.numerics.specs import FORMAT_SPECS
    from bench.numerics.specs import register as register_format

    with pytest.raises(ValueError, match="exp_bits=9, man_bits=2 must fit float32's 8 and 23"):
        ElementFormat.from_bits("x", 9, 2)
    with pytest.raises(ValueError, match="its top binade holds no finite value"):
        ElementFormat.from_bits("x", 4, 0, nan="all_ones")
    with pytest.raises(ValueError, match="exponents 1 to 0 .* must be a range of normal numbers"):
        ElementFormat.from_bits("x", 1, 2)
    assert ElementFormat.from_bits("x", 4, 0, nan="ieee").max == 2.0 ** 7  # E4M0 with IEEE's codes has a range
    with pytest.raises(ValueError, match="format 'fp8' is already declared \\(in bench.numerics.specs\\)"):
        register_format(dataclasses.replace(FORMAT_SPECS["fp8"], declared_in="my_plugin"))
    assert FORMAT_SPECS["fp8"].declared_in == "bench.numerics.specs"

    class Forgot(ScalingMethod):
        site_scales = True

    with pytest.raises(ValueError, match="sets site_scales = True but does not override site_scale"):
        register("forgot")(Forgot)


def test_a_format_redefined_under_its_name_is_refused_where_its_records_are(make_cfg, tmp_path, monkeypatch):
    """A record keeps each element format's definition (env.precision.element_definitions). A newcomer redefined a
    format of their own under its name (another bias and NaN encoding) and the same command skipped the cell as
    recorded, returning the old format's accuracy; now it exits 2 naming what changed, and the record is kept."""
    import dataclasses

    from bench.errors import ConfigError
    from bench.numerics import formats
    from bench.running.run import run_cell

    cfg = make_cfg("format=fp8", "train.max_steps=1", f"results_dir={tmp_path}")
    record = run_cell(cfg)
    assert record["env"]["precision"]["element_definitions"]["fp8_e4m3"] == formats.FORMATS["fp8_e4m3"].definition()
    assert run_cell(cfg)["skipped"]
    redefined = dataclasses.replace(formats.FORMATS["fp8_e5m2"], emin=-15, max=98304.0)
    monkeypatch.setitem(formats.FORMATS, "fp8_e5m2", redefined)
    with pytest.raises(ConfigError, match=r"element format fp8_e5m2 \(emin -14 then, -15 now, max 57344.0 then, "
                                          r"98304.0 now\), defined differently now"):
        run_cell(cfg)
    assert (tmp_path / cfg.cell / "result.json").is_file()
