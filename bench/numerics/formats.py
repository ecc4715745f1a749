"""Numeric formats and `quantise`: round a tensor to a format, with explicit overflow and FTZ policy.

Every format is described by its bits (`ElementFormat`), and `quantise` rounds with
round-to-nearest-even (RNE) and then applies an *explicit* overflow policy, so no library's
accident defines a format (torch 2.13's CPU float32->float8_e4m3fn cast saturates while
ml_dtypes returns NaN; here the policy decides, and it is recorded with every run).

How each format is rounded (each path is checked bit-for-bit against ml_dtypes in tests):
- fp16, bf16, fp8_e5m2: torch's native casts (RNE, subnormals, IEEE overflow to inf; fast), but for fp8_e5m2 in a
  graph compiled for the CPU, which rounds it as fp8_e4m3 below: inductor's CPU code casts to FP8 E5M2 one value at
  a time where the machine lacks AVX-512 (0.53 of clone's throughput against 0.94 in arithmetic on a 2-core AMD EPYC
  with AVX2; 0.91 against 0.94-0.98 on AVX-512 machines, docs/performance.md). The same bits (tests/test_fused.py).
- fp8_e4m3: exact float32 arithmetic, because torch's float8_e4m3fn cast has no IEEE overflow
  (NaN on some code paths, saturation on others) and is slower on CPU than this. Adding and
  subtracting a power of two 2^(e+23-m) rounds |x| to a multiple of 2^(e-m) with the FPU's own
  RNE, where e is x's exponent clamped to [emin, emax+1]. This gives the subnormal grid below
  emin and keeps values past max finite-and-too-large (or inf), so overflow is detected by
  `|r| > max`. Under saturation |x| is clamped to max first (max is on the grid, so this is
  the same as rounding then clamping) and the exponent needs no upper clamp: the training path.
- tf32: integer RNE on the float32 bit pattern (drop 13 mantissa bits), FP32 range; in a graph compiled for the CPU,
  the same bits in arithmetic (`_round_mantissa_by_splitting`).

Carrier: results are returned in x's dtype. float64 inputs are rounded to float32 first.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from bench.numerics.fused import ARITHMETIC_FROM, CAST_FROM, fused, in_fused_graph, in_graph

OVERFLOW_POLICIES = ("saturate", "inf", "nan")
SR_BITS = (8,)  # stochastic rounding from n random bits per element (Transformer Engine's NVFP4 cvt.rs: 8)
_NATIVE_CAST = {"fp16", "bf16", "fp8_e5m2"}  # torch's cast is RNE with IEEE overflow: the rounding itself
_ARITHMETIC_IN_GRAPHS = {"fp8_e5m2"}  # cast eagerly, rounded in arithmetic in a CPU graph (_rounds_by_cast: why)


NAN_ENCODINGS = ("ieee", "all_ones", "negative_zero", "none")


@dataclass(frozen=True)
class ElementFormat:
    """A floating-point element format: 1 sign bit, `exp_bits`, `man_bits` explicit mantissa bits, and what its codes
    mean. Build one with `ElementFormat.from_bits` (docs/extending.md, "Bring your own format"), which derives the
    range from the bias and the NaN encoding; the fields are what `quantise` reads.

    name: how recipes and `quantise` name it (the key in FORMATS).
    emin: the exponent of the smallest normal number (1 - bias); subnormals reach 2^(emin - man_bits).
    emax: the exponent of the largest finite number.
    max: the largest finite value.
    has_inf: whether +-inf have codes (IEEE formats only).
    default_overflow: `quantise`'s overflow policy when none is given: saturate, inf or nan.
    torch_dtype: torch's storage dtype for it, where torch has one (native paths); None otherwise.
    negative_zero: whether -0 has a code. False (E4M3FNUZ, E5M2FNUZ: the code 1.0000.000 is NaN instead) makes
      every zero result +0, as a cast to the format does.
    nan: which codes are NaN: `ieee` (exponent all ones, mantissa not zero; inf where it is zero), `all_ones` (only
      S.1111.111, OCP E4M3: the top binade keeps every other code), `negative_zero` (only the -0 code, 0x80 for
      8 bits: the FNUZ formats) or `none` (no NaN: the OCP MX element formats, whose block scale carries it).
    """

    name: str
    exp_bits: int
    man_bits: int
    emin: int
    emax: int
    max: float
    has_inf: bool
    default_overflow: str
    torch_dtype: torch.dtype | None
    negative_zero: bool = True
    nan: str = "ieee"

    @classmethod
    def from_bits(cls, name: str, exp_bits: int, man_bits: int, *, bias: int | None = None, nan: str = "ieee",
                  negative_zero: bool = True, default_overflow: str | None = None,
                  torch_dtype: torch.dtype | None = None) -> ElementFormat:
        """The format of 1 + exp_bits + man_bits bits with exponent `bias` (default 2^(exp_bits-1) - 1, IEEE's) and
        the `nan` encoding (NAN_ENCODINGS); its range follows: IEEE keeps the top exponent code for inf and NaN,
        `all_ones` only its top mantissa code, `negative_zero` and `none` no code at all. The default overflow is
        IEEE's inf where the format has one, else saturation (what torchao and Transformer Engine do before a cast)."""
        if nan not in NAN_ENCODINGS:
            raise ValueError(f"nan={nan!r} is not an encoding; valid: {', '.join(NAN_ENCODINGS)}")
        if (nan == "negative_zero") == negative_zero:
            raise ValueError("nan='negative_zero' (NaN takes -0's code) and negative_zero=False go together")
        if not (1 <= exp_bits <= 8 and 0 <= man_bits <= 23):
            raise ValueError(f"{name}: exp_bits={exp_bits}, man_bits={man_bits} must fit float32's 8 and 23 (every "
                             "value is computed in float32)")
        bias = 2 ** (exp_bits - 1) - 1 if bias is None else bias
        top_code = 2**exp_bits - 1  # the largest biased exponent
        emax = top_code - bias - (nan == "ieee")
        spare_codes = 2 if nan == "all_ones" else 1  # the top binade's largest mantissa is NaN there
        largest = (2 - spare_codes * 2.0**-man_bits) * 2.0**emax
        if not -126 <= 1 - bias <= emax <= 127:
            raise ValueError(f"{name}: exponents {1 - bias} to {emax} (bias {bias}, nan={nan!r}) must be a range of "
                             "normal numbers within float32's -126 to 127")
        if largest <= 0:
            raise ValueError(f"{name}: with nan={nan!r} and man_bits={man_bits} its top binade holds no finite value "
                             "(all_ones takes its largest mantissa for NaN); valid: man_bits >= 1, or another nan")
        default_overflow = default_overflow or ("inf" if nan == "ieee" else "saturate")
        return cls(name, exp_bits, man_bits, emin=1 - bias, emax=emax, max=largest, has_inf=nan == "ieee",
                   default_overflow=default_overflow, torch_dtype=torch_dtype, negative_zero=negative_zero, nan=nan)

    @property
    def bias(self) -> int:
        return 1 - self.emin

    def definition(self) -> dict:
        """What the format is, as a record keeps it (env.precision.element_definitions): its bits, exponent range,
        largest value and special codes. A format redefined under its name no longer matches its records."""
        return {"exp_bits": self.exp_bits, "man_bits": self.man_bits, "emin": self.emin, "emax": self.emax,
                "max": self.max, "has_inf": self.has_inf, "nan": self.nan, "negative_zero": self.negative_zero}

    @property
    def storage_bytes(self) -> float:
        """Bytes per element where the format is stored: its bits, except TF32, which lives in FP32 storage
        (only tensor cores read 10 mantissa bits)."""
        return 4.0 if self.name == "tf32" else (1 + self.exp_bits + self.man_bits) / 8

    @property
    def min_normal(self) -> float:
        return 2.0**self.emin

    @property
    def min_subnormal(self) -> float:
        return 2.0 ** (self.emin - self.man_bits)

    def rounding_edges(self) -> list[float]:
        """Magnitudes where RNE's outcome changes class (exact in float32), for telemetry's bucketize:
        |x| <= e0: zero stays zero; <= e1 = min_sub/2: rounds to zero (the tie goes to even 0);
        <= e2: lands subnormal (below min_normal - min_sub/2, whose tie rounds up to min_normal);
        <= e3: normal; beyond: overflow, i.e. past max + half an ulp, or on that tie when max's last
        mantissa bit is odd (IEEE formats; E4M3's max 1.110b * 2^8 is even, so its tie rounds to max)."""
        half_ulp = 2.0 ** (self.emax - self.man_bits - 1)
        max_is_odd = int(self.max / (2 * half_ulp)) % 2 == 1
        edges = torch.tensor([0.0, self.min_subnormal / 2, self.min_normal - self.min_subnormal / 2,
                              self.max + half_ulp], dtype=torch.float32)
        below = torch.nextafter(edges, torch.zeros_like(edges))
        return [0.0, edges[1].item(), below[2].item(), (below[3] if max_is_odd else edges[3]).item()]


_bits = ElementFormat.from_bits
FORMATS: dict[str, ElementFormat] = {
    "fp32": _bits("fp32", 8, 23, torch_dtype=torch.float32),
    "tf32": _bits("tf32", 8, 10),
    "fp16": _bits("fp16", 5, 10, torch_dtype=torch.float16),
    "bf16": _bits("bf16", 8, 7, torch_dtype=torch.bfloat16),
    # OCP E4M3 ("fn"): no inf, only S.1111.111 is NaN, so the top binade reaches 1.75 * 2^8 = 448.
    # Saturation is the default because torchao and Transformer Engine clamp before casting.
    "fp8_e4m3": _bits("fp8_e4m3", 4, 3, nan="all_ones", torch_dtype=torch.float8_e4m3fn),
    "fp8_e5m2": _bits("fp8_e5m2", 5, 2, torch_dtype=torch.float8_e5m2),
    # OCP MX element formats: no inf, no NaN (the block scale carries NaN); every exponent code is finite.
    "fp6_e2m3": _bits("fp6_e2m3", 2, 3, nan="none"),
    "fp6_e3m2": _bits("fp6_e3m2", 3, 2, nan="none"),
    "fp4_e2m1": _bits("fp4_e2m1", 2, 1, nan="none"),
}
FP32_EMIN = FORMATS["fp32"].emin  # FP32's smallest normal exponent, -126
FLOAT32_MAX = torch.finfo(torch.float32).max
_SIXTEEN_BIT_FORMATS = {FORMATS[name].torch_dtype: FORMATS[name] for name in ("bf16", "fp16")}  # autocast's


def register_element(element: ElementFormat) -> ElementFormat:
    """Declare an element format (a user's: docs/extending.md), by its name; registering the same one again is a
    no-op (a module imported twice), another under a taken name an error."""
    if FORMATS.get(element.name, element) != element:
        raise ValueError(f"element format {element.name!r} is already declared, differently: {FORMATS[element.name]}")
    FORMATS[element.name] = element
    return element


def get_format(fmt: str | ElementFormat) -> ElementFormat:
    if isinstance(fmt, ElementFormat):
        return fmt
    try:
        return FORMATS[fmt]
    except KeyError:
        raise ValueError(f"unknown element format {fmt!r}; valid: {', '.join(FORMATS)}") from None


def resolve_overflow(spec: ElementFormat, overflow: str | None) -> str:
    policy = spec.default_overflow if overflow is None else overflow
    if policy not in OVERFLOW_POLICIES:
        raise ValueError(f"unknown overflow policy {policy!r}; valid: {', '.join(OVERFLOW_POLICIES)}")
    return policy


def round_unbounded(x: torch.Tensor, spec: ElementFormat) -> torch.Tensor:
    """RNE to `spec`'s grid (subnormals included) on float32 `x`, with no overflow policy yet.

    Values past the rounding boundary above max come back either as inf (native casts) or as a
    finite value > max (the arithmetic path); both satisfy `|r| > spec.max`.
    """
    if spec.name == "fp32":
        return x
    if spec.name == "tf32":
        return _round_mantissa_bits(x, spec.man_bits)
    if _rounds_by_cast(spec, x.device):
        return x.to(spec.torch_dtype).to(torch.float32)
    if _splits(spec):
        return _round_by_splitting(x, spec, clamped=False)
    return _with_sign_of(_round_on_grid(x.abs(), spec, top_exponent=spec.emax + 1), x)


def _split_bound(spec: ElementFormat) -> float:
    """Past this magnitude (above max) an unclamped x is left as it is by `_round_by_splitting`."""
    return 2.0 ** (spec.emax + 2)


def _splits(spec: ElementFormat) -> bool:
    """Whether spec is rounded by `_round_by_splitting` here: in a fused graph of ours, a format below FP32's exponent
    range whose splitting factor times `_split_bound` stays finite (every built-in one; a user's with an 8-bit
    exponent may not)."""
    return (in_fused_graph() and spec.emin > FP32_EMIN
            and _split_bound(spec) * 2.0 ** (23 - spec.man_bits) < 2.0**126)


def _veltkamp(x: torch.Tensor, kept_bits: int) -> torch.Tensor:
    """x rounded to `kept_bits` significant bits, to nearest even, by Veltkamp's splitting: c = x(2^(24-k) + 1),
    then c - (c - x). Exact for normal x whose c is finite; in our fused graphs alone, whose FMA contraction is held
    off (fused.INDUCTOR_OPTIONS): contracted, x(2^s + 1) - x is no longer a split."""
    c = x * (2.0 ** (24 - kept_bits) + 1)
    return c - (c - x)


def _round_by_splitting(x: torch.Tensor, spec: ElementFormat, clamped: bool) -> torch.Tensor:
    """RNE of signed FP32 `x` to spec's grid (subnormals included) in floating-point arithmetic alone, for a graph:
    Veltkamp's splitting (c = x(2^(23-m) + 1), c - (c - x): x to m + 1 significant bits, RNE, for |x| from spec's
    smallest normal up) and, below it, x scaled to units of the grid's spacing there, rounded to a whole number by
    `torch.round` (RNE; one instruction, and a zero keeps x's sign) and scaled back: both scalings are exact. The
    same bits as `_round_on_grid` (every FP32 of E4M3's and E5M2's range checked against torch's casts;
    tests/test_fused.py holds the fused quantisers to the eager ones), without its bit views: inductor's CPU code
    makes each view a store and a reload, about 3 ns a value on an Intel Xeon with AMX (docs/performance.md).
    A value rounded to zero keeps x's sign (-0, as a cast gives); unless x is `clamped` to +-max, past `_split_bound`
    (whose splitting must stay finite: an infinity, or past max anyway) x is returned as it is; NaN stays NaN. In our
    fused graphs alone (`_veltkamp`)."""
    normal = _veltkamp(x, spec.man_bits + 1)
    magnitude = x.abs()
    if not clamped:
        normal = torch.where(magnitude > _split_bound(spec), x, normal)
    up = 2.0 ** (spec.man_bits - spec.emin)  # below the smallest normal: RNE to whole multiples of the spacing
    return torch.where(magnitude < 2.0**spec.emin, torch.round(x * up) * (1 / up), normal)


def _with_sign_of(magnitude: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """copysign(magnitude, x) of FP32 tensors, magnitude a temporary of the caller's (eagerly changed in place). In a
    graph, as the bit operation copysign is (magnitude's bits but the sign, x's sign bit): inductor's CPU code calls
    Sleef's copysign out of line for every 16 values, spilling registers around the call, and the bit operation cut
    11-16% of a fused block quantiser's time in the caches (docs/performance.md). The same bits, NaNs' included."""
    if not in_graph():
        return magnitude.copysign_(x)
    return ((magnitude.view(torch.int32) & 0x7FFFFFFF) | (x.view(torch.int32) & -0x80000000)).view(torch.float32)


def _rounds_by_cast(spec: ElementFormat, device: torch.device) -> bool:
    """Whether a rounding to spec on device is torch's cast: eagerly, yes; in a graph, only in a fused graph of ours
    on the CPU (compiled with emulate_precision_casts) and not for _ARITHMETIC_IN_GRAPHS there (inductor's CPU code
    for E5M2's cast is scalar, slower than the arithmetic: docs/performance.md). Not in a CUDA graph, where Triton's
    code for the cast there and back left FP16's and BF16's values unrounded and E5M2's not the eager bits (an H200,
    2026-11-29: tests/test_fused.py, `pytest -m cuda`), nor in a compiled model's step (train.compile), whose
    inductor, on its defaults, fuses FP16's and BF16's round trips into nothing on the CPU too."""
    return spec.name in _NATIVE_CAST and (not in_graph() or (
        in_fused_graph() and device.type == "cpu" and spec.name not in _ARITHMETIC_IN_GRAPHS))


def rounded_through(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x rounded to the 16-bit `dtype` and handed back in FP32, as a cast there and back does; in a CUDA graph, whose
    Triton code leaves such a round trip out (`_rounds_by_cast`), by the arithmetic that gives the cast's bits. An
    emulated op hands autocast's values on in an FP32 tensor this way (bench/numerics/emulation.py, chain.py)."""
    spec = _SIXTEEN_BIT_FORMATS[dtype]
    if _rounds_by_cast(spec, x.device):
        return x.to(dtype).float()
    return quantise_value(x.float(), spec, "inf")


def _overflows_to_inf(spec: ElementFormat, device: torch.device) -> bool:
    """Whether spec's rounding path on device already turns overflow into +-inf (a cast, or FP32's range)."""
    return spec.name in ("fp32", "tf32") or _rounds_by_cast(spec, device)


def _round_on_grid(magnitude: torch.Tensor, spec: ElementFormat, top_exponent: int | None) -> torch.Tensor:
    """RNE of a float32 magnitude (overwritten) by adding and subtracting 2^(e+23-m), e its exponent clamped
    to [emin, top_exponent] (no upper clamp when top_exponent is None: the caller bounded it). A format with FP32's
    exponent range (BF16) has FP32's grid with fewer mantissa bits, and its top binades' 2^(e+23-m) is past FP32's:
    its mantissa is rounded in FP32's bits instead (overflow carries to inf, which is past max as the grid's is)."""
    if spec.emin == FP32_EMIN:
        return _round_mantissa_bits(magnitude, spec.man_bits)
    shift = (23 - spec.man_bits) << 23
    magic_bits = (magnitude.view(torch.int32) & 0x7F800000).add_(shift)
    magic_bits.clamp_(min=((spec.emin + 127) << 23) + shift,
                      max=None if top_exponent is None else ((top_exponent + 127) << 23) + shift)
    magic = magic_bits.view(torch.float32)
    return magnitude.add_(magic).sub_(magic)


def _round_mantissa_bits(x: torch.Tensor, man_bits: int) -> torch.Tensor:
    """RNE of float32 to `man_bits` mantissa bits in FP32's exponent range (carry may reach inf). On the float32 bit
    pattern, but in a fused graph for the CPU, where each bit view costs a store and a reload (`_round_by_splitting`):
    in arithmetic there (`_round_mantissa_by_splitting`)."""
    if in_fused_graph() and x.device.type == "cpu":
        return _round_mantissa_by_splitting(x, man_bits)
    drop = 23 - man_bits
    bits = x.view(torch.int32)
    lsb = (bits >> drop) & 1
    rounded = ((bits + ((1 << (drop - 1)) - 1) + lsb) & ~((1 << drop) - 1)).view(torch.float32)
    return torch.where(x.isnan(), x, rounded)


_SPLIT_SCALE = 2.0**64  # for |x| from _SPLIT_SCALED_FROM: scaled down by it, split, scaled back: exact both ways
_SPLIT_SCALED_FROM = 2.0**100  # below it, x times a splitting factor (at most 2^23 + 1) stays below FP32's max


def _round_mantissa_by_splitting(x: torch.Tensor, man_bits: int) -> torch.Tensor:
    """`_round_mantissa_bits` in floating-point arithmetic alone, for a fused graph on the CPU: Veltkamp's splitting
    as in `_round_by_splitting`, on x scaled down by 2^64 where |x| >= 2^100 (its factor would overflow FP32 there;
    scaled back, a carry past max is inf, as the bits' carry is), and a fixed shift below FP32's smallest normal (the
    grid's spacing there, 2^(-126-m)). Infinities and NaNs are x's own. The same bits on every FP32 for TF32's and
    BF16's widths (tests/test_fused.py). On an Intel Xeon with AMX, TF32's fused rounding of 4096 x 4096 values went
    from 0.12-0.15 of clone's throughput with the bit views to 0.63-0.74 (docs/performance.md)."""
    magnitude = x.abs()
    large = magnitude >= _SPLIT_SCALED_FROM
    y = torch.where(large, x * (1 / _SPLIT_SCALE), x)
    normal = _veltkamp(y, man_bits + 1)
    normal = torch.where(large, normal * _SPLIT_SCALE, normal)
    shift = 1.5 * 2.0 ** (FP32_EMIN - man_bits + 23)
    r = torch.where(magnitude < 2.0**FP32_EMIN, (x + shift) - shift, normal)
    r = torch.where(r == 0, x * 0.0, r)
    return torch.where(magnitude <= FLOAT32_MAX, r, x)  # inf and NaN (false) as they came


def _fused_from(fmt: str | ElementFormat, *_, **__) -> int:
    """The fewest elements whose rounding to `fmt` is compiled: torch's own cast is two eager passes, and pays
    later (bench/numerics/fused.py)."""
    return CAST_FROM if get_format(fmt).name in _NATIVE_CAST else ARITHMETIC_FROM


@fused(_fused_from)
def quantise_value(x: torch.Tensor, fmt: str | ElementFormat, overflow: str | None = None,
                   ftz: bool = False) -> torch.Tensor:
    """The forward value of `quantise` (no autograd): x rounded to `fmt`, in x's dtype (one fused pass where that
    pays: bench/numerics/fused.py)."""
    spec = get_format(fmt)
    policy = resolve_overflow(spec, overflow)
    x32 = x.to(torch.float32)
    if policy == "saturate" and not _overflows_to_inf(spec, x.device):  # the arithmetic path, saturating
        # clamping |x| to max (on the grid) first is the same as rounding, then clamping; it saves passes
        if _splits(spec):
            r = _round_by_splitting(x32.clamp(-spec.max, spec.max), spec, clamped=True)
        else:
            r = _with_sign_of(_round_on_grid(x32.abs().clamp_(max=spec.max), spec, top_exponent=None), x32)
    else:
        r = round_unbounded(x32, spec)
        if policy == "saturate":
            r = r.clamp(-spec.max, spec.max)
        elif policy == "inf":
            if not _overflows_to_inf(spec, x.device):
                # r * inf, not r.sign() * inf: the same +-inf (r is past max), and inductor's CPU code for sign
                # doubled E5M2's fused rounding time (docs/performance.md)
                r = torch.where(r.abs() > spec.max, r * math.inf, r)
        else:  # nan
            overflowed = r.abs() > spec.max
            if spec.has_inf:  # an infinite input stays infinite; only finite overflow becomes NaN
                overflowed &= x32.isfinite()
            r = torch.where(overflowed, math.nan, r)
    return _finish(r, spec, ftz).to(x.dtype)


def _finish(r: torch.Tensor, spec: ElementFormat, ftz: bool) -> torch.Tensor:
    """The last steps every rounding shares: subnormals flushed (ftz), and -0 made +0 where the format has no -0."""
    r = _flush_subnormals(r, spec) if ftz else r
    return r if spec.negative_zero else torch.where(r == 0, 0.0, r)


def _flush_subnormals(r: torch.Tensor, spec: ElementFormat) -> torch.Tensor:
    """Results below the smallest normal to signed zero: multiplying by the mask keeps the sign (-tiny * 0 = -0),
    NaN and inf."""
    return r * (r.abs() >= spec.min_normal)


def quantise_stochastic(x: torch.Tensor, fmt: str | ElementFormat, generator: torch.Generator | None = None,
                        overflow: str = "saturate", ftz: bool = False, bits: int | None = None,
                        draw: torch.Tensor | None = None) -> torch.Tensor:
    """x rounded to `fmt` stochastically: |x| goes to the grid point above it with probability
    (|x| - below) / spacing and to the one below otherwise, so E[result] = x inside the range and the chance of
    rounding up is proportional to the distance. Values on the grid stay; NaN stays NaN. Seeded by `generator`
    (one uniform draw per element, in x's order): reproducible.

    Past max the grid goes on one step of the top binade's spacing (for IEEE formats that step is 2^(emax+1),
    where RNE's overflow begins), and a value rounded there has overflowed: `overflow` decides, as in
    `quantise_value` ('saturate': max, the block formats' rule; 'inf': +-inf; 'nan': NaN, an infinite input of a
    format with inf staying inf). So max < |x| < max + spacing overflows with probability (|x| - max) / spacing.
    ftz: as in `quantise_value`.

    bits: None draws an FP32 uniform (unbiased to within 2^-24); n draws n random bits, as a GPU's stochastic
    rounding does (Transformer Engine's NVFP4 `cvt.rs` takes 8 per element), and sees only the top n bits of the
    distance: |x| rounds up with probability floor(2^n * distance / spacing) / 2^n, biased toward zero by up to
    2^-n of a spacing.

    draw: the FP32 uniforms to use, one per element (a sharded tensor's slice of the whole's), instead of drawing."""
    spec = get_format(fmt)
    if draw is None:
        draw = uniforms(x.shape, x.device, generator, bits)
    return _round_up_below(x, draw, spec, resolve_overflow(spec, overflow), ftz, bits)


def tensor_amax_of(x: torch.Tensor) -> torch.Tensor:
    """x's largest magnitude (NaN where it holds one), no gradient recorded: the amax a tensor's scale starts from
    (per-tensor FP8 scaling, NVFP4's two-level scale). max(), not amax(): the same full reduction, but torch_xla 2.9
    reduces nothing for amax() without dims."""
    return x.detach().abs().max()


def uniforms(shape: torch.Size, device: torch.device, generator: torch.Generator | None,
             bits: int | None) -> torch.Tensor:
    """The draws `quantise_stochastic` takes for a tensor of `shape`, one per element in its order: FP32 uniforms
    in [0, 1) (bits None) or n random bits' worth, from the generator's own stream (drawn eagerly, always)."""
    if bits is None:
        return torch.rand(shape, generator=generator, device=device)
    if bits in SR_BITS:  # FP32 integers, the same stream as int64's without its 8-byte copy (3x faster on 4M values)
        return torch.randint(0, 1 << bits, shape, generator=generator, device=device, dtype=torch.float32).mul_(
            2.0 ** -bits)
    raise ValueError(f"stochastic rounding with {bits} random bits is not offered; valid: null (an FP32 "
                     f"uniform), {', '.join(map(str, SR_BITS))}")


@fused(ARITHMETIC_FROM)
def _round_up_below(x: torch.Tensor, draw: torch.Tensor, spec: ElementFormat, policy: str, ftz: bool,
                    bits: int | None = None) -> torch.Tensor:
    """quantise_stochastic given its uniform draws: |x| rounds up where draw < its distance above the grid point
    below, in units of the spacing (truncated to `bits` bits where given: draws are then multiples of 2^-bits)."""
    x32 = x.to(torch.float32)
    top_spacing = 2.0 ** (spec.emax - spec.man_bits)
    bound = spec.max + top_spacing  # BF16's (2^128) is past FP32's range, which then bounds |x| by itself
    signed = x32 if bound > FLOAT32_MAX else x32.clamp(-bound, bound)
    magnitude = signed.abs()
    arithmetic = in_fused_graph()  # no bit views, no sign
    if arithmetic:
        spacing = _binade_of(magnitude, spec) * 2.0**-spec.man_bits
    else:
        # floor(log2 |x|) in range, from float32's exponent field (an FP32 subnormal reads -127: below every emin)
        exponent = ((magnitude.view(torch.int32) >> 23) - 127).clamp(min=spec.emin, max=spec.emax)
        if spec.emin - spec.man_bits >= FP32_EMIN:  # every spacing a normal float32: written as its exponent field
            spacing = ((exponent - spec.man_bits + 127) << 23).view(torch.float32)
        else:
            spacing = torch.ldexp(torch.ones_like(magnitude), exponent - spec.man_bits)
    below = torch.floor(magnitude / spacing) * spacing  # exact: spacing is a power of two
    distance = (magnitude - below) / spacing  # exact, in [0, 1)
    if bits is not None:
        distance = torch.floor(distance * (1 << bits)) / (1 << bits)
    if arithmetic:  # a select: inductor's CPU code for sign is two selects and a subtraction a vector
        rounded = below + torch.where(draw < distance, spacing, 0.0)
    else:
        # 1 where draw < distance, else 0, from their difference: 0 only where they are equal, and torch's sign of
        # NaN (an infinite |x|'s distance, inf - inf) is 0, as `draw < NaN` was False. A compiled graph held the
        # comparison `draw < distance` as a buffer of bools, 5.5x slower (docs/performance.md; the select above,
        # in our fused graphs since threshold 10, is not)
        rounded = below + spacing * (distance - draw).sign().clamp(min=0)
    overflowed = rounded > spec.max
    if policy == "saturate":
        rounded = rounded.clamp(max=spec.max)
    elif policy == "inf":
        rounded = torch.where(overflowed, math.inf, rounded)
    else:  # nan: finite overflow becomes NaN; an infinite input of a format with inf stays infinite
        rounded = torch.where(x32.isinf() & spec.has_inf, math.inf, torch.where(overflowed, math.nan, rounded))
    if arithmetic:  # x's sign by selects, a zero's from x * 0: a NaN's sign aside, copysign's bits. Both from
        # `signed`, x clamped (its sign, and its zero wherever the result is zero), the one FP32 copy a graph then
        # stores: from x32, TE's NVFP4 graph stored `x < 0` as bools, 4x slower (docs/performance.md)
        rounded = torch.where(signed < 0, -rounded, rounded)
        rounded = torch.where(rounded == 0, signed * 0.0, rounded)
    else:
        rounded = _with_sign_of(rounded, x32)
    return _finish(rounded, spec, ftz).to(x.dtype)


_ONE_BIT_SPLIT = 2.0**23 + 1  # `_veltkamp(m, 1)`'s factor: exact while m times it stays finite (m < 2^104)
_BINADE_SCALED_FROM = 2.0**100  # from here `_binade_of` splits m * 2^-64 (exact: m is normal and stays so)


def _binade_of(magnitude: torch.Tensor, spec: ElementFormat) -> torch.Tensor:
    """2^floor(log2 m) of each magnitude m, clamped to [2^emin, 2^emax], in arithmetic for a fused graph (no bit
    view): Veltkamp's split rounds m to one significant bit, 2^e or 2^(e+1); the larger, past m, is halved. A smaller
    m than FP32's smallest normal (zero, an FP32 subnormal) is below 2^emin (never under FP32's), which the clamp gives
    it. For a format whose range passes 2^100 (BF16's and TF32's: FP32's own), m from there is split scaled down by
    2^64 and scaled back, and an infinite m is split as FP32's max: 2^emax, as its exponent field clamped reads. A
    NaN stays NaN."""
    if 2.0 ** (spec.emax + 1) <= _BINADE_SCALED_FROM:  # every m the caller passes (its bound, 2^(emax+1), at most)
        return _split_binade(magnitude).clamp(2.0**spec.emin, 2.0**spec.emax)
    large = magnitude >= _BINADE_SCALED_FROM
    binade = _split_binade(torch.where(large, magnitude.clamp(max=FLOAT32_MAX) * 2.0**-64, magnitude))
    return torch.where(large, binade * 2.0**64, binade).clamp(2.0**spec.emin, 2.0**spec.emax)


def _split_binade(m: torch.Tensor) -> torch.Tensor:
    """2^floor(log2 m) of normal FP32 m under 2^104 (`_binade_of`'s step, unclamped): Veltkamp's one-bit split."""
    nearest = _veltkamp(m, 1)
    return torch.where(nearest > m, nearest * 0.5, nearest)


class _QuantiseSTE(torch.autograd.Function):
    """Round in the forward pass; pass the gradient straight through."""

    @staticmethod
    def forward(ctx, x, spec, overflow, ftz):
        return quantise_value(x, spec, overflow, ftz)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None, None


def quantise(x: torch.Tensor, fmt: str | ElementFormat, overflow: str | None = None,
             ftz: bool = False) -> torch.Tensor:
    """Round `x` to `fmt` (RNE) in x's dtype; in autograd the gradient passes straight through.

    fmt: a name in FORMATS (fp32, tf32, fp16, bf16, fp8_e4m3, fp8_e5m2, fp6_e2m3, fp6_e3m2, fp4_e2m1, and any
      registered with `register_element`) or an ElementFormat.
    overflow: 'saturate' (clamp to +-max), 'inf' (past the rounding boundary -> +-inf, also for
      e4m3, whose carrier can hold inf though the format cannot), 'nan' (-> NaN, as ml_dtypes'
      e4m3fn); None = the format's default (e4m3: saturate, others: inf).
    ftz: flush results below the smallest normal to signed zero (TPU bfloat16 semantics).
    NaN stays NaN; +-inf stays +-inf (+-max under saturate; NaN under 'nan' for e4m3); -0 stays -0 where the
      format has a -0 (ElementFormat.negative_zero), and every zero is +0 where it has none.
    """
    return _QuantiseSTE.apply(x, get_format(fmt), overflow, ftz)
