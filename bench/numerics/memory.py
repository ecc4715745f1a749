"""What a training step holds, by category, in the bytes the format stores it in (the record's `memory.step`).

A process's peak resident set says little about a format on CPU (mostly the Python/torch runtime) and an
emulated run holds FP32 everywhere, so the suite also counts, on the run's first real training step:
- parameters, their gradients and the optimiser state, as stored;
- every tensor autograd saves for backward during the forward pass (torch.autograd.graph.saved_tensors_hooks),
  each storage once, parameters excluded (they are counted above); low-precision copies of weights that a
  kernel saves (autocast's weight cache, FP8 weight casts) are reported apart as `weight_copies`. A tensor
  counts its own elements; views of one storage count once, at the largest.

Native runs count every tensor at its own dtype (torchao's float8 tensors at their FP8 data plus scale).
Emulated runs hold FP32 tensors carrying the format's values; each is counted at the width a native run
would store it in:
- parameters, gradients and optimiser state: the format's width in "true" modes, FP32 in mixed modes;
- a saved tensor a rounding site produced: its element format's storage width, except weights in true mode,
  which are the parameters themselves (a native true run saves the parameter, not a copy);
- a rounding that changed nothing (the input was already in the format), or whose format lives in the input's
  storage (TF32 in FP32), stands for its input: a native kernel reads such an input as it is, so the tensor is
  counted once;
- with 16-bit kernels and no per-tensor scales, a saved FP32 tensor on the model's differentiable path whose
  every value is a 16-bit value (ReLU or max-pool of a 16-bit output): 16 bits, as a native run computes it; so
  too BF16's values that emulated ops hand one another in FP32 tensors (format.elsewhere=bf16, Precision.carried);
- anything else (integer indices, FP32 losses, the output of an FP32 elementwise op): its own size.
tests/test_memory.py checks that this model of an emulated bf16 run equals the measured bytes of the native
bf16 run, category by category. The categories' sum bounds the step's peak from above: backward frees saved
tensors while gradients fill.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch
from torch import nn

from bench.numerics.dtensors import is_dtensor
from bench.numerics.formats import FORMATS, quantise_value


def _float8_parts(t: torch.Tensor) -> list[torch.Tensor] | None:
    """torchao's float8 training tensors carry their FP8 data and scale as attributes."""
    if type(t) is not torch.Tensor and hasattr(t, "_data") and hasattr(t, "_scale"):
        return [t._data, t._scale]
    return None


def _storage_key(t: torch.Tensor) -> int:
    """What identifies the memory `t` lives in: its storage (a tensor subclass's, such as FSDP2's sharded DTensor
    parameters: its first inner tensor's, down to a plain one); on XLA, whose lazy tensors have none, the tensor a
    view was taken of (within the counted forward, autograd holds every saved tensor, so no id is reused)."""
    parts = _float8_parts(t) or _state_parts(t)
    if parts:  # maybe a subclass again: a DTensor's shard of torchao's FP8-gathered weight
        return _storage_key(parts[0])
    if t.device.type == "xla":
        return id(t._base if t._base is not None else t)
    return t.untyped_storage().data_ptr()


def _state_parts(t: torch.Tensor) -> list[torch.Tensor] | None:
    """A tensor subclass's inner tensors (torchao's low-bit optimiser states: codes, block scales, code book), which
    are what it holds: its own dtype is the FP32 it stands for."""
    if type(t) is torch.Tensor or not hasattr(t, "__tensor_flatten__"):
        return None
    names, _ = t.__tensor_flatten__()
    return [part for part in (getattr(t, name) for name in names) if torch.is_tensor(part)]  # a DTensor's: its shard


def _held_bytes(t: torch.Tensor, stored_format=None) -> float:
    """The bytes a parameter, gradient or optimiser state holds: FSDP2's DTensor, this rank's shard as the run holds
    it; a low-bit state, its parts; a floating tensor in `stored_format` where given (its values stand for that)."""
    if is_dtensor(t):
        return _held_bytes(t.to_local(), stored_format)
    if (parts := _state_parts(t)) is not None:
        return sum(p.numel() * p.element_size() for p in parts)
    if stored_format is not None and t.is_floating_point() and t.dim() > 0:
        return t.numel() * stored_format.storage_bytes
    return t.numel() * t.element_size()


def _own_bytes(t: torch.Tensor) -> int:
    """The tensor's own elements (a view of a larger buffer, such as a batch sliced from its dataset, holds only
    those for the step's sake)."""
    parts = _float8_parts(t)
    return sum(p.numel() * p.element_size() for p in parts) if parts else t.numel() * t.element_size()


class SiteOutput(NamedTuple):
    """What an emulated rounding site made, as a native kernel would hold it."""

    tensor_class: str
    fmt: str
    output: torch.Tensor  # held, so that no other tensor takes its address within the step
    reads_input: torch.Tensor | None  # the input, when a native kernel would read it as it is (no copy)


class StepMemory:
    """Counts one training step: enter `saving()` around the forward pass, call `finish()` after the optimiser
    step for the bytes per category and their total."""

    def __init__(self, model: nn.Module, precision, master_weights: str = "fp32"):
        self.model, self.precision = model, precision
        # FSDP2's parameters are DTensors: each rank holds (and compares against) its shard
        self.params = {_storage_key(p): p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()}
        self.saved: dict[int, tuple[str, float]] = {}  # storage -> (category, bytes)
        self.made: dict[int, SiteOutput] = {}  # storage -> what a rounding site made there (emulated runs)
        emulated = not precision.native and precision.recipe is not None
        self.stored_format = FORMATS[precision.recipe.inputs] if emulated and precision.mode == "true" else None
        # BF16 master weights (bench/numerics/master_weights.py): parameters and gradients held in two bytes
        self.parameter_format = FORMATS["bf16"] if master_weights != "fp32" else self.stored_format
        self.sixteen_bit_values = (FORMATS[precision.recipe.inputs] if emulated and precision.recipe.sixteen_bit_kernel
                                   and not precision.plan.site_scales else FORMATS["bf16"] if precision.carried
                                   else None)

    @contextlib.contextmanager
    def saving(self):
        """Around the forward pass: record what autograd saves, and (emulated) what the rounding sites make."""
        self.precision.site_listener = None if self.precision.native else self._site_made
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
                yield
        finally:
            self.precision.site_listener = None
            self.made.clear()

    def _site_made(self, x: torch.Tensor, rounded: torch.Tensor, tensor_class: str, fmt: str) -> None:
        """A native kernel reads an input as it is when the input is already in its format (its values, or its
        torch dtype: a BF16 tensor entering an emulated BF16 GEMM, bench/numerics/autocast.py), or when the format
        lives in the input's storage (TF32 in FP32): then the output stands for the input (no copy)."""
        in_place = x.dtype == FORMATS[fmt].torch_dtype or rounded.dtype == x.dtype and (
            FORMATS[fmt].storage_bytes == x.element_size() or torch.equal(rounded, x))
        self.made[_storage_key(rounded)] = SiteOutput(tensor_class, fmt, rounded, x if in_place else None)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        key = _storage_key(t)
        site = self.made.get(key)
        if site is not None and site.reads_input is not None:
            key = _storage_key(site.reads_input)  # natively, the input itself is saved
        true_mode_weight = site is not None and site.tensor_class == "weights" and self.precision.mode == "true"
        if key in self.params or true_mode_weight:
            return t  # a parameter, counted as one (a native true run's kernels read the 16-bit parameter itself)
        category, size = self._classify(t, site)
        if key in self.saved:  # another view of a storage already counted: the larger view counts
            category, size = max(self.saved[key], (category, size), key=lambda entry: entry[1])
        self.saved[key] = (category, size)
        return t

    def _classify(self, t: torch.Tensor, site: SiteOutput | None) -> tuple[str, float]:
        if site is not None:  # emulated: a rounding site made it
            category = "weight_copies" if site.tensor_class == "weights" else "activations"
            return category, t.numel() * FORMATS[site.fmt].storage_bytes
        if self.sixteen_bit_values is not None and t.dtype == torch.float32 and t.grad_fn is not None \
                and torch.equal(quantise_value(t, self.sixteen_bit_values), t):
            return "activations", t.numel() * self.sixteen_bit_values.storage_bytes
        category = "weight_copies" if self._is_weight_copy(t) else "activations"
        return category, float(_own_bytes(t))

    def _is_weight_copy(self, t: torch.Tensor) -> bool:
        """Native: a saved tensor of a parameter's shape (or its transpose) holding its values in another dtype."""
        if _float8_parts(t):
            return any(tuple(t.shape) in (tuple(p.shape), tuple(p.shape[::-1])) for p in self.params.values())
        for p in self.params.values():
            for view in (p, p.t()) if p.dim() == 2 else (p,):
                if t.dtype != p.dtype and t.shape == view.shape and torch.equal(t, view.detach().to(t.dtype)):
                    return True
        return False

    def _stored(self, tensors, stored_format=None) -> float:
        """Bytes of parameters, gradients or optimiser state as the run stores them (`stored_format`: the type
        floating-point tensors are held in, where not their own)."""
        return sum(_held_bytes(t, stored_format) for t in tensors)

    def finish(self, optimizer: torch.optim.Optimizer) -> dict:
        params = list(self.model.parameters())
        state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
        breakdown = {"parameters": self._stored(params, self.parameter_format),
                     "gradients": self._stored((p.grad for p in params if p.grad is not None), self.parameter_format),
                     "optimizer_state": self._stored(state, self.stored_format), "weight_copies": 0.0,
                     "activations": 0.0}
        for category, size in self.saved.values():
            breakdown[category] += size
        self.saved.clear()
        return {k: int(v) for k, v in breakdown.items()} | {"total": int(sum(breakdown.values()))}
