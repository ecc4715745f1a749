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

Two entry points share one step: `mma(a, b, c, gpu=..., inputs=...)`, the instruction on paired rows (cases x K, as
the published data has it), and `matmul(a, b, ...)`, a whole GEMM A B^T as a GPU runs it, fast or with its FP8
partial sums promoted to FP32 (`dot` is its paired-row form). The step works in integers: each operand is split once
into a signed significand and an exponent, a product's aligned term is its significand product shifted by the
distance to the block's largest exponent (a right shift truncates toward zero on the magnitude), and the sum of a
block fits int64. On CPU and CUDA the step is one compiled kernel per GEMM configuration (torch.compile), with
the reduced dimension outermost so that the products vectorise along the output's rows; the products are never
stored.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch
import yaml

from bench.errors import ConfigError
from bench.numerics.formats import FORMATS, ElementFormat

logger = logging.getLogger(__name__)
TENSOR_CORES = Path(__file__).with_suffix(".yaml")  # the parameters, as data beside this module
PROMOTION_INTERVAL = 128  # elements: CUTLASS's default (4 MMAs of K = 32) and DeepSeek-V3's (§3.3.2); an assumption
ZERO_EXPONENT = -(1 << 20)  # a zero operand's or accumulator's exponent: below every alignment, it never sets one
STEP_ELEMENTS = 1 << 24  # products per step at most (rows of the output are taken in chunks below it)
GROUP_BLOCKS = 8  # blocks one compiled call chains: fewer calls from Python, graphs still quick to compile
FP32 = FORMATS["fp32"]  # what a Blackwell FP8 step rounds its products' sum to before it adds C


@dataclass(frozen=True)
class TensorCore:
    """One GPU's accumulation for one input type (bench/numerics/tensor_cores.yaml)."""

    gpu: str
    inputs: str
    block: int
    extra_bits: int
    min_exponent: int
    fp16_out_min_exponent: int
    c_after: bool = False  # C added to the products' sum once it is rounded (c_added: after), not aligned with them


@lru_cache(maxsize=None)
def _table() -> dict:
    return yaml.safe_load(TENSOR_CORES.read_text())


def covered() -> dict[str, list[str]]:
    """The input types each GPU name has a model for."""
    table = _table()
    return {gpu: list(table["generations"][generation]["inputs"]) for gpu, generation in table["gpus"].items()}


def tensor_core(gpu: str, inputs: str) -> TensorCore:
    """The parameters for `gpu` and `inputs`; ConfigError naming the covered pairs otherwise."""
    table = _table()
    generation = table["generations"].get(table["gpus"].get(gpu, ""), {})
    if inputs not in generation.get("inputs", {}):
        names = "; ".join(f"{name}: {', '.join(types)}" for name, types in covered().items())
        raise ConfigError(f"no tensor-core model for {gpu} with {inputs} inputs; covered: {names}")
    step = generation["inputs"][inputs]
    return TensorCore(gpu, inputs, step["block"], step["extra_bits"], generation["min_exponent"],
                      generation["fp16_out_min_exponent"], step.get("c_added", "aligned") == "after")


def element(name: str) -> ElementFormat:
    """The element format of a tensor-core operand or output type (the instruction names FP8 as e4m3 and e5m2)."""
    return FORMATS[name if name in FORMATS else f"fp8_{name}"]


def input_type(fmt: str) -> str:
    """The instruction's name for an element format of ours (fp8_e4m3 -> e4m3)."""
    return fmt.removeprefix("fp8_")


def split(x: torch.Tensor, fmt: ElementFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """x, exact in `fmt`, as int32 (significand, exponent) with x = significand * 2^(exponent - fmt.man_bits); a
    subnormal's exponent is emin, a zero's ZERO_EXPONENT. Read from x's FP32 bits (every format here fits FP32)."""
    bits = x.to(torch.float32).view(torch.int32)
    biased = (bits >> 23) & 0xFF
    fp32_exponent = torch.where(biased == 0, -126, biased - 127)
    significand = (bits & 0x7FFFFF) | torch.where(biased == 0, 0, 0x800000)
    exponent = torch.clamp(fp32_exponent, min=fmt.emin)
    significand = significand >> torch.clamp(23 - fmt.man_bits + exponent - fp32_exponent, max=31)  # int32 shifts
    return (torch.where(bits < 0, -significand, significand),
            torch.where(significand == 0, ZERO_EXPONENT, exponent).to(torch.int32))


def _power_of_two(exponent: torch.Tensor) -> torch.Tensor:
    """2^exponent in float64, built from its bits (exact; exponent within float64's normal range)."""
    return ((exponent.to(torch.int64) + 1023) << 52).view(torch.float64)


@dataclass(frozen=True)
class _Step:
    """One tensor-core step for one operand pairing and output: the integer constants of the alignment and of the
    output's rounding, so that a compiled kernel sees them as constants."""

    block: int
    left: int  # a significand product is shifted left by this (the aligned grid's bits below it) ...
    right: int  # ... then right by (E - e_a - e_b) + this, truncating
    extra_bits: int
    lowest: int  # the alignment exponent's floor
    fraction_bits: int  # of the output: its significand's, FP32's narrowed to Hopper's FP8 accumulator
    output_emin: int
    output_emax: int
    nearest: bool  # round the output to nearest even (FP16) or toward zero (FP32)
    narrow: bool  # a block's aligned terms sum within int32 (Hopper's FP8: 32 terms under 2^15), which vectorises wider
    c_after: bool = False  # the products' sum rounded toward zero to FP32, then C added, rounded to nearest even
    output_dtype: torch.dtype = torch.float32

    def __call__(self, sa, ea, sb, eb, c):
        """D (float32) from block operands (block, ...) as significands and exponents, and C (float32, exact in the
        output), broadcasting over the dimensions after the block."""
        # C read from its FP32 bits as `split` reads an operand, written out: through `split` the compiled kernel
        # runs 11 times slower (its clamped variable shift and sign select, on every output of every block)
        bits = c.view(torch.int32)
        biased = (bits >> 23) & 0xFF
        c_exponent = torch.where(c == 0, ZERO_EXPONENT, torch.where(biased == 0, -126, biased - 127))
        c_magnitude = ((bits & 0x7FFFFF) | torch.where(biased == 0, 0, 0x800000)).to(torch.int64)
        exponents = ea + eb
        largest = exponents.amax(0) if self.c_after else torch.maximum(exponents.amax(0), c_exponent)
        largest = torch.clamp(largest, min=self.lowest)
        products = sa * sb
        negative = products >> 31  # all ones where the product is negative, else zero
        magnitude = (products ^ negative) - negative
        # int32 shifts stop at 31 (past it C++ leaves them undefined); the shifted magnitude is under 2^28, so 31 is 0
        aligned = (magnitude << self.left) >> torch.clamp(largest - exponents + self.right, 0, 31)
        total = ((aligned ^ negative) - negative).sum(0, dtype=torch.int32 if self.narrow else torch.int64).long()
        if self.c_after:
            # one FP32 (or FP16) addition rounded to nearest even: in float64 the sum of an FP32 and an FP16 or FP32
            # value is exact, or its smaller term lies below a quarter of the output's unit, where no rounding of
            # it reaches a tie (no double rounding)
            products = self._round(total, largest - 23 - self.extra_bits, FP32.man_bits, FP32.emin, FP32.emax,
                                   nearest=False)
            return (products.double() + c.double()).to(self.output_dtype).to(torch.float32)
        c_shift = largest - c_exponent - self.extra_bits  # C's significand onto the grid 2^(E - 23 - extra_bits)
        c_aligned = torch.where(c_shift >= 0, c_magnitude >> torch.clamp(c_shift, 0, 62),
                                c_magnitude << torch.clamp(-c_shift, 0, 62))
        total = total + torch.where(c < 0, -c_aligned, c_aligned)
        return self._round(total, largest - 23 - self.extra_bits, self.fraction_bits, self.output_emin,
                           self.output_emax, self.nearest)

    def chain(self, sa, ea, sb, eb, c):
        """D after the blocks of (k, ...) operands (k a multiple of the block), each step's D the next one's C."""
        for start in range(0, sa.shape[0], self.block):
            end = start + self.block
            c = self(sa[start:end], ea[start:end], sb[start:end], eb[start:end], c)
        return c

    @staticmethod
    def _round(total, grid, fraction_bits: int, emin: int, emax: int, nearest: bool):
        """total * 2^grid (exact integers) rounded to a format of `fraction_bits`, `emin` and `emax`, subnormals
        kept; toward zero saturates, to nearest (even) overflows to infinity."""
        magnitude = total.abs()
        top = (magnitude.to(torch.float64).view(torch.int64) >> 52) - 1023  # floor(log2): |total| < 2^53
        last_bit = torch.clamp(top + grid, min=emin) - fraction_bits
        drop = torch.clamp(last_bit - grid, 0, 62)
        kept = magnitude >> drop
        if nearest:
            rest, half = magnitude - (kept << drop), (1 << drop) >> 1
            kept = kept + ((drop > 0) & ((rest > half) | ((rest == half) & ((kept & 1) == 1)))).to(torch.int64)
        value = kept.to(torch.float64) * _power_of_two(grid + drop)
        largest = (2 - 2.0 ** -fraction_bits) * 2.0 ** emax
        value = torch.where(value > largest, float("inf") if nearest else largest, value)
        return torch.where(total < 0, -value, value).to(torch.float32)


@lru_cache(maxsize=None)
def _step(core: TensorCore, a_format: str, b_format: str, output: str) -> _Step:
    """The step for `core` on (a_format, b_format) operands writing `output`."""
    shift = 23 + core.extra_bits - element(a_format).man_bits - element(b_format).man_bits  # aligned: product << shift
    out, most = element(output), 2 ** (element(a_format).man_bits + element(b_format).man_bits + 2)  # |product| <
    return _Step(block=core.block, left=max(shift, 0), right=max(shift, 0) - shift, extra_bits=core.extra_bits,
                 lowest=core.fp16_out_min_exponent if output == "fp16" and core.inputs == "fp16" else core.min_exponent,
                 fraction_bits=out.man_bits + (min(core.extra_bits, 0) if output == "fp32" else 0),
                 output_emin=out.emin, output_emax=out.emax, nearest=output == "fp16",
                 narrow=core.block * (most << max(shift, 0)) < 2 ** 31, c_after=core.c_after,
                 output_dtype=out.torch_dtype)


@lru_cache(maxsize=None)
def _compiled(function):
    """`function` compiled for static shapes (twice as fast as dynamic ones on CPU). A model's few GEMM shapes each
    compile once, more than dynamo's default of 8 per function: the limit is raised for this function's calls alone,
    set and restored around each (a config.patch context would double a call's overhead)."""
    compiled = torch.compile(function, dynamic=False, fullgraph=True)
    config = torch._dynamo.config

    def kernel(*args):
        before = config.recompile_limit
        config.recompile_limit = max(before, RECOMPILE_LIMIT)
        try:
            return compiled(*args)
        finally:
            config.recompile_limit = before
    return kernel


RECOMPILE_LIMIT = 256  # shapes one compiled function may take (a model has a few per Linear layer)


def _kernels(step: _Step, device: torch.device):
    """(split, step.chain) as compiled kernels where inductor builds them (CPU, CUDA), else as eager torch."""
    if device.type in ("cpu", "cuda"):
        _say_compiling()
        return _compiled(split), _compiled(step.chain)
    return split, step.chain


@lru_cache(maxsize=None)
def _say_compiling() -> None:
    """Once a process: a run whose first steps seem to hang says why."""
    logger.info("compiling the tensor-core accumulation kernels, one per GEMM shape (inductor: minutes on 2 cores "
                "the first time on a machine, LeNet's about 3; seconds once its cache holds them)")


def _core(gpu: str, a_format: str, b_format: str) -> TensorCore:
    """The tensor core of an (a_format, b_format) pairing: mixed FP8 (E4M3 x E5M2) takes the parameters its two types
    share (a ConfigError where they differ)."""
    core = tensor_core(gpu, input_type(a_format))
    other = tensor_core(gpu, input_type(b_format))
    if (core.block, core.extra_bits, core.c_after) != (other.block, other.extra_bits, other.c_after):
        raise ConfigError(f"no tensor-core model for {gpu} with {a_format} x {b_format} operands")
    return core


def mma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, *, gpu: str, inputs: str,
        output: str = "fp32") -> torch.Tensor:
    """D = A·B + C per case as `gpu`'s tensor cores compute it from `inputs` operands: `a`, `b` (cases, K), values
    exact in `inputs` (fp16, bf16, tf32, e4m3, e5m2); `c` (cases,), exact in `output`. K any length: the operands are
    zero-padded to whole blocks, which chain (each block's D the next one's C). Returns float32 (FP16 values held in
    FP32 where `output="fp16"`). Eager: one kernel for each of the many small replayed sets would cost more to compile
    than to run."""
    if output not in _table()["outputs"]:
        raise ConfigError(f"output={output!r}; valid: {', '.join(_table()['outputs'])}")
    core = tensor_core(gpu, inputs)
    step = _step(core, inputs, inputs, output)
    (sa, ea), (sb, eb) = (split(_padded(x, core.block).t(), element(inputs)) for x in (a, b))
    return step.chain(sa, ea, sb, eb, c.to(torch.float32))


def _padded(x: torch.Tensor, block: int) -> torch.Tensor:
    """x (rows, K) with K zero-padded to whole blocks (zeros add nothing and set no alignment)."""
    return torch.nn.functional.pad(x, (0, -x.shape[1] % block))


def matmul(a: torch.Tensor, b: torch.Tensor, *, gpu: str, a_format: str, b_format: str | None = None,
           promote_every: int | None = None) -> torch.Tensor:
    """A B^T (a: M x K, b: N x K, values exact in a_format and b_format, element formats of ours such as fp8_e4m3 or
    bf16) as `gpu`'s tensor cores compute it into an FP32 output: each output's K chained through tensor-core steps
    into one accumulator (`promote_every=None`: cuBLAS's FP8 "fast accumulation", and every 16-bit GEMM), or promoted:
    every `promote_every` elements (a multiple of the block) the tensor cores' partial sum, from C = 0, is added into
    an FP32 accumulator on the CUDA cores, rounded to nearest. How cuBLAS tiles K and when it promotes is not in the
    hardware data: both are assumptions (docs/formats.md). Float32 (M, N), on a's device."""
    b_format = b_format or a_format
    core = _core(gpu, a_format, b_format)
    if promote_every is not None and promote_every % core.block:
        raise ConfigError(f"promote_every={promote_every} is not a multiple of {gpu}'s {core.block}-element block")
    split_kernel, chain = _kernels(_step(core, a_format, b_format, "fp32"), a.device)
    # the reduced dimension outermost and each operand contiguous along its rows: the kernel's loads vectorise
    (sa, ea), (sb, eb) = (split_kernel(_padded(x, core.block).t().contiguous(), element(fmt))
                          for x, fmt in ((a, a_format), (b, b_format)))
    sb, eb = sb[:, None, :], eb[:, None, :]
    k, n = sa.shape[0], sb.shape[2]
    rows = max(1, STEP_ELEMENTS // (core.block * max(n, 1)))
    out = torch.empty(a.shape[0], n, dtype=torch.float32, device=a.device)
    for first in range(0, a.shape[0], rows):
        xa, xe = sa[:, first:first + rows, None], ea[:, first:first + rows, None]
        total = torch.zeros(xa.shape[1], n, dtype=torch.float32, device=a.device)
        interval, group = promote_every or k, GROUP_BLOCKS * core.block
        for start in range(0, k, interval):
            d, stop = torch.zeros_like(total), min(start + interval, k)
            for s in range(start, stop, group):
                e = min(s + group, stop)
                d = chain(xa[s:e], xe[s:e], sb[s:e], eb[s:e], d)
            total = d if promote_every is None else total + d  # FP32 addition, round to nearest even
        out[first:first + rows] = total
    return out


def dot(a: torch.Tensor, b: torch.Tensor, *, gpu: str, inputs: str, promote_every: int | None = None) -> torch.Tensor:
    """The dot products of paired rows (a, b: cases x K) as a whole GEMM computes each output (`matmul`): fast, or
    promoted to FP32 every `promote_every` elements."""
    zero = torch.zeros(a.shape[0], dtype=torch.float32, device=a.device)
    if promote_every is None:
        return mma(a, b, zero, gpu=gpu, inputs=inputs)
    total = zero
    for start in range(0, a.shape[1], promote_every):
        total = total + mma(a[:, start:start + promote_every], b[:, start:start + promote_every], zero, gpu=gpu,
                            inputs=inputs)
    return total


GEMMS = ("output", "grad_input", "grad_weight")  # a Linear's three GEMMs, as torchao's Float8LinearConfig names them
# torchao's tensorwise FP8 recipe: fast accumulation in the output GEMM only (Float8LinearConfig's gemm_config_*)
TORCHAO_TENSORWISE_FAST = (True, False, False)
FP8_CHOICES = {"": TORCHAO_TENSORWISE_FAST, "-fast": (True, True, True), "-promoted": (False, False, False)}


@dataclass(frozen=True)
class Accumulation:
    """How an emulated GEMM accumulates (format.accumulation other than exact): as `gpu`'s tensor cores, and, where
    its operands are FP8, which of a Linear's three GEMMs (GEMMS) run fast (no promotion) and how often the others
    promote their partial sums to FP32. 16-bit GEMMs chain K through the tensor cores' accumulator (no promotion)."""

    gpu: str
    fp8: bool = False  # FP8 operands: `fast` and `promote_every` apply
    fast: tuple[bool, bool, bool] = (True, True, True)
    promote_every: int = PROMOTION_INTERVAL

    @classmethod
    def parse(cls, value: str, operand_types: tuple[str, ...]) -> "Accumulation":
        """format.accumulation's value for GEMMs on `operand_types` (element formats of ours): `<GPU>` (an FP8 GEMM
        fast where torchao's tensorwise recipe is), `<GPU>-fast` or `<GPU>-promoted` (FP8: every GEMM so); a
        ConfigError naming the valid values otherwise."""
        gpus, fp8 = covered(), any(t.startswith("fp8") for t in operand_types)
        types = sorted({input_type(t) for t in operand_types})
        valid = [g for g, has in gpus.items() if all(t in has for t in types)]
        suffixes = tuple(FP8_CHOICES) if fp8 else ("",)
        spelled = {f"{g}{s}": (g, FP8_CHOICES[s]) for g in valid for s in suffixes}
        if value not in spelled:
            choices = ", ".join(["exact", *spelled]) if spelled else "exact"
            where = f" (operands {' and '.join(types)})" if types else ""
            raise ConfigError(f"format.accumulation={value} is not a tensor-core model here{where}; valid: {choices}")
        gpu, fast = spelled[value]
        return cls(gpu, fp8, fast) if fp8 else cls(gpu)

    def promotion(self, gemm: int) -> int | None:
        """`matmul`'s promote_every for GEMM number `gemm` (GEMMS' order): None where it runs fast."""
        return None if self.fast[gemm] else self.promote_every

    def describe(self) -> dict:
        """What a record says of it (env.precision.accumulation)."""
        chained = "K chained through the tensor cores' accumulator"
        gemms = {gemm: f"{chained} (fast)" if fast else f"promoted to FP32 every {self.promote_every}"
                 for gemm, fast in zip(GEMMS, self.fast)} if self.fp8 else dict.fromkeys(GEMMS, chained)
        return {"tensor_cores": self.gpu, "gemms": gemms,
                "model": "bench.numerics.tensor_cores: each instruction bit for bit (Khattak & Mikaitis's parameters, "
                         "replayed against their GPU outputs); K chained in order, as cuBLAS did on an H100 at M = N = "
                         "4096: how cuBLAS tiles K elsewhere and when it promotes are assumptions (docs/formats.md)"}
