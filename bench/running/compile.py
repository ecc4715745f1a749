"""Compiled training steps (train.compile): when a cell is compiled, what compiling cost, and what it could not take.

Every published FP8 speed-up is measured compiled: eager torchao FP8 spends its step in tensor-subclass dispatch
(on an H100, 184 ms eager against 40 ms compiled for the same BERT-base step). So on CUDA a cell's forward and
loss run through torch.compile (inductor) by default; on CPU they run eagerly unless asked, since a compile costs
more than the short CPU cells it would speed up (`make bench` has the compiled and eager rows).

What is compiled is one function, the forward and the loss of a training batch; the backward follows through
AOTAutograd; the optimiser, the loss scaler (found_inf stays on the device) and the checkpoints work on the
uncompiled module, whose state-dict keys are unchanged. The first step (whose memory is counted through saved-
tensor hooks) and the evaluation run eagerly. A step during which dynamo compiled is a compile step: its time is
kept out of the step-time median and reported apart (`timing.compile`): the first compiled step, and the first
telemetry-sampled one, whose observers read values on the host (graph breaks, counted in `env.compile`), so that
sampled steps run as pieces of graph while ordinary steps run as one. Under `auto`, a path that fails to compile
(its forward, or its backward at the step's first backward) runs that step again and every later one eagerly, and
the record says why (`env.compile.eager_because`). Emulated FP8 with per-tensor scales, whose amax state leaves
each emulated layer's autograd.Function, compiles with a graph break at each such layer, which runs eagerly
(`env.compile.graph_break_reasons`: "HOP: Unsafe side effect").
"""

from __future__ import annotations

import contextlib
import logging
from typing import Callable

import torch

from bench.running.record import error_line

BACKEND, MODE = "inductor", "default"


def own_kernels(precision) -> str | None:
    """Why a cell runs eagerly whatever train.compile says (None: nothing stops it compiling)."""
    if precision.plan.config.accumulation_model is not None:
        return (f"format.accumulation={precision.plan.config.accumulation}: every GEMM runs the tensor-core model's "
                "own compiled kernels")
    return None


def compiling(setting, precision) -> bool:
    """Whether a cell compiles (its step, or a distributed cell's blocks): asked for on its device, and nothing of its
    own (`own_kernels`) against it."""
    return own_kernels(precision) is None and compile_wanted(setting, precision.device)


def compile_wanted(setting, device: torch.device) -> bool:
    """auto (or null): compiled on CUDA, eager elsewhere; true / false as said."""
    if setting in (None, "auto"):
        return device.type == "cuda"
    return bool(setting)


class _RecompileLimitHits(logging.Handler):
    """Counts dynamo's 'hit config.recompile_limit' warnings: past the limit a function runs eagerly, silently."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.functions: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if str(record.msg).startswith("torch._dynamo hit config."):
            self.functions.append(str(record.args[2]) if len(record.args or ()) > 2 else "?")


def dynamo_graphs() -> int:
    """Graphs dynamo has compiled in this process so far: the step's, and any other code's (torchao's low-bit
    optimisers compile their update on its first call with each shape)."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


class CompiledStep:
    """`loss = step(model, batch)`: the forward and the loss, compiled when asked (compile_wanted). A distributed
    cell's step is not compiled whole (dynamo breaks its graph at FSDP's hooks): its blocks are, one by one, before
    they are wrapped (bench.running.parallel.wrap), and this step only counts what they compiled (`per_block`)."""

    def __init__(self, setting, device: torch.device, forward_and_loss: Callable, eager_because: str | None = None,
                 per_block: bool = False):
        """`eager_because`: a reason the step runs eagerly whatever the setting (the cell's own compiled kernels)."""
        self.requested = "auto" if setting is None else setting
        self.watching = eager_because is None and compile_wanted(setting, device)
        self.per_block = self.watching and per_block
        self.enabled = self.watching and not per_block
        self.eager_because: str | None = None if self.watching else \
            eager_because or f"train.compile={self.requested} on {device.type}"
        self._eager = forward_and_loss
        self._compiled = None
        self.compiled_now = False  # whether dynamo compiled during the last call
        if self.watching:
            from torch._dynamo.utils import counters

            torch._dynamo.reset()  # a fresh cache per cell: guards on the last cell's model would fill it
            counters.clear()  # graph breaks counted per cell
            if self.enabled:
                self._compiled = torch.compile(forward_and_loss, backend=BACKEND, mode=MODE)
            self._graphs = dynamo_graphs()
            self._limit_hits = _RecompileLimitHits()
            logging.getLogger("torch._dynamo.convert_frame").addHandler(self._limit_hits)

    @classmethod
    def for_task(cls, setting, device: torch.device, task, precision, per_block: bool = False) -> "CompiledStep":
        """The step of `task` under `precision`: its forward, then its loss."""
        def forward_and_loss(model, batch):
            outputs, targets = task.forward(model, batch, precision.inputs)
            return task.compute_loss(outputs, targets)

        return cls(setting, device, forward_and_loss, own_kernels(precision), per_block)

    def __call__(self, model, batch, eager: bool = False):
        self.compiled_now = False
        if self._compiled is None or eager:
            with torch.compiler.set_stance("force_eager") if eager and self.per_block else contextlib.nullcontext():
                loss = self._eager(model, batch)  # compiled blocks run eagerly where the step is to (the memory count)
        else:
            try:
                loss = self._compiled(model, batch)
            except Exception as e:  # under auto any compile failure means: run eagerly, say why
                self.fall_back(e)
                return self._eager(model, batch)
        if self.watching:
            graphs = dynamo_graphs()
            self.compiled_now, self._graphs = graphs != self._graphs, graphs  # the first step, or a recompile
        return loss

    def fall_back(self, error: Exception) -> None:
        """Run eagerly from now on because compiling failed with `error` (the forward's compile here, or the
        backward's, which AOTAutograd compiles at the step's first backward); under train.compile=true, raise it."""
        if self.requested is True:
            raise error
        self.eager_because = error_line(error)
        self._compiled = None

    def describe(self) -> dict:
        """The record's env.compile (the compile steps and their time are in timing.compile)."""
        from torch._dynamo.utils import counters

        reasons: dict[str, int] = {}
        for reason, count in (counters["graph_break"] if self.watching else {}).items():
            first_line = reason.strip().splitlines()[0][:200]  # dynamo's reasons run on with hints and links
            reasons[first_line] = reasons.get(first_line, 0) + count
        limit_hits = []
        if self.watching:
            logging.getLogger("torch._dynamo.convert_frame").removeHandler(self._limit_hits)
            limit_hits = sorted(set(self._limit_hits.functions))
        return {"requested": self.requested, "compiled": self._compiled is not None or self.per_block,
                "per_block": self.per_block, "graphs": dynamo_graphs() if self.watching else 0,
                "eager_because": self.eager_because,
                "backend": BACKEND if self.watching else None,
                "mode": MODE if self.watching else None, "graph_breaks": sum(reasons.values()),
                "graph_break_reasons": dict(sorted(reasons.items(), key=lambda kv: -kv[1])[:5]),
                "recompile_limit_hit_by": limit_hits}  # functions that ran eagerly past dynamo's limit
