"""GEMM accumulation as NVIDIA's tensor cores do it, bit for bit, on any device.

One tensor-core step computes D = C + sum of `block` products a_i * b_i:
1. each product is exact, its exponent the sum of its operands' (e_a + e_b: the significand product, in [1, 4), is
   not renormalised); C's is its FP32 exponent;
2. every term is aligned to the largest exponent E (never below the generation's `min_exponent`): the bits below
   2^(E - 23 - extra_bits) are truncated (toward zero), so a small term next to a large one loses its low bits;
3. the aligned terms are summed exactly and the sum rounded once: toward zero to FP32 (to 23 + extra_bits fraction
   bits where extra_bits is negative: Hopper's FP8 keeps 13), or to nearest even to FP16.
A longer K chains steps, each D the next step's C. The parameters per GPU generation and input type are data
(bench/numerics/tensor_cores.yaml, from Khattak & Mikaitis's models); this module is written from their description and
checked against the real GPU outputs they published (tests/test_tensor_cores.py).

`mma(a, b, c, gpu=..., inputs=...)` is the one entry point: float64 arithmetic holds every product and every aligned
sum exactly (at most 2 x 11 significand bits a product, and the sum of 33 aligned terms under 2^40), so the model is
vectorised over cases and blocks with no integer emulation.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch
import yaml

from bench.errors import ConfigError
from bench.numerics.formats import FORMATS, ElementFormat

TENSOR_CORES = Path(__file__).with_suffix(".yaml")  # the parameters, as data beside this module


@dataclass(frozen=True)
class TensorCore:
    """One GPU's accumulation for one input type (bench/numerics/tensor_cores.yaml)."""

    gpu: str
    inputs: str
    block: int
    extra_bits: int
    min_exponent: int
    fp16_out_min_exponent: int


@lru_cache(maxsize=None)
def _table() -> dict:
    return yaml.safe_load(TENSOR_CORES.read_text())


def tensor_core(gpu: str, inputs: str) -> TensorCore:
    """The parameters for `gpu` and `inputs`; ConfigError naming the covered pairs otherwise."""
    table = _table()
    generation = table["generations"].get(table["gpus"].get(gpu, ""), {})
    if inputs not in generation.get("inputs", {}):
        covered = "; ".join(f"{name}: {', '.join(table['generations'][gen]['inputs'])}"
                            for name, gen in table["gpus"].items())
        raise ConfigError(f"no tensor-core model for {gpu} with {inputs} inputs; covered: {covered}")
    step = generation["inputs"][inputs]
    return TensorCore(gpu, inputs, step["block"], step["extra_bits"], generation["min_exponent"],
                      generation["fp16_out_min_exponent"])


def element(name: str) -> ElementFormat:
    """The element format of a tensor-core operand or output type (the instruction names FP8 as e4m3 and e5m2)."""
    return FORMATS[name if name in FORMATS else f"fp8_{name}"]


def _exponent(x: torch.Tensor, floor: int) -> torch.Tensor:
    """floor(log2 |x|), never below `floor` (a subnormal's exponent); meaningless for zero, which callers mask."""
    _, e = torch.frexp(x)
    return torch.clamp(e.to(torch.float64) - 1, min=floor)


def _round(value: torch.Tensor, fraction_bits: int, output: str, toward_zero: bool) -> torch.Tensor:
    """`value` (exact, float64) rounded to `fraction_bits` fraction bits in `output`'s exponent range (subnormals
    kept), toward zero (overflow to the largest finite) or to nearest even (overflow to infinity)."""
    emin, emax = element(output).emin, element(output).emax
    magnitude = value.abs()
    exponent = torch.clamp(_exponent(torch.where(magnitude > 0, magnitude, 1.0), emin), min=emin)
    quantum = torch.ldexp(torch.ones_like(value), (exponent - fraction_bits).to(torch.int64))
    scaled = magnitude / quantum
    kept = torch.trunc(scaled) if toward_zero else torch.round(scaled)  # torch.round: half to even
    result = kept * quantum
    largest = (2 - 2.0 ** -fraction_bits) * 2.0 ** emax
    result = torch.where(result > largest, torch.full_like(result, largest if toward_zero else float("inf")), result)
    return torch.copysign(result, value)


def _step(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, core: TensorCore, output: str) -> torch.Tensor:
    """One tensor-core step on (cases, block) operands and (cases,) accumulators, all float64 holding exact values."""
    products = a * b
    live = products != 0
    floor = element(core.inputs).emin  # a subnormal operand's exponent
    exponents = torch.where(live, _exponent(a, floor) + _exponent(b, floor), torch.full_like(products, -1e9))
    c_exponent = torch.where(c != 0, _exponent(torch.where(c != 0, c, 1.0), -126), torch.full_like(c, -1e9))
    lowest = core.fp16_out_min_exponent if output == "fp16" and core.inputs == "fp16" else core.min_exponent
    largest = torch.clamp(torch.maximum(exponents.amax(dim=1), c_exponent), min=lowest)
    quantum = torch.ldexp(torch.ones_like(largest), (largest - 23 - core.extra_bits).to(torch.int64))
    aligned = torch.trunc(products / quantum[:, None]).sum(dim=1) + torch.trunc(c / quantum)
    fraction_bits = element(output).man_bits + (min(core.extra_bits, 0) if output == "fp32" else 0)
    return _round(aligned * quantum, fraction_bits, output, toward_zero=output == "fp32")


def mma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, *, gpu: str, inputs: str,
        output: str = "fp32") -> torch.Tensor:
    """D = A·B + C per case as `gpu`'s tensor cores compute it from `inputs` operands: `a`, `b` (cases, K), values
    exact in `inputs` (fp16, bf16, tf32, e4m3, e5m2); `c` (cases,), exact in `output`. K any length: the operands are
    zero-padded to whole blocks, which chain (each block's D the next one's C). Returns float32 (FP16 values held in
    FP32 where `output="fp16"`)."""
    if output not in _table()["outputs"]:
        raise ConfigError(f"output={output!r}; valid: {', '.join(_table()['outputs'])}")
    core = tensor_core(gpu, inputs)
    a, b, d = a.to(torch.float64), b.to(torch.float64), c.to(torch.float64)
    pad = -a.shape[1] % core.block
    a, b = (torch.nn.functional.pad(x, (0, pad)) for x in (a, b))
    for start in range(0, a.shape[1], core.block):
        d = _step(a[:, start:start + core.block], b[:, start:start + core.block], d, core, output)
    return d.to(torch.float32)


PROMOTION_INTERVAL = 128  # elements: CUTLASS's default (4 MMAs of K = 32) and DeepSeek-V3's (§3.3.2); an assumption


def dot(a: torch.Tensor, b: torch.Tensor, *, gpu: str, inputs: str, promote_every: int | None = None) -> torch.Tensor:
    """The dot products of a whole GEMM (a, b: cases x K) as a GPU runs them: K chained through tensor-core steps
    into one FP32 accumulator (`promote_every=None`: cuBLAS's FP8 "fast accumulation"), or promoted: every
    `promote_every` elements the tensor cores' partial sum (from C = 0) is added into an FP32 accumulator on the CUDA
    cores, rounded to nearest. How cuBLAS tiles K and when it promotes is not in the hardware data: both are
    assumptions (docs/formats.md)."""
    zero = torch.zeros(a.shape[0], dtype=torch.float64)
    if promote_every is None:
        return mma(a, b, zero, gpu=gpu, inputs=inputs)
    total = zero.to(torch.float32)
    for start in range(0, a.shape[1], promote_every):
        part = mma(a[:, start:start + promote_every], b[:, start:start + promote_every], zero, gpu=gpu, inputs=inputs)
        total = total + part  # FP32 addition, round to nearest even
    return total
