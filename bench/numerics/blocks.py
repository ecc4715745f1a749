"""Block-scaled formats, emulated bit-exactly on any device: OCP Microscaling (MX) and NVIDIA's NVFP4.

MX (OCP Microscaling Formats v1.0): k = 32 consecutive elements along the dimension a GEMM reduces share one
scale X = 2^e, stored as E8M0 (the exponent alone, bias 127; e in [-127, 127], 0xFF = NaN). Each element is
x / X rounded to nearest even in its element format and saturated at its largest finite value. e comes from the
block's amax and the element format's largest exponent emax_elem, by scale mode (torchao's ScaleCalculationMode):
- floor: e = floor(log2 amax) - emax_elem (the OCP spec's rule; torchao's default). amax / X can reach
  2^(emax_elem + 1) > max_elem: the block's largest elements may clip to max_elem;
- ceil:  e = ceil(log2 amax) - emax_elem (never clips; the block loses a binade at the bottom);
- even:  amax rounded to the element's mantissa width, then floor (clips only what would round past max);
- rceil: e = ceil(log2(amax / max_elem)): the smallest power of two under which nothing saturates (Transformer
  Engine and cuBLAS; arXiv 2506.08027 found it needed for stable MXFP8 pre-training).
A block holding a NaN gets the NaN scale; every element of it dequantises to NaN.

NVFP4: k = 16, E2M1 elements, an E4M3 block scale s = amax / 6 (RNE to E4M3, clamped to [2^-6, 448]); with an
FP32 per-tensor scale t = tensor amax / (448 * 6) (torchao's per_tensor_amax_to_scale; ours never below 2^-121, so
that a zero or tiny tensor cannot turn into NaN: see nvfp4_tensor_scale), the stored block scale is
amax / 6 / t and the elements x * ((1 / t) / s), as torchao's nvfp4_quantize computes them (a reciprocal times,
not a division: the same bits as its Triton kernel).
Transformer Engine (format.scale_rule=te; read from its CUDA source, transformer_engine/common/cast/nvfp4/) orders
the same arithmetic otherwise, in FP32: S_enc = min(2688 / tensor amax, FLT_MAX) (1 for a zero tensor), the
block scale s = E4M3(amax x (S_enc x fl(1/6))) with **no lower clamp** (subnormal E4M3 scales, and 0 for a block
under 2^-10 of S_enc's unit), the elements x x min(1 / (s x (1 / S_enc)), FLT_MAX), and dequantisation by
(s x tensor amax) x fl(1/2688). The two rules differ on ties (an exact 168 as a block scale: 160 by torchao's
order, 176 by TE's) and, much more, on blocks far below the tensor's amax, which torchao's clamp flushes.
Departures from TE, named: a NaN element stays NaN (TE's satfinite cast writes +6); the values carry the tensor's
decode factor per element, where TE's GEMM applies it once to the FP32 result (a last-bit difference there).

FP8 with finer scales than one per tensor, E4M3 elements throughout, power-of-two scales s (x * s is cast,
divided by s again for the GEMM):
- rowwise (torchao's `rowwise` recipe): one scale per row of each GEMM operand along the dimension it reduces,
  s = 2^floor(log2(448 / max(amax, 1e-12))), the division in float64 (torchao's amax_to_scale with
  round_scales_to_power_of_2);
- block (Transformer Engine's Float8BlockScaling): 1 x 128 tiles along the reduced dimension for activations and
  gradients, 128 x 128 tiles for weights (the same tiles serve W and W^T), s = 448 / amax in float32 with its
  mantissa cleared (TE's compute_scale_from_amax: amax 0 gives s = 1, an infinite s the largest float).
Neither saturates by construction (amax * s <= 448); the cast saturates anyway, as both do.

Blocks run along `dim`, which is split where it lies into (blocks, k) (no transposing copy); a dimension that is not
a multiple of k ends in a shorter block (its amax over the elements it has), as the spec's edge blocks. Everything is
returned in FP32: `values` (dequantised: what the GEMM sees), `elements` (x / X on the element grid) and the per-block
scales. Each division is written to give the CPU's bits on CUDA too, eagerly and compiled (`_divided_by`,
`_quotient`), so that a quantiser's bits need not depend on the device (tests/test_fused.py simulates CUDA's
division on the CPU).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Callable

import torch

from bench.numerics.formats import (
    FLOAT32_MAX,
    FORMATS,
    ElementFormat,
    quantise_stochastic,
    quantise_value,
    tensor_amax_of,
    uniforms,
)
from bench.numerics.fused import ARITHMETIC_FROM, fused, in_fused_graph, in_graph, in_one_pass

SCALE_MODES = ("floor", "ceil", "even", "rceil")


@dataclass(frozen=True)
class TileScaling:
    """An FP8 recipe with finer scales than one per tensor, E4M3 throughout (a scaling method's `tiles`,
    bench/numerics/scaling_methods.py): torchao's rowwise recipes (`rows`: one power-of-two scale per row along the
    dimension each GEMM reduces; `grad_weight_in_high_precision`: rowwise_with_gw_hp, whose weight enters the
    input-gradient GEMM with one scale and whose weight-gradient GEMM stays in high precision), or Transformer
    Engine's block scaling (1 x 128 tiles, 128 x 128 for weights). `tile` says what one scale covers."""

    tile: str
    rows: bool
    grad_weight_in_high_precision: bool = False
FP8_TILE = 128  # Transformer Engine's Float8BlockScaling tile
E4M3_MAX = 448.0
TORCHAO_AMAX_EPS = 1e-12  # torchao.float8.float8_utils.EPS
ROUNDINGS = ("nearest", "stochastic")
MX_ELEMENTS = ("fp8_e4m3", "fp8_e5m2", "fp6_e2m3", "fp6_e3m2", "fp4_e2m1")
MX_BLOCK = 32
NVFP4_BLOCK = 16
E8M0_BIAS = 127
E8M0_NAN = 255
NVFP4_ELEMENT_MAX = 6.0  # E2M1
NVFP4_SCALE_MAX = 448.0  # E4M3
NVFP4_SCALE_MIN = 2.0**-6  # torch.finfo(float8_e4m3fn).tiny: torchao's clamp before the E4M3 cast
# the floor of the two-level tensor scale t: (1 / t) / NVFP4_SCALE_MIN, the largest factor an element is
# multiplied by, is then 2^127, still finite
NVFP4_TENSOR_SCALE_MIN = 2.0**-121
SCALE_RULES = ("torchao", "te")  # NVFP4's scale arithmetic: torchao's (the default) or Transformer Engine's


@dataclass
class Blocked:
    """A tensor quantised to a block format (all FP32, in the input's shape except the per-block fields)."""

    values: torch.Tensor  # dequantised: elements * factor
    elements: torch.Tensor  # on the element grid
    scale: torch.Tensor  # per block, as stored: MX 2^e (NaN for the NaN scale); NVFP4 the E4M3 scale's value;
    # FP8 rowwise/tiles the multiplier s (x * s is cast), as torchao and Transformer Engine keep it
    amax: torch.Tensor  # per block: the largest magnitude it held
    factor: torch.Tensor  # per block: what dequantises an element (MX 2^e, NVFP4 E4M3 scale x tensor scale, 1 / s)
    scale_bits: torch.Tensor | None = None  # MX: the biased E8M0 byte (uint8), as hardware stores it


def _divided_by(x: torch.Tensor, constant: float) -> torch.Tensor:
    """x / constant (FP32) rounded once, as the CPU divides, on CUDA too. There torch multiplies by the reciprocal
    instead (eagerly, for a number divisor: BinaryDivTrueKernel.cu; inductor, for a constant one: `div_prim`), which
    in FP32 rounds twice and misses the quotient for about a third of x where the constant is 6; in float64 that
    product rounds to FP32 as the quotient does, for every FP32 x and each constant divided by here (checked
    exhaustively: tests/test_fused.py). Not claimed for a TPU, where torch_xla may keep float64 in FP32."""
    return (x.double() / constant).float()


def _quotient(numerator: float, x: torch.Tensor) -> torch.Tensor:
    """numerator / x (FP32) rounded once, as C++ divides (Transformer Engine's `448 / amax`): Python's
    `number / tensor` is torch's reciprocal times the number, two roundings; and a true division, where inductor's
    Triton code for CUDA takes a reciprocal approximately before pytorch/pytorch#174751 (February 2026). The
    numerator is filled on x's device (torch.tensor(number, device=...) would copy it there, which on CUDA waits for
    the device)."""
    return torch.full((), numerator, dtype=torch.float32, device=x.device) / x


def _blocks(x: torch.Tensor, dim: int, k: int) -> tuple[torch.Tensor, int, int]:
    """x (as FP32) with `dim` zero-padded to a multiple of k and split where it is into (blocks, k), so that no pass
    reads across memory (a block along dim 0 is k rows; its elements are a row apart); the original length of `dim`
    and the axis that runs within a block (dim + 1). Zeros never change a block's amax."""
    x = x.float()
    dim = dim % x.dim()
    length = x.shape[dim]
    pad = -length % k
    if pad:
        x = torch.nn.functional.pad(x, (0, 0) * (x.dim() - 1 - dim) + (0, pad))
    return x.unflatten(dim, (-1, k)), length, dim + 1


AMAX_ROWS = 16  # a fused graph reduces a block of more rows 16 rows at a time first (`_block_amax`)


def _block_amax(blocks: torch.Tensor, within: int) -> torch.Tensor:
    """Each block's amax (kept as a singleton at `within`; NaN where the block holds one). In a fused graph, a block
    across rows (along dim 0, or any dimension but the last: its elements a row apart) of a multiple of AMAX_ROWS rows
    past it is reduced AMAX_ROWS rows at a time, then over those: the same maximum. Inductor's CPU code reduces a
    block's rows innermost, reading one stream of memory a row, and 128 streams at once ran at half the speed of one
    (docs/performance.md). A square tile's are `_tile_amax`'s."""
    rows = blocks.shape[within]
    magnitudes = blocks.abs()
    if not (in_fused_graph() and within < blocks.dim() - 1 and rows > AMAX_ROWS and rows % AMAX_ROWS == 0):
        return magnitudes.amax(within, keepdim=True)
    return magnitudes.unflatten(within, (-1, AMAX_ROWS)).amax(within + 1).amax(within, keepdim=True)


TILE_ROWS_FIRST_FROM = 128  # a fused graph reduces a square tile this wide or wider a row at a time first


def _tile_amax(squares: torch.Tensor) -> torch.Tensor:
    """Each square tile's amax over dims (1, 3) of `_square_tiles`' layout, kept as singletons (NaN where the tile
    holds one). In a fused graph a tile TILE_ROWS_FIRST_FROM values wide or wider takes each row's part first, then
    the maximum over its rows: the same maximum. Reduced at once, inductor's CPU code read a 128 x 128 tile's rows as
    128 streams of memory, 1.07-1.25x slower on 4096 x 4096 past the caches; NVFP4's 16 x 16 tiles ran 1.2x slower
    a row at a time, and are reduced at once (docs/performance.md)."""
    magnitudes = squares.abs()
    if not (in_fused_graph() and squares.shape[3] >= TILE_ROWS_FIRST_FROM):
        return magnitudes.amax((1, 3), keepdim=True)
    return magnitudes.amax(3, keepdim=True).amax(1, keepdim=True)


def _unblock(blocks: torch.Tensor, length: int, within: int) -> torch.Tensor:
    return blocks.flatten(within - 1, within).narrow(within - 1, 0, length)


def _blocked(values: torch.Tensor, elements: torch.Tensor, length: int, within: int, scale: torch.Tensor,
             amax: torch.Tensor, factor: torch.Tensor, scale_bits: torch.Tensor | None = None) -> Blocked:
    """A Blocked from `_blocks`' layout: values and elements back in the input's shape, the per-block tensors
    (one singleton per block, at `within`) with their block index where the blocked dimension was."""
    per_block = lambda t: t.squeeze(within)
    return Blocked(_unblock(values, length, within), _unblock(elements, length, within), per_block(scale),
                   per_block(amax), per_block(factor), None if scale_bits is None else per_block(scale_bits))


def _draws_over(blocked_shape: Callable[[torch.Tensor, dict], torch.Size]
                ) -> Callable[[torch.Tensor, dict], torch.Tensor]:
    """A block quantiser's `fused(draws=...)`: the draws its stochastic rounding makes from its generator, one per
    element of its blocks as its eager body lays them out (`blocked_shape(x, arguments)`, padding included), in their
    order: FP32 uniforms, or `sr_bits` random bits where the quantiser takes them."""
    return lambda x, arguments: uniforms(blocked_shape(x, arguments), x.device, arguments["generator"],
                                         arguments.get("sr_bits"))


def _blocks_shape(x: torch.Tensor, dim: int, k: int) -> torch.Size:
    """The shape `_blocks` gives x (worked out on the meta device: nothing is read or written)."""
    return _blocks(torch.empty(x.shape, device="meta"), dim, k)[0].shape


_mx_draws = _draws_over(lambda x, arguments: _blocks_shape(x, arguments["dim"], arguments["block"]))
_nvfp4_draws = _draws_over(lambda x, arguments: _blocks_shape(x, arguments["dim"], NVFP4_BLOCK))
_row_draws = _draws_over(lambda x, arguments: _blocks_shape(x, arguments["dim"], x.shape[arguments["dim"]]))
_tile_draws = _draws_over(lambda x, arguments: _blocks_shape(x, arguments["dim"], arguments["tile"]))


def _round_elements(x: torch.Tensor, element: str, rounding: str, generator: torch.Generator | None,
                    sr_bits: int | None = None, draw: torch.Tensor | None = None) -> torch.Tensor:
    """Scaled values onto the element grid, saturating (a caller need not clamp them first): RNE, or stochastic from
    an FP32 uniform or `sr_bits` random bits (bench.numerics.formats.quantise_stochastic; `draw`: those drawn
    already, one per element of x)."""
    if rounding == "nearest":
        return quantise_value(x, element, overflow="saturate")
    if rounding == "stochastic":
        return quantise_stochastic(x, element, generator, bits=sr_bits, draw=draw)
    raise ValueError(f"unknown rounding {rounding!r}; valid: {', '.join(ROUNDINGS)}")


def mx_scale_exponent(amax: torch.Tensor, spec: ElementFormat, mode: str) -> torch.Tensor:
    """The biased E8M0 scale byte (int32 in [0, 255]) for each block amax (float32), by `mode` (SCALE_MODES)."""
    if mode not in SCALE_MODES:
        raise ValueError(f"unknown MX scale mode {mode!r}; valid: {', '.join(SCALE_MODES)}")
    if mode == "rceil":
        descale = _divided_by(amax, spec.max)
        # ceil(log2 descale), exact, from its bits: its binade's exponent, one more where a mantissa bit is set; a
        # subnormal descale (under 2^-126) gives -126 above 2^-127 and -127 at or below it, once clamped
        bits = descale.view(torch.int32)
        exponent = (bits >> 23) & 0xFF
        unbiased = torch.where(exponent == 0, torch.where(descale > 2.0**-127, -126, -127).int(),
                               exponent - E8M0_BIAS + ((bits & 0x7FFFFF) > 0).int())
        biased = torch.where(descale == 0, 0, unbiased.clamp(-E8M0_BIAS, E8M0_BIAS) + E8M0_BIAS)
        return torch.where(descale.isnan(), E8M0_NAN, torch.where(descale.isinf(), 254, biased))
    bits = amax.view(torch.int32)
    if mode == "even":  # round amax's mantissa to the element's width (a carry moves it up a binade)
        bits = (bits + (1 << (23 - spec.man_bits - 1))) & 0x7F800000
    unbiased = ((bits >> 23) & 0xFF) - E8M0_BIAS
    if mode == "ceil":
        unbiased = unbiased + ((bits & 0x7FFFFF) > 0).int()
    biased = (unbiased - spec.emax).clamp(-E8M0_BIAS, E8M0_BIAS + 1) + E8M0_BIAS
    return torch.where(amax.isnan(), E8M0_NAN, biased)


def _e8m0_value(biased: torch.Tensor) -> torch.Tensor:
    """2^(biased - 127) for int32 biased in [0, 254], built from its bits (2^-127, biased 0, is FP32's subnormal
    0x00400000): exact, as torch.ldexp is, and a few integer operations where inductor's CPU code calls the C
    library's ldexp once per element."""
    return torch.where(biased > 0, biased.int() << 23, 1 << 22).view(torch.float32)


def _mx_chunk_rows(x: torch.Tensor, element: str, mode: str = "floor", dim: int = -1, block: int = MX_BLOCK, *_,
                   **__) -> int | None:
    """MX's values quantised in chunks of whole blocks past the caches (`fused`'s chunk_rows), along either end
    dimension: faster than x whole along dim 0 (three loops) and along the last (one loop over blocks there:
    fused.in_one_pass), at every shape measured; NVFP4's and the 1 x 128 tiles' were not (docs/performance.md)."""
    along = dim % x.dim()
    return block if along == 0 else 1 if along == x.dim() - 1 else None


@fused(ARITHMETIC_FROM, values_alone=True, draws=_mx_draws, chunk_rows=_mx_chunk_rows)
def mx_quantise(x: torch.Tensor, element: str, mode: str = "floor", dim: int = -1, block: int = MX_BLOCK,
                rounding: str = "nearest", generator: torch.Generator | None = None,
                draw: torch.Tensor | None = None) -> Blocked:
    """x in an MX format: blocks of `block` along `dim`, E8M0 scales by `mode`, elements saturated and rounded by
    `rounding` (nearest even, or stochastic from `generator`: the scale is the same either way; `draw`: the
    stochastic draws, made already by `_mx_draws`)."""
    if element not in MX_ELEMENTS:
        raise ValueError(f"unknown MX element format {element!r}; valid: {', '.join(MX_ELEMENTS)}")
    spec = FORMATS[element]
    blocks, length, within = _blocks(x, dim, block)
    amax = _block_amax(blocks, within)  # NaN where the block holds one
    biased = mx_scale_exponent(in_one_pass(amax, x), spec, mode)
    nan = biased == E8M0_NAN
    scale = torch.where(nan, torch.nan, _e8m0_value(biased))  # 2^e, exact down to 2^-127
    # x * 2^-e is x / 2^e exactly (a power of two), and a multiply is cheaper than a divide
    elements = _round_elements(blocks * torch.where(nan, torch.nan, _e8m0_value(2 * E8M0_BIAS - biased)), element,
                               rounding, generator, draw=draw)
    values = elements * scale
    return _blocked(values, elements, length, within, scale, amax, scale, biased.to(torch.uint8))


def nvfp4_tensor_scale(x: torch.Tensor) -> torch.Tensor:
    """The FP32 per-tensor scale of two-level NVFP4: amax / (448 * 6), so block scales can use E4M3's whole range,
    floored at NVFP4_TENSOR_SCALE_MIN. torchao's per_tensor_amax_to_scale has no floor: an all-zero tensor (a
    zero-initialised layer, a dead gradient) gets t = 0 and quantises to NaN, and in a tensor whose amax is under
    about 1e-33 a block with the smallest block scale gets an infinite factor (its zeros become NaN, every other
    element saturates to 6). With the floor a zero tensor quantises to exact zeros and a tiny one to finite values
    on its grid; the result equals torchao's wherever the amax is 2688 * 2^-121 (about 1.05e-33) or more. An
    infinite or NaN amax still gives a non-finite t, so an overflow stays visible."""
    return _divided_by(tensor_amax_of(x).float(), NVFP4_SCALE_MAX * NVFP4_ELEMENT_MAX).clamp(min=NVFP4_TENSOR_SCALE_MIN)


@fused(ARITHMETIC_FROM, values_alone=True, draws=_nvfp4_draws)
def nvfp4_quantise(x: torch.Tensor, tensor_scale: torch.Tensor | None = None, dim: int = -1,
                   rounding: str = "nearest", generator: torch.Generator | None = None,
                   sr_bits: int | None = None, draw: torch.Tensor | None = None) -> Blocked:
    """x in NVFP4 by torchao's rule: blocks of 16 along `dim`, E4M3 block scales (under `tensor_scale` when given),
    E2M1 elements rounded by `rounding` (NVIDIA's NVFP4 training recipe rounds gradients stochastically, from
    `sr_bits` random bits where given; `draw`: those `_nvfp4_draws` drew already)."""
    blocks, length, within = _blocks(x, dim, NVFP4_BLOCK)
    amax = _block_amax(blocks, within)
    elements, stored, scale = _nvfp4_scaled(blocks, amax, tensor_scale, rounding, generator, sr_bits, draw)
    return _blocked(elements * scale, elements, length, within, stored, amax, scale)


def _nvfp4_scaled(blocks: torch.Tensor, amax: torch.Tensor, tensor_scale: torch.Tensor | None, rounding: str,
                  generator: torch.Generator | None, sr_bits: int | None = None, draw: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """NVFP4's step for blocks (1 x 16, or 16 x 16 tiles) with their `amax`: the stored E4M3 scale
    E4M3(clamp(amax / 6 [/ t], 2^-6, 448)), the elements x * ((1 / t) / s) rounded to E2M1, and the factor s [* t]
    that dequantises them."""
    block_scale = _divided_by(amax, NVFP4_ELEMENT_MAX)
    if tensor_scale is None:
        stored = quantise_value(block_scale.clamp(NVFP4_SCALE_MIN, NVFP4_SCALE_MAX), "fp8_e4m3")
        scaled = blocks * _quotient(1.0, stored)
        scale = stored
    else:
        tensor_scale = tensor_scale.float()
        stored = quantise_value((block_scale / tensor_scale).clamp(NVFP4_SCALE_MIN, NVFP4_SCALE_MAX), "fp8_e4m3")
        scaled = blocks * (_quotient(1.0, tensor_scale) / stored)
        scale = stored * tensor_scale
    elements = _round_elements(scaled, "fp4_e2m1", rounding, generator, sr_bits, draw)
    return elements, stored, scale


def te_nvfp4_encode_scale(tensor_amax: torch.Tensor) -> torch.Tensor:
    """Transformer Engine's FP32 tensor encode scale S_enc = min(2688 / amax, FLT_MAX): 1 where amax is 0 or
    infinite (the quotient 0), FLT_MAX where it is NaN (CUDA's fminf drops a NaN)."""
    amax = tensor_amax.detach().float()
    encode = _quotient(NVFP4_SCALE_MAX * NVFP4_ELEMENT_MAX, amax).clamp(max=FLOAT32_MAX)
    return torch.where((amax == 0) | (encode == 0), 1.0, torch.where(amax.isnan(), FLOAT32_MAX, encode))


def _te_nvfp4_scaled(blocks: torch.Tensor, amax: torch.Tensor, tensor_amax: torch.Tensor, rounding: str,
                     generator: torch.Generator | None, sr_bits: int | None, draw: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """NVFP4's step by Transformer Engine's arithmetic (the module docstring), for blocks with their `amax`: the
    stored E4M3 scale, the elements on the E2M1 grid, and the factor (s x amax_t) x fl(1 / 2688) that dequantises
    them as TE's dequantiser does."""
    encode = te_nvfp4_encode_scale(tensor_amax)
    decode = _quotient(1.0, encode)
    per_amax = encode * torch.tensor(1 / NVFP4_ELEMENT_MAX, dtype=torch.float32)  # fl(S_enc x fl(1/6)) first
    stored = quantise_value((amax * per_amax).clamp(max=FLOAT32_MAX), "fp8_e4m3", overflow="saturate")
    inverse = _quotient(1.0, stored * decode).clamp(max=FLOAT32_MAX)  # a zero block's 1/0 = inf held at FLT_MAX
    elements = _round_elements(blocks * inverse, "fp4_e2m1", rounding, generator, sr_bits, draw)
    per_2688 = torch.tensor(1 / (NVFP4_SCALE_MAX * NVFP4_ELEMENT_MAX), dtype=torch.float32)
    return elements, stored, stored * tensor_amax.detach().float() * per_2688  # TE's order: (s x amax) x fl(1/2688)


@fused(ARITHMETIC_FROM, values_alone=True, draws=_nvfp4_draws)
def te_nvfp4_quantise(x: torch.Tensor, tensor_amax: torch.Tensor | None = None, dim: int = -1,
                      rounding: str = "nearest", generator: torch.Generator | None = None, sr_bits: int | None = None,
                      draw: torch.Tensor | None = None) -> Blocked:
    """x in NVFP4 by Transformer Engine's rule (format.scale_rule=te): blocks of 16 along `dim` under the FP32
    encode scale of `tensor_amax` (None: x's own, taken in the same call, and so inside its fused graph, which then
    reads x once more rather than three times), E2M1 elements rounded by `rounding` (`draw`: the stochastic draws,
    as `nvfp4_quantise`'s)."""
    tensor_amax = tensor_amax_of(x) if tensor_amax is None else tensor_amax
    blocks, length, within = _blocks(x, dim, NVFP4_BLOCK)
    amax = _block_amax(blocks, within)
    elements, stored, scale = _te_nvfp4_scaled(blocks, amax, tensor_amax, rounding, generator, sr_bits, draw)
    return _blocked(elements * scale, elements, length, within, stored, amax, scale)


def torchao_pow2_scale(amax: torch.Tensor) -> torch.Tensor:
    """torchao's power-of-two FP8 scale: 448 / max(amax, 1e-12) in float64, to float32, rounded down to 2^k."""
    scale = (E4M3_MAX / amax.double().clamp(min=TORCHAO_AMAX_EPS)).float()
    return torch.exp2(torch.floor(torch.log2(scale)))


def te_pow2_scale(amax: torch.Tensor) -> torch.Tensor:
    """Transformer Engine's power-of-two FP8 scale (compute_scale_from_amax, epsilon 0): 448 / amax in float32
    with the mantissa bits cleared; 1 where amax is 0 or infinite, the largest float where the quotient is.
    The quotient is a normal float (at least 448 / FP32's max), so clearing its mantissa is 2^(e - 1) for frexp's
    exponent e: the same bits, found without a bit view, which inductor's CPU code would bit-cast value by value
    where the scale meets the elements (1 x 128 tiles along dim 0 ran 3-4x slower: docs/performance.md)."""
    amax = amax.float()
    scale = _quotient(E4M3_MAX, amax)
    scale = torch.where(scale.isinf(), FLOAT32_MAX, scale)
    scale = torch.where((amax == 0) | amax.isinf() | scale.isnan(), 1.0, scale)
    return torch.ldexp(torch.full_like(scale, 0.5), torch.frexp(scale).exponent)


def _fp8_scaled(blocks: torch.Tensor, scale: torch.Tensor, rounding: str = "nearest",
                generator: torch.Generator | None = None, draw: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    elements = _round_elements(blocks * scale, "fp8_e4m3", rounding, generator, draw=draw)
    return elements, elements / scale


def _fp8_runs(x: torch.Tensor, dim: int, run: int, scale_rule, rounding: str, generator, draw) -> Blocked:
    blocks, length, within = _blocks(x, dim, run)
    amax = _block_amax(blocks, within)
    scale = scale_rule(in_one_pass(amax, x))
    elements, values = _fp8_scaled(blocks, scale, rounding, generator, draw)
    return _blocked(values, elements, length, within, scale, amax, _quotient(1.0, scale))


@fused(ARITHMETIC_FROM, values_alone=True, draws=_row_draws)
def rowwise_quantise(x: torch.Tensor, dim: int = -1, rounding: str = "nearest",
                     generator: torch.Generator | None = None, draw: torch.Tensor | None = None) -> Blocked:
    """x in E4M3 with one torchao power-of-two scale per row along `dim` (`scale` holds s: x ~ elements / s),
    the elements rounded by `rounding` (stochastic: an option of this suite; torchao rounds to nearest; `draw`: the
    stochastic draws, made already by `_row_draws`)."""
    return _fp8_runs(x, dim, x.shape[dim], torchao_pow2_scale, rounding, generator, draw)


@fused(ARITHMETIC_FROM, values_alone=True, draws=_tile_draws)
def tile_quantise(x: torch.Tensor, dim: int = -1, tile: int = FP8_TILE, rounding: str = "nearest",
                  generator: torch.Generator | None = None, draw: torch.Tensor | None = None) -> Blocked:
    """x in E4M3 with one Transformer Engine power-of-two scale per 1 x `tile` run along `dim` (rounded as
    `rowwise_quantise`'s; `draw`: made already by `_tile_draws`). A `dim` shorter than a tile (BERT-tiny's 64 features)
    is one run of its own length: the zero-padded tile's amax, scale and elements without rounding its zeros; under
    stochastic rounding the padded tile's draws are still taken, and its zeros' left unused, so that the generator's
    stream is the same."""
    length = x.shape[dim]
    if length >= tile:
        return _fp8_runs(x, dim, tile, te_pow2_scale, rounding, generator, draw)
    if rounding == "stochastic":
        if draw is None:
            draw = _tile_draws(x, {"dim": dim, "tile": tile, "generator": generator})
        draw = draw.narrow(dim % x.dim() + 1, 0, length)
    return _fp8_runs(x, dim, length, te_pow2_scale, rounding, generator, draw)


def _square_tiles(w: torch.Tensor, tile: int, shorter_unpadded: bool = False) -> torch.Tensor:
    """A 2-D `w` (as FP32) zero-padded to whole `tile` x `tile` squares, viewed as (row tiles, tile rows, column
    tiles, tile columns): a tile's amax is over dims (1, 3). Zeros never change an amax, so with `shorter_unpadded` a
    side of w shorter than a tile is one tile of its own length (BERT-tiny's 64 x 64 weights in 128 x 128 tiles: a
    quarter of the work); NVFP4's 16 x 16 tiles stay padded, their stochastic draws laid out on the padded tiles."""
    rows, cols = w.shape
    tall, wide = (min(tile, rows), min(tile, cols)) if shorter_unpadded else (tile, tile)
    padded = torch.nn.functional.pad(w.float(), (0, -cols % wide, 0, -rows % tall))
    return padded.reshape(padded.shape[0] // tall, tall, padded.shape[1] // wide, wide)


def _tiled(w: torch.Tensor, values: torch.Tensor, elements: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor,
           factor: torch.Tensor) -> Blocked:
    """A Blocked from `_square_tiles`' layout: values and elements back in w's shape, the per-tile tensors
    (ceil(rows / tile), ceil(cols / tile))."""
    whole = lambda t: t.reshape(t.shape[0] * t.shape[1], -1)[:w.shape[0], :w.shape[1]]
    per_tile = lambda t: t.squeeze(3).squeeze(1)
    return Blocked(whole(values), whole(elements), per_tile(scale), per_tile(amax), per_tile(factor))


@fused(ARITHMETIC_FROM, values_alone=True)
def tile2d_quantise(w: torch.Tensor, tile: int = FP8_TILE) -> Blocked:
    """A 2-D weight in E4M3 with one Transformer Engine power-of-two scale per `tile` x `tile` square (edge tiles
    shorter); `scale` is (ceil(rows / tile), ceil(cols / tile))."""
    squares = _square_tiles(w, tile, shorter_unpadded=True)
    amax = _tile_amax(squares)
    scale = te_pow2_scale(amax)
    elements, values = _fp8_scaled(squares, scale)
    return _tiled(w, values, elements, scale, amax, _quotient(1.0, scale))


# NVIDIA's NVFP4 training recipe (arXiv 2509.25149; Transformer Engine's NVFP4BlockScaling): its weights in 16 x 16
# tiles, and a 16-point random Hadamard transform (RHT) on both operands of the weight-gradient GEMM.
NVFP4_TILE = 16
RHT_SIZE = 16
# Transformer Engine's random signs (tensor/nvfp4_tensor.py, get_wgrad_sign_vector): one vector, fixed, shared by
# every layer for the whole of training. format.rht_seed=null takes it; an integer draws another.
TE_RHT_SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)


def hadamard(n: int = RHT_SIZE) -> torch.Tensor:
    """Sylvester's n x n Hadamard matrix over sqrt(n) (n a power of two): orthonormal and symmetric."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"a Sylvester Hadamard matrix needs a power of two, not {n}")
    matrix = torch.ones(1, 1, dtype=torch.float64)
    while matrix.shape[0] < n:
        matrix = torch.cat([torch.cat([matrix, matrix], 1), torch.cat([matrix, -matrix], 1)])
    return matrix / n**0.5


def rht_signs(seed: int | None) -> torch.Tensor:
    """The transform's random +-1 diagonal: Transformer Engine's fixed vector (seed None), or one drawn from `seed`."""
    if seed is None:
        return torch.tensor(TE_RHT_SIGNS, dtype=torch.float64)
    draw = torch.randint(0, 2, (RHT_SIZE,), generator=torch.Generator().manual_seed(int(seed)))
    return (1 - 2 * draw).double()


def rht_matrix(seed: int | None = None) -> torch.Tensor:
    """diag(s) H / 4, the 16 x 16 random Hadamard transform as Transformer Engine builds it (float64): a row of 16
    values x becomes x diag(s) H / 4 (random_hadamard_transform computes it from the signs s). Orthogonal, so
    applied to both operands of a product along the dimension the product reduces it cancels: (x R)(y R)^T = x y^T."""
    return torch.diag(rht_signs(seed)) @ hadamard(RHT_SIZE)


@fused(ARITHMETIC_FROM)
def random_hadamard_transform(x: torch.Tensor, signs: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """x's groups of 16 along `dim` each times rht_matrix's diag(signs) H / 4, zero-padded there to a multiple of 16
    (zeros add nothing to a product along `dim`). In FP32, in one order on every machine: each value times +-1/4
    (exact but for FP32 subnormals), then the in-place fast Walsh-Hadamard transform's sums and differences of rows
    1, 2, 4, then 8 apart, each rounded. (A GEMM's FP32 sums round in the order its BLAS kernel takes, which is not
    the same on every CPU.) Transformer Engine sums on a tensor core in FP32: for BF16 inputs whose 16 values span
    less than 2^12, every partial sum is exact, there and here."""
    moved = x.float().movedim(dim, 0)
    length = moved.shape[0]
    flat = moved.reshape(length, -1)
    if length % RHT_SIZE:  # (a pad that adds nothing still copies: a third of the transform's time on BERT-tiny)
        flat = torch.nn.functional.pad(flat, (0, 0, 0, -length % RHT_SIZE))
    groups = flat.reshape(-1, RHT_SIZE, flat.shape[1])
    if signs.dim() == 2:  # the matrix itself, as before 0.3.0 (CHANGELOG): a GEMM, as then, for one release
        warnings.warn("random_hadamard_transform takes the 16 signs now (rht_signs), not the matrix (rht_matrix), "
                      "which it multiplies as an FP32 GEMM, whose bits differ between CPUs, until 0.4.0",
                      DeprecationWarning, stacklevel=2)
        grouped = signs.to(device=x.device, dtype=torch.float32).t() @ groups
        return grouped.reshape(-1, *moved.shape[1:]).movedim(0, dim)
    factors = signs.to(device=x.device, dtype=torch.float32) / 4
    if not in_graph():  # eagerly, each round as 3 ops on one tensor of rows (13 in all; a GPU launches each)
        rows = groups * factors.reshape(1, RHT_SIZE, 1)
        width = 1
        while width < RHT_SIZE:
            pairs = rows.reshape(rows.shape[0], RHT_SIZE // (2 * width), 2, width, -1)
            rows = torch.stack((pairs[:, :, 0] + pairs[:, :, 1], pairs[:, :, 0] - pairs[:, :, 1]), 2)
            width *= 2
        return rows.reshape(-1, *moved.shape[1:]).movedim(0, dim)
    # in a graph, the same sums on one tensor per row (81 ops eagerly): inductor's code then reads each group once
    # and keeps the rounds in registers (about 3x faster on a 1536 x 128 gradient than the rounds above, fused)
    rows = [groups[:, row] * factors[row] for row in range(RHT_SIZE)]
    width = 1
    while width < RHT_SIZE:  # the in-place fast Walsh-Hadamard transform: rows `width` apart, 1, 2, 4 then 8
        for start in range(0, RHT_SIZE, 2 * width):
            for row in range(start, start + width):
                rows[row], rows[row + width] = rows[row] + rows[row + width], rows[row] - rows[row + width]
        width *= 2
    return torch.stack(rows, 1).reshape(-1, *moved.shape[1:]).movedim(0, dim)


_square_tile_draws = _draws_over(lambda w, arguments: _square_tiles(torch.empty(w.shape, device="meta"),
                                                                    NVFP4_TILE).shape)


@fused(ARITHMETIC_FROM, values_alone=True, draws=_square_tile_draws)
def nvfp4_tile_quantise(w: torch.Tensor, tensor_scale: torch.Tensor, rounding: str = "nearest",
                        generator: torch.Generator | None = None, draw: torch.Tensor | None = None) -> Blocked:
    """A 2-D weight in NVFP4 with one E4M3 scale per 16 x 16 tile (NVIDIA's recipe: the forward GEMM, which reduces
    along the columns, and the input-gradient GEMM, along the rows, then read the same quantised weight). Each tile as
    nvfp4_quantise makes a block: E4M3(clamp(tile amax / 6 / t, 2^-6, 448)) under the FP32 tensor scale t, elements
    x * ((1 / t) / s) rounded to E2M1 (`draw`: the stochastic draws, made already by `_square_tile_draws`). Edge
    tiles are shorter (their amax over the elements they have); `scale` and `amax` are (ceil(rows / 16),
    ceil(cols / 16))."""
    squares = _square_tiles(w, NVFP4_TILE)
    amax = _tile_amax(squares)
    elements, stored, scale = _nvfp4_scaled(squares, amax, tensor_scale, rounding, generator, draw=draw)
    return _tiled(w, elements * scale, elements, stored, amax, scale)


@fused(ARITHMETIC_FROM, values_alone=True)
def te_nvfp4_tile_quantise(w: torch.Tensor, tensor_amax: torch.Tensor | None = None) -> Blocked:
    """A 2-D weight in 16 x 16 NVFP4 tiles by Transformer Engine's rule (format.scale_rule=te): one E4M3 scale per
    tile from the tile's amax, under the encode scale of `tensor_amax` (None: w's own, as `te_nvfp4_quantise`),
    elements rounded to nearest (TE rounds weights to nearest: stochastic rounding is for gradients)."""
    tensor_amax = tensor_amax_of(w) if tensor_amax is None else tensor_amax
    squares = _square_tiles(w, NVFP4_TILE)
    amax = _tile_amax(squares)
    elements, stored, scale = _te_nvfp4_scaled(squares, amax, tensor_amax, "nearest", None, None)
    return _tiled(w, elements * scale, elements, stored, amax, scale)
