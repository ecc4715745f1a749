"""One GEMM's time on a GPU, priced by its shape, its operand type and its kernel.

A GEMM kernel cuts the (M x N) output into tiles; each of the GPU's SMs computes one tile at a time, looping over K.
So the GEMM runs in waves of `sms` tiles, and a wave costs as much when one SM works as when all do:

    time = waves x one tile's K loop (at the SM's share of the type's large-GEMM rate) + the kernel's latency,

where the large-GEMM rate is the datasheet's dense peak x the efficiency a full wave reaches (the GPU profile's
`gemm_efficiency`, per operand type, each with its source), times the kernel's factor (`KERNELS`: fast accumulation
off, a row-scaled FP8 kernel). Where the tiles do not fill the SMs, the kernel splits K across them (split-K, as
cuBLAS does) and pays for reducing the partial sums. A GEMM moving more bytes than it computes (small K, or a
skinny shape) is bound by memory instead. The tile shape is the one of the profile's `gemm_tiles` that is quickest,
as cuBLAS's heuristics aim to choose.

What is not modelled: L2 reuse (each operand is read once), stream-K's finer balancing of a partial last wave, and
tile shapes per type (one list per GPU).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

RATE = {"fp32": "fp32", "tf32": "tf32", "bf16": "bf16", "fp16": "fp16", "fp8": "fp8", "mxfp8": "mxfp8",
        "nvfp4": "nvfp4", "mxfp4": "nvfp4"}  # operand type -> the profile's rate (and efficiency) key
PEAK = {"mxfp8": "fp8", "nvfp4": "fp4"}  # block-scaled types run at their element type's dense peak


@dataclass(frozen=True)
class GemmKernel:
    """Which kernel runs a GEMM: its operand type, how its FP8 operands are scaled, and whether it accumulates fast
    (cuBLAS's FP8 fast accumulation: no promotion of the partial sums to FP32)."""

    element: str  # fp32 | tf32 | bf16 | fp16 | fp8 | mxfp8 | nvfp4
    scales: str = "none"  # none | tensor | row (FP8's scales per row of A and column of B) | block
    fast_accum: bool = True

    @property
    def factor_key(self) -> str | None:
        """The `KERNELS` entry this kernel runs at, relative to its type's large-GEMM rate (None: at that rate)."""
        if self.element != "fp8":
            return None
        if self.scales == "row" and self.fast_accum:
            return "fp8_rowwise"  # torch._scaled_mm's row-scaled CUTLASS kernel
        return None if self.fast_accum else "fp8_no_fast_accum"  # cuBLAS's; torchao's row-wise recipe takes it too


@dataclass(frozen=True)
class GemmTime:
    """A GEMM's predicted time and how the model arrived at it."""

    seconds: float
    tile: tuple[int, int]
    split_k: int
    waves: int
    bound: str  # compute | memory


def rate(gpu, element: str, factors: dict[str, float], kernel: GemmKernel | None = None,
         fp32_efficiency: float | None = None) -> float:
    """FLOP/s a full wave of `element` GEMM tiles reaches on `gpu`: its dense peak x its large-GEMM efficiency
    (FP32 on CUDA cores: `fp32_efficiency`) x the kernel's factor."""
    key = RATE[element]
    peak = gpu.tflops[PEAK.get(key, key)] * 1e12
    efficiency = fp32_efficiency if key == "fp32" and fp32_efficiency is not None else gpu.gemm_efficiency[key]
    factor = factors[kernel.factor_key] if kernel is not None and kernel.factor_key else 1.0
    return peak * efficiency * factor


def gemm_time(batch: int, m: int, k: int, n: int, kernel: GemmKernel, gpu, *, flops_per_s: float,
              bytes_per_s: float, operand_bytes: float, output_bytes: float, latency_s: float) -> GemmTime:
    """The quickest of the profile's tile shapes and split-K factors for a (batch x) M x K x N GEMM at `flops_per_s`
    (a full wave's rate: `rate`), its operands (`operand_bytes` per element) and output read and written once at
    `bytes_per_s`."""
    moved = batch * ((m * k + k * n) * operand_bytes + m * n * output_bytes)
    memory_s = moved / bytes_per_s
    per_sm = flops_per_s / gpu.sms
    best = None
    for tm, tn in gpu.gemm_tiles:
        tiles = batch * math.ceil(m / tm) * math.ceil(n / tn)
        for split in _splits(tiles, k, gpu.sms):
            waves = math.ceil(tiles * split / gpu.sms)
            compute_s = waves * 2 * tm * tn * math.ceil(k / split) / per_sm
            reduce_s = 0.0 if split == 1 else batch * m * n * 4 * (split + 1) / bytes_per_s  # FP32 partial sums
            seconds = max(compute_s, memory_s) + reduce_s + latency_s
            if best is None or seconds < best.seconds:
                best = GemmTime(seconds, (tm, tn), split, waves, "compute" if compute_s >= memory_s else "memory")
    return best


MIN_SPLIT_K = 256  # the shortest K slice a split-K kernel gives an SM (shorter: its partial sums cost more than it)


def _splits(tiles: int, k: int, sms: int) -> range:
    """Split-K factors worth trying: 1, or where the tiles leave SMs idle, up to as many as fill them."""
    most = max(1, min(sms // max(tiles, 1), k // MIN_SPLIT_K))
    return range(1, most + 1)
