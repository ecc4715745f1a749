"""Numerics telemetry: what quantisation did to each class of tensor, sampled on some steps.

Counts stay on the device as tensors while a step runs (no host sync per op) and are read once
per sampled step. The three classes are the tensors a low-precision matmul/conv sees:
`weights` and `activations` entering it in the forward pass, `gradients` in the backward pass.
"""

from __future__ import annotations

import functools

import torch

from bench.formats import ElementFormat

TENSOR_CLASSES = ("weights", "activations", "gradients")
_COUNTS = ("total", "underflow", "subnormal", "overflow")
CATEGORIES = ("zero", "underflow", "subnormal", "normal", "overflow")


@functools.cache
def _edges(spec: ElementFormat) -> tuple[float, ...]:
    return tuple(spec.rounding_edges())


def category_counts(x: torch.Tensor, spec: ElementFormat) -> torch.Tensor:
    """How many values of x rounding to `spec` leaves zero, underflows to zero, lands subnormal, stays
    normal, overflows or is not finite (CATEGORIES order), decided from |x| alone against the format's
    exact RNE decision points, as cumulative counts (int32 sums: the fastest CPU reduction of a mask)."""
    magnitude = x.detach().float().abs()
    at_most = torch.stack([(magnitude <= edge).sum(dtype=torch.int32) for edge in _edges(spec)]).long()
    return torch.diff(at_most, prepend=at_most.new_zeros(1), append=at_most.new_full((1,), x.numel()))


class QuantTelemetry:
    """Underflow / subnormal / overflow counts per tensor class, on the steps where `sampling` is set."""

    def __init__(self):
        self.sampling = False
        self._step = self._zeros()
        self._run = {c: dict.fromkeys(_COUNTS, 0) for c in TENSOR_CLASSES}
        # per class, running bounds of per-tensor scaling's amax and scale: {"amax_min": ..., "amax_max": ..., ...}
        self.bounds: dict[str, dict[str, float]] = {c: {} for c in TENSOR_CLASSES}

    @staticmethod
    def _zeros() -> dict[str, list]:
        return {c: [] for c in TENSOR_CLASSES}

    def observe(self, tensor_class: str, x: torch.Tensor, spec: ElementFormat) -> None:
        """Count what rounding `x` (already scaled, if scaling applies) to `spec` does."""
        if not self.sampling:
            return
        self._step[tensor_class].append(category_counts(x, spec))

    def observe_scale(self, tensor_class: str, amax: torch.Tensor, scale: torch.Tensor) -> None:
        if not self.sampling:
            return
        bounds = self.bounds[tensor_class]
        for name, value in (("amax", float(amax)), ("scale", float(scale))):
            bounds[f"{name}_min"] = min(value, bounds.get(f"{name}_min", value))
            bounds[f"{name}_max"] = max(value, bounds.get(f"{name}_max", value))

    def end_step(self) -> dict[str, dict[str, float]]:
        """Fractions for this sampled step, per class with data; folds the counts into the run totals.
        One read from the device for all classes."""
        classes = [c for c, rows in self._step.items() if rows]
        if not classes:
            return {}
        counts = torch.stack([torch.stack(self._step[c]).sum(0) for c in classes]).tolist()
        fractions = {}
        for c, (zero, underflow, subnormal, normal, overflow) in zip(classes, counts):
            total = zero + underflow + subnormal + normal + overflow
            for name, value in zip(_COUNTS, (total, underflow, subnormal, overflow)):
                self._run[c][name] += int(value)
            fractions[c] = {"underflow": underflow / total, "subnormal": subnormal / total, "overflow": overflow / total}
        self._step = self._zeros()
        return fractions

    def state(self) -> dict:
        """Run totals, for a checkpoint."""
        return {"run": self._run, "bounds": self.bounds}

    def load_state(self, state: dict) -> None:
        self._run, self.bounds = state["run"], state["bounds"]

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
        return out
