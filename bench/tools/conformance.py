"""Conformance of the block formats (bench/numerics/blocks.py) with the references users trust, as a generated table.

    python -m bench.tools.conformance [--out results/conformance]

For every MX element format and scale mode, against torchao's `to_mx` + `to_dtype`; NVFP4 (one- and two-level)
against torchao's `nvfp4_quantize`; rowwise FP8 (scaling=rowwise) against torchao's axiswise power-of-two cast,
along both dimensions; the element casts against ml_dtypes; and where the references themselves
disagree (OCP's floor against Transformer Engine's rceil, ml_dtypes' rounding E8M0 cast against MX's floor), how
often, on the same inputs. Inputs: 2^20 random values (blocks of unit normals times 2^U[-30, 30)) plus adversarial
blocks (`adversarial_blocks`). A mismatch is a differing scale byte or a dequantised value that differs bit for
bit (NaN equals NaN); differences that come from a reference departing from the spec are counted apart, named.
"""

from __future__ import annotations

import argparse
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from bench.numerics.blocks import (
    MX_ELEMENTS,
    SCALE_MODES,
    mx_quantise,
    nvfp4_quantise,
    nvfp4_tensor_scale,
    rowwise_quantise,
    te_pow2_scale,
    torchao_pow2_scale,
)
from bench.numerics.formats import FORMATS, quantise_value

RANDOM_VALUES = 2**20
E4M3_NEAR = 448.0
TIE_NOTE = ("torchao's to_mx divides a block whose E8M0 scale is 2^-127 (byte 0) by 2^-126 (floor, ceil, even: it "
            "clamps the FP32 scale to the smallest normal) or by 1 (rceil), then to_dtype multiplies by 2^-127; "
            "ours divides by 2^-127, the spec's x / X")


def random_blocks(count: int = RANDOM_VALUES, width: int = 32, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    rows = count // width
    return torch.randn(rows, width, generator=generator) \
        * torch.exp2(torch.randint(-30, 30, (rows, 1), generator=generator).float())


def adversarial_blocks(element: str, width: int = 32) -> torch.Tensor:
    """One block per row: all zero; one NaN; one +inf; one -inf; amax exactly a power of two and exactly
    max_elem * 2^k; amax just below the next power of two (floor clips it); every rounding tie of the element grid
    (midpoints between neighbours, under a fixed scale); subnormal elements beside a large one; a block so small
    that its scale is E8M0's smallest, 2^-127; a block past FP32's range after scaling."""
    spec = FORMATS[element]
    rows = []
    base = torch.linspace(-1, 1, width)
    rows.append(torch.zeros(width))
    for special in (float("nan"), float("inf"), float("-inf")):
        row = base.clone()
        row[width // 3] = special
        rows.append(row)
    for k in (-20, 0, 7):
        rows.append(base * 2.0**k)  # amax exactly 2^k
        rows.append(base / base.abs().max() * spec.max * 2.0**k)  # amax exactly max_elem * 2^k
        rows.append(base * (2.0 - 2.0**-20) * 2.0**k)  # just under 2^(k+1): floor's scale clips it
    # the element grid's positive points (one binade per exponent, subnormals included) and the midpoints between
    grid = torch.tensor(sorted({m * 2.0**e for e in range(spec.emin, spec.emax + 1)
                                for m in np.arange(0, 2, 2.0**-spec.man_bits) if m * 2.0**e <= spec.max}
                               | {m * 2.0**spec.emin for m in np.arange(0, 1, 2.0**-spec.man_bits)}))
    ties = (grid[1:] + grid[:-1]) / 2
    scale_one = torch.cat([ties, -ties])  # under floor with amax in max's binade, the block scale is 1
    for start in range(0, len(scale_one), width - 1):
        row = torch.zeros(width)
        chunk = scale_one[start:start + width - 1]
        row[:len(chunk)] = chunk
        row[-1] = spec.max  # pins the block scale at 2^0
        rows.append(row)
    row = torch.full((width,), spec.min_subnormal * 0.75)
    row[0] = spec.max
    rows.append(row)  # subnormal elements (and ones that flush) beside the block's amax
    rows.append(base * 2.0**-125)  # scale 2^-127: the documented torchao departure
    rows.append(base * 3.0e38)
    return torch.stack(rows).float()


def _same(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a == b) | (a.isnan() & b.isnan())


def _torchao():
    warnings.filterwarnings("ignore")
    from torchao.prototype.mx_formats import constants
    from torchao.prototype.mx_formats.mx_tensor import ScaleCalculationMode, to_dtype, to_mx

    dtypes = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2, "fp6_e2m3": constants.DTYPE_FP6_E2M3,
              "fp6_e3m2": constants.DTYPE_FP6_E3M2, "fp4_e2m1": torch.float4_e2m1fn_x2}
    modes = {"floor": ScaleCalculationMode.FLOOR, "ceil": ScaleCalculationMode.CEIL,
             "even": ScaleCalculationMode.EVEN, "rceil": ScaleCalculationMode.RCEIL}
    return to_mx, to_dtype, dtypes, modes


def compare_mx_with_torchao(x: torch.Tensor, element: str, mode: str) -> dict:
    """x: (rows, 32 * n), contiguous. Counts of scale bytes and dequantised values that differ, the value
    differences inside blocks whose scale is 2^-127 counted apart (TIE_NOTE)."""
    to_mx, to_dtype, dtypes, modes = _torchao()
    scale, data = to_mx(x.contiguous(), dtypes[element], 32, modes[mode])
    reference = to_dtype(data, scale, dtypes[element], 32, torch.float32)
    ours = mx_quantise(x, element, mode)
    differs = ~_same(reference, ours.values)
    smallest_scale = (ours.scale_bits == 0).repeat_interleave(32, dim=-1)
    return {"values": x.numel(), "scale_mismatches": int((scale.view(torch.uint8) != ours.scale_bits).sum()),
            "value_mismatches": int((differs & ~smallest_scale).sum()),
            "documented": int((differs & smallest_scale).sum())}


def compare_nvfp4_with_torchao(x: torch.Tensor, two_level: bool) -> dict:
    """Scales (E4M3), elements and dequantised values against torchao's nvfp4_quantize. E2M1 has no NaN: torchao
    writes a code for a NaN element (its block's scale is NaN, so it dequantises to NaN either way); those element
    differences are counted apart."""
    warnings.filterwarnings("ignore")
    from torchao.prototype.mx_formats.kernels import f4_unpacked_to_f32, unpack_uint4
    from torchao.prototype.mx_formats.nvfp4_tensor import nvfp4_quantize, per_tensor_amax_to_scale

    finite = x[x.isfinite()]
    tensor_scale = per_tensor_amax_to_scale(finite.abs().amax()) if two_level else None
    if two_level:
        assert torch.equal(tensor_scale, nvfp4_tensor_scale(finite))
    scale, data = nvfp4_quantize(x.contiguous(), 16, tensor_scale)
    elements = f4_unpacked_to_f32(unpack_uint4(data)).reshape(x.shape)
    block_scale = scale.float() if tensor_scale is None else tensor_scale * scale.float()
    reference = (elements.reshape(*x.shape[:-1], -1, 16) * block_scale.unsqueeze(-1)).reshape(x.shape)
    ours = nvfp4_quantise(x, tensor_scale)
    nan_block = x.reshape(*x.shape[:-1], -1, 16).isnan().any(-1, keepdim=True).expand(-1, -1, 16).reshape(x.shape)
    element_differs = ~_same(elements, ours.elements)
    return {"values": x.numel(), "scale_mismatches": int((~_same(scale.float(), ours.scale)).sum()),
            "value_mismatches": int((~_same(reference, ours.values)).sum()
                                    + (element_differs & ~nan_block).sum()),
            "documented": int((element_differs & nan_block).sum())}


def compare_rowwise_with_torchao(x: torch.Tensor, dim: int) -> dict:
    """Scales and dequantised values of rowwise E4M3 against torchao's hp_tensor_to_float8_dynamic (AXISWISE,
    round_scales_to_power_of_2, the rowwise recipe's cast) along `dim`."""
    warnings.filterwarnings("ignore")
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import GemmInputRole, LinearMMConfig

    theirs = hp_tensor_to_float8_dynamic(x, torch.float8_e4m3fn, LinearMMConfig(), GemmInputRole.INPUT,
                                         scaling_granularity=ScalingGranularity.AXISWISE, axiswise_dim=dim,
                                         round_scales_to_power_of_2=True)
    ours = rowwise_quantise(x, dim)
    return {"values": x.numel(), "scale_mismatches": int((~_same(theirs._scale, ours.scale)).sum()),
            "value_mismatches": int((~_same(theirs.to_original_precision(), ours.values)).sum()), "documented": 0}


ML_DTYPES = {"fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2", "fp6_e2m3": "float6_e2m3fn",
             "fp6_e3m2": "float6_e3m2fn", "fp4_e2m1": "float4_e2m1fn"}


def compare_elements_with_ml_dtypes(element: str, x: torch.Tensor) -> dict:
    """RNE of in-range values (|x| <= max, where no overflow policy applies) against ml_dtypes' cast."""
    import ml_dtypes

    spec = FORMATS[element]
    x = x[x.isfinite() & (x.abs() <= spec.max)]
    theirs = torch.from_numpy(x.numpy().astype(getattr(ml_dtypes, ML_DTYPES[element])).astype(np.float32))
    return {"values": x.numel(), "scale_mismatches": 0,
            "value_mismatches": int((~_same(theirs, quantise_value(x, element, overflow="saturate"))).sum()),
            "documented": 0}


def reference_disagreements(x: torch.Tensor, element: str) -> dict:
    """How often OCP's floor and Transformer Engine's rceil give a block different scales, what share of elements
    floor clips to max_elem (rceil clips none by construction), and how often ml_dtypes' E8M0 cast (which rounds to
    the nearest power of two) differs from MX's floor of amax / 2^emax_elem."""
    import ml_dtypes

    finite = x[x.isfinite().all(-1)]
    floor, rceil = mx_quantise(finite, element, "floor"), mx_quantise(finite, element, "rceil")
    spec = FORMATS[element]
    blocks = finite.reshape(-1, 32)
    clipped = (blocks / floor.scale.reshape(-1, 1)).abs() > spec.max
    target = (blocks.abs().amax(-1) / 2.0**spec.emax).numpy()
    rounded = torch.from_numpy(target.astype(ml_dtypes.float8_e8m0fnu).astype(np.float32))
    nonzero = blocks.abs().amax(-1) > 0
    return {"blocks": blocks.shape[0],
            "floor_vs_rceil_scale_differs": float((floor.scale_bits != rceil.scale_bits).float().mean()),
            "floor_clipped_elements": float(clipped.float().mean()),
            "ml_dtypes_e8m0_vs_floor_differs": float((rounded != floor.scale.reshape(-1))[nonzero].float().mean())}


def conformance_table(count: int = RANDOM_VALUES) -> pd.DataFrame:
    rows = []
    for element in MX_ELEMENTS:
        x = torch.cat([random_blocks(count), adversarial_blocks(element)])
        for mode in SCALE_MODES:
            rows.append({"reference": "torchao to_mx + to_dtype", "format": f"MX {element}", "scale mode": mode,
                         **compare_mx_with_torchao(x, element, mode),
                         "note": TIE_NOTE if mode == SCALE_MODES[0] else "as above"})
        edge = torch.cat([x[:64, :8], x[:64, :8]], 1)  # 16 wide: one short block of 16 per row
        padded = torch.nn.functional.pad(edge, (0, 16))
        short = mx_quantise(edge, element).values
        rows.append({"reference": "torchao on the zero-padded tensor", "format": f"MX {element}",
                     "scale mode": "floor", "values": edge.numel(), "scale_mismatches": 0,
                     "value_mismatches": int((~_same(short, mx_quantise(padded, element).values[:, :16])).sum()),
                     "documented": 0, "note": "a block shorter than 32 at the tensor's edge"})
        transposed = x[:4096].t()  # non-contiguous, blocked along dim 0
        rows.append({"reference": "ours on the contiguous copy", "format": f"MX {element}", "scale mode": "floor",
                     "values": transposed.numel(), "scale_mismatches": 0,
                     "value_mismatches": int((~_same(mx_quantise(transposed, element, dim=0).values.t(),
                                                     mx_quantise(x[:4096], element).values)).sum()),
                     "documented": 0, "note": "a transposed (non-contiguous) input blocked along dim 0"})
        rows.append({"reference": "ml_dtypes cast", "format": element, "scale mode": "–",
                     **compare_elements_with_ml_dtypes(element, torch.cat([x.flatten(), x.flatten() * 2.0**-20])),
                     "note": "element rounding (RNE) inside the range"})
    x = torch.cat([random_blocks(count, 256), adversarial_blocks("fp8_e4m3", 256)])
    for dim in (-1, 0):
        rows.append({"reference": "torchao float8 axiswise cast", "format": "FP8 E4M3 rowwise",
                     "scale mode": f"power of two, per row along dim {dim}", **compare_rowwise_with_torchao(x, dim),
                     "note": "scaling=rowwise (torchao's rowwise recipe)"})
    x = torch.cat([random_blocks(count, 16), adversarial_blocks("fp4_e2m1", 16)])
    for two_level in (False, True):
        rows.append({"reference": "torchao nvfp4_quantize", "format": "NVFP4", "scale mode":
                     "E4M3 block x FP32 tensor" if two_level else "E4M3 block",
                     **compare_nvfp4_with_torchao(x, two_level),
                     "note": "E2M1 has no NaN: torchao's element code for a NaN differs (the block is NaN either way)"})
    return pd.DataFrame(rows)


def disagreement_table(count: int = RANDOM_VALUES) -> pd.DataFrame:
    return pd.DataFrame([{"element": element, **reference_disagreements(random_blocks(count), element)}
                         for element in MX_ELEMENTS])


def pow2_scale_disagreement(count: int = RANDOM_VALUES) -> dict:
    """How often torchao's power-of-two FP8 scale (448 / amax in float64, then floor) and Transformer Engine's
    (448 / amax in float32, mantissa cleared) differ, on amaxes spread over 2^[-30, 30) and on amaxes 448 / 2^k
    times (1 + a few float32 ulps), where the float32 quotient can round up to the next power of two."""
    generator = torch.Generator().manual_seed(1)
    spread = torch.rand(count, generator=generator) * torch.exp2(torch.randint(-30, 30, (count,), generator=generator).float())
    k = torch.randint(-20, 20, (count,), generator=generator).float()
    near = (E4M3_NEAR * torch.exp2(k)) * (1 + torch.randint(-4, 5, (count,), generator=generator).float() * 2.0**-24)
    return {name: float((torchao_pow2_scale(a) != te_pow2_scale(a)).float().mean())
            for name, a in (("random amax", spread), ("amax near 448 / 2^k", near))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.tools.conformance", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("results/conformance"))
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    table, disagreements, pow2 = conformance_table(), disagreement_table(), pow2_scale_disagreement()
    table.to_csv(args.out / "block_formats.csv", index=False)
    disagreements.to_csv(args.out / "reference_disagreements.csv", index=False)
    text = ["# Block formats against their references", "", __doc__.split("\n\n")[2].strip(), "",
            table.to_markdown(index=False), "", "## Where the references disagree (2^20 random values, finite blocks)", "",
            disagreements.to_markdown(index=False, floatfmt=".4f"), "",
            "FP8 power-of-two scales, torchao (rowwise) against Transformer Engine (block), share of amaxes where "
            "they differ: " + ", ".join(f"{name} {share:.6f}" for name, share in pow2.items()) + ". They differ "
            "where 448 / amax lies a few float32 ulps below a power of two: torchao's float32 log2 rounds up to that "
            "power, so amax times the scale exceeds 448 by under 2^-21 relative and the cast saturates it; TE's "
            "exponent mask floors. Ours follows each: rowwise is torchao's, block TE's.", ""]
    (args.out / "block_formats.md").write_text("\n".join(text))
    print("\n".join(text))
    return 1 if table["value_mismatches"].sum() or table["scale_mismatches"].sum() else 0


if __name__ == "__main__":
    raise SystemExit(main())
