"""Quantisers at memory speed: each eager quantiser (a chain of elementwise passes over the tensor) also runs as one
fused pass compiled by inductor, bit for bit the same, where that pays.

`@fused(from_elements=n)` wraps a quantiser `fn(x, ...)`. A call runs `torch.compile(fn)` when every one of these
holds, and `fn` itself (the eager reference, also `quantiser.eager`) otherwise:
- x has at least n elements: below it a compiled call's fixed cost (about 25 µs of guards and dispatch on this
  2-core CPU) is more than the eager passes (docs/performance.md gives the measured crossover per quantiser);
- x is on the CPU (FUSED_DEVICES) and nothing is being compiled already (a compiled model traces the eager body
  into its own graph). On CUDA the quantisers run eagerly: inductor's Triton code for MX's rceil scale was not bit for
  bit the eager one on an H100 (2026-11-27, `pytest -m cuda`), where the eager quantisers on CUDA gave the CPU's bits;
- the call draws no random numbers: stochastic rounding (`rounding="stochastic"`, or a `generator`) stays eager,
  because a compiled graph draws from inductor's own generator, not the eager one's stream;
- no gradient is being recorded through x (the quantisers run inside autograd Functions' forward passes);
- the environment says `PRECISION_BENCH_FUSED=1`. Off by default: alone the fused quantisers are 2-4x faster
  than the eager ones, but inside LeNet's and BERT-tiny's emulated steps a compiled call's guards and dispatch
  (60-120 µs) cost what the passes it replaces do, and MXFP8 steps got slower (docs/performance.md). Records say
  which ran (`env.fused_quantisers`).
A BF16 or FP16 x enters the compiled graph as FP32 and its result leaves in x's dtype: inductor's CPU code for a
16-bit tensor cast to FP8 and back ran 2x slower than torch's eager casts.

Exactness. Inductor may fuse a cast to a 16-bit type and back into nothing: `x.to(bf16).to(fp32)`, the rounding
itself, comes back unrounded unless `emulate_precision_casts` is set, which it is here. Everything else the
quantisers compute is exact in FP32 (adds of a power-of-two magic number, integer bit operations, multiplies by
powers of two, compares), so neither reordering nor contraction into FMAs can change a bit; tests/test_fused.py
holds every quantiser to its eager self on every conformance family, format and overflow policy.
The one departure it finds is a NaN's payload (FP32's quiet NaN in, 0x7fffffff out where eager returns 0x7fc00000):
still NaN.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
from typing import Callable

import torch

INDUCTOR_OPTIONS = {"emulate_precision_casts": True}  # keep x.to(bf16/fp16).to(fp32) a rounding when fused
SWITCH = "PRECISION_BENCH_FUSED"  # =1: fused where it pays; otherwise (the default) every quantiser eager
ELEMENTWISE_FROM = 1 << 16  # element rounding: compiled from 65,536 elements (the measured crossover, 2 threads)
BLOCKWISE_FROM = 1 << 12  # block and tile quantisers (ten or more eager passes): from 4,096 elements
SIXTEEN_BIT = (torch.bfloat16, torch.float16)  # compiled on their FP32 widening (the module docstring says why)
# where a compiled quantiser is its eager self bit for bit, as tested: not CUDA, whose Triton code divides amax / 448
# approximately (div.full) for MX's rceil scale unless inductor's eager_numerics options say otherwise (untried there)
FUSED_DEVICES = ("cpu",)


FELL_BACK: list[str] = []  # the specialisations that failed to compile in this process (they run eagerly)
logger = logging.getLogger(__name__)


def enabled() -> bool:
    """Whether fused quantisers may run in this process (`PRECISION_BENCH_FUSED=1`)."""
    return os.environ.get(SWITCH, "0") == "1"


def _static_key(args: tuple, kwargs: dict) -> tuple | None:
    """The call's non-tensor arguments (format, policy, dim, ...), which the compiled graph is specialised on; None
    where one cannot be a key."""
    key = tuple(a for a in args if not isinstance(a, torch.Tensor)) + tuple(
        (k, v) for k, v in sorted(kwargs.items()) if not isinstance(v, torch.Tensor))
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _compiled(fn: Callable, index: int) -> Callable:
    """`torch.compile` of a new function calling `fn`, under a code object of its own: dynamo keeps its graphs, and
    counts them against its recompile limit (8), per code object, so each specialisation of a quantiser (a format,
    an overflow policy, a dimension) gets its own budget for the shapes it meets instead of sharing one."""
    def call(*args, **kwargs):
        return fn(*args, **kwargs)

    call.__code__ = call.__code__.replace(co_name=f"{fn.__name__}_fused_{index}")
    return torch.compile(call, fullgraph=True, options=INDUCTOR_OPTIONS)


def fused(from_elements: int) -> Callable[[Callable], Callable]:
    """Decorate quantiser `fn(x, ...)`: its compiled twin where it pays (the module docstring says when), `fn`
    otherwise. `quantiser.eager` is `fn`, `quantiser.fused` the compiled path whatever the call (the tests' and the
    benchmark's), `quantiser.compiled` its specialisations so far."""
    def decorate(fn: Callable) -> Callable:
        signature = inspect.signature(fn)
        compiled: dict[tuple, Callable | None] = {}  # per static key; None: it failed to compile, eager

        def draws(args, kwargs) -> bool:
            chosen = signature.bind_partial(None, *args, **kwargs).arguments
            return chosen.get("rounding", "nearest") != "nearest" or chosen.get("generator") is not None

        def run_fused(x: torch.Tensor, *args, **kwargs):
            key = _static_key(args, kwargs)
            if key is not None and key not in compiled:
                compiled[key] = _compiled(fn, len(compiled))
            if key is not None and compiled[key] is not None:
                try:
                    if x.dtype in SIXTEEN_BIT:  # FP32 in, and back: inductor's 16-bit code is slower than eager
                        result = compiled[key](x.float(), *args, **kwargs)
                        return result.to(x.dtype) if isinstance(result, torch.Tensor) else result
                    return compiled[key](x, *args, **kwargs)
                except Exception as e:  # dynamo's limits, or inductor cannot compile here: eager from now on
                    compiled[key] = None
                    FELL_BACK.append(f"{fn.__name__}{key}: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
                    logger.warning("fused %s fell back to eager: %s", fn.__name__, FELL_BACK[-1])
            return fn(x, *args, **kwargs)

        @functools.wraps(fn)
        def quantiser(x: torch.Tensor, *args, **kwargs):
            # the switch first: off (the default), a call costs one lookup before the eager quantiser
            if (not enabled() or x.numel() < from_elements or x.device.type not in FUSED_DEVICES
                    or torch.compiler.is_compiling() or (x.requires_grad and torch.is_grad_enabled())
                    or draws(args, kwargs)):
                return fn(x, *args, **kwargs)
            return run_fused(x, *args, **kwargs)

        quantiser.eager, quantiser.fused, quantiser.compiled = fn, run_fused, compiled
        return quantiser
    return decorate
