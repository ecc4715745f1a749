"""Numerics telemetry: what quantisation did to each class of tensor, sampled on some steps.

Counts stay on the device as tensors while a step runs (no host sync per op) and are read once
per sampled step. The three classes are the tensors a low-precision matmul/conv sees:
`weights` and `activations` entering it in the forward pass, `gradients` in the backward pass.
Block-scaled operands (block formats, FP8 rowwise/block) add block statistics (BLOCK_FIELDS).
"""

from __future__ import annotations

import functools
from typing import Callable

import torch

from bench.numerics.formats import ElementFormat
from bench.numerics.fused import ARITHMETIC_FROM, fused

TENSOR_CLASSES = ("weights", "activations", "gradients")
_COUNTS = ("total", "underflow", "subnormal", "overflow")
CATEGORIES = ("zero", "underflow", "subnormal", "normal", "overflow")
# per class, over the block-scaled GEMM operands of the sampled steps
_BLOCK_SUMS = ("blocks", "clipped_blocks", "nonzero", "flushed", "squared_error", "squared_value")
BLOCK_FIELDS = ("clipped_block_fraction",  # blocks whose largest element saturated under the block's scale
                "flushed_fraction",  # non-zero elements that became zero inside their block
                "relative_mse",  # sum of (x - dequantised)^2 over sum of x^2
                "log2_scale_min", "log2_scale_median", "log2_scale_max")  # of the dequantising block factors


@functools.cache
def _edges(spec: ElementFormat) -> tuple[float, ...]:
    """The format's decision points as numbers, computed outside any trace: the first call may come while the fused
    counts are being traced (make_fx), which cannot read a traced tensor's value."""
    from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

    with disable_proxy_modes_tracing():
        return tuple(spec.rounding_edges())


@fused(ARITHMETIC_FROM)
def category_counts(x: torch.Tensor, spec: ElementFormat) -> torch.Tensor:
    """How many values of x rounding to `spec` leaves zero, underflows to zero, lands subnormal, stays
    normal, overflows or is not finite (CATEGORIES order), decided from |x| alone against the format's
    exact RNE decision points, as cumulative counts (int32 sums: the fastest CPU reduction of a mask).
    Fused (bench/numerics/fused.py), its four counts are one pass over x, not four: counts are exact either way."""
    magnitude = x.detach().float().abs()
    at_most = torch.stack([(magnitude <= edge).sum(dtype=torch.int32) for edge in _edges(spec)]).long()
    return torch.diff(at_most, prepend=at_most.new_zeros(1), append=at_most.new_full((1,), x.numel()))


class QuantTelemetry:
    """Underflow / subnormal / overflow counts per tensor class, on the steps where `sampling` is set."""

    def __init__(self):
        self.sampling = False
        self._step = self._zeros()
        self._observed: list | None = None  # while a counted pass runs: (class, tensor, format) its sites observe
        self._observing_of: dict[tuple, tuple] = {}  # per pass run by `counted`: the function it runs, and its list
        self._run = {c: dict.fromkeys(_COUNTS, 0) for c in TENSOR_CLASSES}
        # per class, running bounds of per-tensor scaling's amax and scale: {"amax_min": ..., "amax_max": ..., ...}
        self.bounds: dict[str, dict[str, float]] = {c: {} for c in TENSOR_CLASSES}
        self._step_scales: dict[str, list] = self._zeros()  # per class: [amax, scale] per scaled cast this step
        self._step_blocks: dict[str, list] = self._zeros()  # per class: (sums tensor, log2 factors) per operand
        # per class: the BLOCK_SUMS totals, log2-scale min and max, and each sampled step's median
        self.blocks: dict[str, dict] = {c: {} for c in TENSOR_CLASSES}

    @staticmethod
    def _zeros() -> dict[str, list]:
        return {c: [] for c in TENSOR_CLASSES}

    def observe(self, tensor_class: str, x: torch.Tensor, spec: ElementFormat) -> None:
        """Count what rounding `x` (already scaled, if scaling applies) to `spec` does."""
        if not self.sampling:
            return
        if self._observed is not None:  # a counted pass's: counted after it ran (`counted`)
            self._observed.append((tensor_class, x, spec))
        else:
            self._step[tensor_class].append(category_counts(x, spec))

    def counted(self, run: Callable, key: tuple, body: Callable, x: torch.Tensor, *args) -> tuple:
        """body(x, *args) on a sampled step, a pass (returning a tuple) whose rounding sites observe what they round,
        as `run(key, fn, x, *args)` runs a pass (`fused.Passes.run`: one compiled graph where fused code runs), the
        tensors its sites observe among the graph's outputs (those that are its inputs, as they are): counted after the
        call, each by `category_counts` as an eager pass's site counts it. Run eagerly instead, LeNet FP8's sampled
        step took 1.4 ms more than another; counted inside the graph, inductor fused each count with the kernel
        making its tensor (a max-pool's backward among them) and took 3 ms more (docs/performance.md)."""
        observing, seen = self._observing(run, key, body)
        outputs = run(("counted", *key), observing, x, *args)
        inputs, kept = (x, *args), len(outputs) - sum(at is None for *_, at in seen)
        returned = iter(outputs[kept:])
        for tensor_class, spec, at in seen:
            self._step[tensor_class].append(category_counts(next(returned) if at is None else inputs[at], spec))
        return tuple(outputs[:kept])

    def _observing(self, run: Callable, key: tuple, body: Callable) -> tuple[Callable, list]:
        """body returning, after its own results, each tensor its sites observe but its inputs, and the list of what
        they observe ((class, format, which input or None), in order: known once the pass has been traced or run):
        `counted`'s, one per pass. An input returned would be an output aliasing it, which inductor's graph is not
        called directly with (fused.py)."""
        made = self._observing_of.get((run, key))
        if made is None:
            seen = []

            def observing(x, *args):
                self._observed = []
                try:
                    result = body(x, *args)
                    observed = self._observed
                finally:
                    self._observed = None
                inputs = (x, *args)
                seen[:] = [(tensor_class, spec, next((i for i, a in enumerate(inputs) if a is t), None))
                           for tensor_class, t, spec in observed]
                return (*result, *[t for (_, t, _), (*_, at) in zip(observed, seen) if at is None])
            observing.__name__ = f"observing_{body.__name__}"
            made = self._observing_of[(run, key)] = observing, seen
        return made

    def observe_blocks(self, tensor_class: str, x: torch.Tensor, blocked, spec: ElementFormat) -> None:
        """Block statistics of one block-scaled operand (`blocked`: a bench.numerics.blocks.Blocked of `x`)."""
        if not self.sampling:
            return
        x = x.detach().float()
        finite = blocked.factor.isfinite() & (blocked.factor > 0)
        overflow_edge = spec.rounding_edges()[3]  # past it, an element saturates instead of rounding
        clipped = (blocked.amax > overflow_edge * blocked.factor) & finite
        ok = x.isfinite()
        error = torch.where(ok, x - blocked.values, 0.0)
        sums = torch.stack([torch.tensor(float(blocked.amax.numel()), device=x.device), clipped.sum().float(),
                            ((x != 0) & ok).sum().float(), ((x != 0) & (blocked.values == 0)).sum().float(),
                            (error * error).sum(), torch.where(ok, x * x, 0.0).sum()])
        self._step_blocks[tensor_class].append((sums, torch.log2(blocked.factor[finite]).flatten()))

    def observe_scale(self, tensor_class: str, amax: torch.Tensor, scale: torch.Tensor) -> None:
        """A scaled site's amax and scale (kept on the device; read with the step's counts)."""
        if not self.sampling:
            return
        self._step_scales[tensor_class].append(torch.stack([amax.detach().float(), scale.detach().float()]))

    def _end_step_scales(self) -> None:
        """Fold this step's amaxes and scales into the run's bounds: one read for all classes."""
        classes = [c for c, rows in self._step_scales.items() if rows]
        if not classes:
            return
        per_class = [torch.stack(self._step_scales[c]) for c in classes]
        rows = torch.stack([torch.cat([t.min(0).values, t.max(0).values]) for t in per_class]).tolist()
        for c, (amax_min, scale_min, amax_max, scale_max) in zip(classes, rows):
            bounds = self.bounds[c]
            for name, low, high in (("amax", amax_min, amax_max), ("scale", scale_min, scale_max)):
                bounds[f"{name}_min"] = min(low, bounds.get(f"{name}_min", low))
                bounds[f"{name}_max"] = max(high, bounds.get(f"{name}_max", high))
        self._step_scales = self._zeros()

    def _end_step_blocks(self) -> None:
        """Fold this step's block sums into the run totals: one read for all classes."""
        classes = [c for c, rows in self._step_blocks.items() if rows]
        if not classes:
            return
        per_class = []
        for c in classes:
            sums = torch.stack([s for s, _ in self._step_blocks[c]]).sum(0)
            logs = torch.cat([l for _, l in self._step_blocks[c]])
            bounds = (torch.stack([logs.min(), logs.median(), logs.max()]) if logs.numel()
                      else sums.new_full((3,), float("nan")))
            per_class.append(torch.cat([sums, bounds]))
        for c, row in zip(classes, torch.stack(per_class).tolist()):
            run = self.blocks[c]
            for name, value in zip(_BLOCK_SUMS, row):
                run[name] = run.get(name, 0.0) + value
            low, median, high = row[len(_BLOCK_SUMS):]
            if median == median:  # a step with finite scales
                run["log2_min"] = min(low, run.get("log2_min", low))
                run["log2_max"] = max(high, run.get("log2_max", high))
                run.setdefault("step_medians", []).append(median)
        self._step_blocks = self._zeros()

    def end_step(self) -> dict[str, dict[str, float]]:
        """Fractions for this sampled step, per class with data; folds the counts into the run totals.
        One read from the device per kind of statistic, for all classes."""
        self._end_step_blocks()
        self._end_step_scales()
        classes = [c for c, rows in self._step.items() if rows]
        if not classes:
            return {}
        counts = torch.stack([torch.stack(self._step[c]).sum(0) for c in classes]).tolist()
        fractions = {}
        for c, (zero, underflow, subnormal, normal, overflow) in zip(classes, counts):
            total = zero + underflow + subnormal + normal + overflow
            for name, value in zip(_COUNTS, (total, underflow, subnormal, overflow)):
                self._run[c][name] += int(value)
            fractions[c] = {"underflow": underflow / total, "subnormal": subnormal / total,
                            "overflow": overflow / total}
        self._step = self._zeros()
        return fractions

    def state(self) -> dict:
        """Run totals, for a checkpoint."""
        return {"run": self._run, "bounds": self.bounds, "blocks": self.blocks}

    def load_state(self, state: dict) -> None:
        self._run, self.bounds = state["run"], state["bounds"]
        self.blocks = state.get("blocks", {c: {} for c in TENSOR_CLASSES})

    def summary(self) -> dict[str, dict[str, float] | None]:
        """Run-level fractions per class over all sampled steps (None: the class was never quantised)."""
        out = {}
        for c, counts in self._run.items():
            total = counts["total"]
            out[c] = None if total == 0 else {
                **{f"{name}_fraction": counts[name] / total for name in _COUNTS[1:]},
                "values_sampled": total,
            }
            if self.bounds[c]:
                out[c] = (out[c] or {}) | self.bounds[c]
            if self.blocks[c]:
                out[c] = (out[c] or {}) | {"blocks": _block_summary(self.blocks[c])}
        return out


def _block_summary(run: dict) -> dict:
    """BLOCK_FIELDS from a class's run totals (log2_scale_median: the median of the sampled steps' medians)."""
    medians = sorted(run.get("step_medians", []))
    return {
        "clipped_block_fraction": run["clipped_blocks"] / run["blocks"] if run["blocks"] else None,
        "flushed_fraction": run["flushed"] / run["nonzero"] if run["nonzero"] else None,
        "relative_mse": run["squared_error"] / run["squared_value"] if run["squared_value"] else None,
        "log2_scale_min": run.get("log2_min"),
        "log2_scale_median": medians[len(medians) // 2] if medians else None,
        "log2_scale_max": run.get("log2_max"),
        "blocks_sampled": int(run["blocks"]),
    }
