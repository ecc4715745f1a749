"""What scaling methods (bench/numerics/scaling_methods.py) scale with: loss scalers (none / static / dynamic) share
one small protocol (`LossScaler`); per-tensor scaling is a cast policy (`PerTensorScale`, used by the precision's
rounding sites).

`LossScaler` follows torch.amp.GradScaler's semantics step for step, with GradScaler's own kernels
(tests check it against GradScaler itself), but is our own because GradScaler cannot express a static
scale (it refuses growth/backoff factors of 1), refuses to unscale 16-bit gradients, which "true" runs
have, and reads found_inf on the host every step unless the optimiser is fused.
"""

from __future__ import annotations

import copy
import functools
import inspect
from collections import defaultdict, deque

import torch
import torch.distributed as dist

from bench.numerics.dtensors import is_dtensor
from bench.numerics.formats import ElementFormat, tensor_amax_of
from bench.numerics.readings import Readings

LOSS_SCALING = ("none", "static", "dynamic")
AMAX_MODES = ("current", "delayed")


def _float32(value: float) -> float:
    """GradScaler keeps its scale in a float32 tensor; round our Python float the same way."""
    return torch.tensor(value, dtype=torch.float32).item()


@functools.cache
def _takes_found_inf(optimizer_class: type) -> bool:
    """Whether the optimiser's step skips itself on a found_inf flag (torch_xla's sync-free ones); asked once
    a class."""
    return "found_inf" in inspect.signature(optimizer_class.step).parameters


class LossScaler:
    """Scale the loss, unscale and check the gradients, step or skip, update the scale, all on the device.

    kind="none": scale 1, never skips (a non-finite gradient is still counted as an overflow step, on the
      steps the loop asks to be checked: its telemetry-sampled ones);
    kind="static": fixed scale, a step whose unscaled gradients hold inf/NaN is skipped and counted
      (MindSpore's FixedLossScaleManager with drop_overflow_update=True);
    kind="dynamic": GradScaler: skip and multiply by backoff_factor on inf/NaN, multiply by
      growth_factor after growth_interval clean steps in a row.
    Another rule is a subclass overriding `update_scale` (docs/extending.md: DeepSpeed's hysteresis).

    No step waits for the device: the scale and growth tracker live there (GradScaler's
    `_amp_update_scale_`), the skip happens inside the optimiser's fused kernel (its `found_inf`, as
    GradScaler passes it), and each checked step leaves a (found_inf, scale) pair on the device that
    `sync()` reads in one transfer, at log steps, checkpoints and the end. The host-side counters and
    `scale` are exact after `sync()`. An optimiser without the fused kernel's `found_inf` falls back to
    GradScaler's own host read of found_inf on each checked step.
    """

    def __init__(self, kind: str = "none", init_scale: float = 1.0, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000, loss_multiplier: float = 1.0,
                 max_grad_norm: float | None = None, reads_every: int = 16):
        """loss_multiplier: a fixed factor on the loss that unscaling divides out again, so it changes only
        what the low-precision backward sees (train.loss_multiplier, a numerics stress test).
        max_grad_norm: clip the unscaled gradients' global norm before the step (torch's clip_grad_norm_, which
        computes on the device), as GradScaler's users do between unscale_ and step.
        reads_every: about how many checked steps pass between two `sync()`s (the loop's log_every): the size of
        the window their flags wait in on the device (bench/numerics/readings.py)."""
        if kind not in LOSS_SCALING:
            raise ValueError(f"unknown loss scaling {kind!r}; valid: {', '.join(LOSS_SCALING)}")
        self.kind = kind
        self.loss_multiplier = loss_multiplier
        self.max_grad_norm = max_grad_norm
        self.scale = _float32(1.0 if kind == "none" else init_scale)
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval
        self._clean_steps = 0
        self._on_device: dict | None = None  # scale, growth tracker, inv_scale, found_inf: made at first use
        self._unread: list[int] = []  # checked steps whose [found_inf, scale] are in _readings, not yet read
        self._readings = Readings(reads_every, 2)
        self.steps = 0
        self.checked_steps = 0  # steps whose gradients were checked for inf/NaN
        self.skipped_steps = 0
        self.overflow_steps = 0
        self.last_step_skipped = False  # as of the last sync()
        self.history: list[list] = [[0, self.scale]]  # [step, scale] at every change

    def _tensors(self, device: torch.device) -> dict:
        if self._on_device is None:
            scale = torch.full((), self.scale, dtype=torch.float32, device=device)
            self._on_device = {"scale": scale,
                               "growth_tracker": torch.full((), self._clean_steps, dtype=torch.int32, device=device),
                               "found_inf": torch.zeros((), device=device), "inv_scale": None}
        return self._on_device

    def _inv_scale(self, tensors: dict) -> torch.Tensor:
        """1 / (scale * multiplier) in FP64 then FP32, as GradScaler; from the scale as it is now, whatever rule
        changed it (one scalar op on the device a checked step)."""
        tensors["inv_scale"] = (tensors["scale"].double() * self.loss_multiplier).reciprocal().float()
        return tensors["inv_scale"]

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        if self.kind == "none" and self.loss_multiplier == 1.0:
            return loss
        scale = self._tensors(loss.device)["scale"]
        return loss * (scale if self.loss_multiplier == 1.0 else scale * self.loss_multiplier)

    def _unscale(self, params) -> torch.Tensor | None:
        """Divide gradients by the scale in place and flag inf/NaN (GradScaler's fused kernel).

        As GradScaler, one found_inf flag is shared by the dtype groups, so a step is flagged once however
        many groups hold inf/NaN. None when no parameter has a gradient.
        """
        groups: dict = defaultdict(list)
        for p in params:
            if p.grad is not None:
                groups[p.grad.dtype].append(p.grad)
        if not groups:
            return None
        tensors = self._tensors(next(iter(groups.values()))[0].device)
        found_inf, inv_scale = tensors["found_inf"], self._inv_scale(tensors)
        found_inf.zero_()
        for dtype, grads in groups.items():
            if grads[0].device.type == "xla" and dtype != torch.float32:
                # XLA lowers the fused kernel to a multiply of the 16-bit gradient by the FP32 scale, which its HLO
                # verifier refuses ("mixed precision is disallowed"): the same check, and the same product in the
                # gradient's dtype (the inverse of a power-of-two scale is exact there)
                for g in grads:
                    found_inf.copy_(torch.maximum(found_inf, (~torch.isfinite(g)).any().float()))
                    g.mul_(inv_scale.to(dtype))
                continue
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)
        sharded = next((g for grads in groups.values() for g in grads if is_dtensor(g)), None)
        if sharded is not None:  # FSDP2: each rank checked its shards; a step is skipped on every rank or none
            dist.all_reduce(found_inf, group=sharded.device_mesh.get_group())  # as torch's ShardedGradScaler
        return found_inf

    def step(self, optimizer: torch.optim.Optimizer, params, check: bool = True) -> None:
        """Unscale, check, then step or skip; update the scale. What happened is read by `sync()`.

        check=False is honoured only under kind="none", where nothing depends on the check: the loop
        checks on its telemetry-sampled steps only (the check costs ~70 us per step on LeNet on CPU).
        """
        self.steps += 1
        if self.kind == "none" and not check and self.loss_multiplier == 1.0:
            self._clip(params)
            optimizer.step()
            return
        found_inf = self._unscale(params)
        self._clip(params)
        if found_inf is None:
            optimizer.step()
            return
        self.checked_steps += 1
        if self.kind == "none":
            optimizer.step()
        elif _takes_found_inf(type(optimizer)):  # torch_xla's sync-free optimisers
            optimizer.step(found_inf=found_inf)
        elif getattr(optimizer, "_step_supports_amp_scaling", False):  # a fused kernel skips on found_inf
            optimizer.grad_scale, optimizer.found_inf = None, found_inf
            optimizer.step()
            del optimizer.grad_scale, optimizer.found_inf
        elif not found_inf.item():  # no fused kernel: GradScaler's host read (a sync on accelerators)
            optimizer.step()
        tensors = self._on_device
        if self.kind != "none":
            self.update_scale(tensors["scale"], tensors["growth_tracker"], found_inf)
        self._unread.append(self.steps)
        self._readings.push(torch.stack([found_inf, tensors["scale"]]))

    def update_scale(self, scale: torch.Tensor, growth_tracker: torch.Tensor, found_inf: torch.Tensor) -> None:
        """The loss-scale rule, called on the device after every checked step of kind static or dynamic.

        found_inf: 1.0 where this step's unscaled gradients held inf or NaN (the step was skipped), else 0.0.
        scale: the FP32 loss scale, to change in place; the next step scales its loss by it and unscales by it.
        growth_tracker: an int32 counter the rule may use as it likes (GradScaler's: clean steps in a row); it is
        checkpointed with the scaler. State of your own: device tensors made on first call, like it.
        Tensor operations only: a host read here (`.item()`, `if found_inf:`) would wait for the device every step.
        The default: GradScaler's rule for `dynamic`, the scale left alone for `static`."""
        if self.kind == "dynamic":
            torch._amp_update_scale_(scale, growth_tracker, found_inf, self.growth_factor, self.backoff_factor,
                                     self.growth_interval)

    def _clip(self, params) -> None:
        if self.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm, foreach=True)

    def sync(self) -> None:
        """Fold the checked steps since the last sync into the counters and the scale history (one read)."""
        if not self._unread:
            return
        steps, rows = self._unread, self._readings.read()
        self._unread = []
        for step, (found_inf, scale) in zip(steps, rows):
            self.overflow_steps += found_inf > 0
            self.last_step_skipped = found_inf > 0 and self.kind != "none"
            self.skipped_steps += self.last_step_skipped
            if scale != self.scale:
                self.scale = scale
                self.history.append([step, scale])

    def state_dict(self) -> dict:
        """Plain values for a checkpoint, read from the device."""
        self.sync()
        if self._on_device is not None:
            self._clean_steps = int(self._on_device["growth_tracker"].item())
        return copy.deepcopy({k: v for k, v in self.__dict__.items()
                              if k not in ("_on_device", "_unread", "_readings")})

    def load_state_dict(self, state: dict) -> None:
        self.__dict__.update(state)
        self._on_device, self._unread, self._readings = None, [], Readings(self._readings.length, 2)

    def state(self) -> dict:
        """The record's loss-scale fields."""
        self.sync()
        scales = [s for _, s in self.history]
        return {
            "loss_scaling": self.kind,
            "skipped_steps": self.skipped_steps,
            "overflow_steps": self.overflow_steps,
            "overflow_checked_steps": self.checked_steps,
            "final_loss_scale": self.scale,
            "loss_scale": {"min": min(scales), "max": max(scales), "changes": len(self.history) - 1,
                           "history": self.history[-200:]},
        }


class PerTensorScale:
    """s = (fmt.max / amax) / 2^margin for one tensor stream, with amax current or delayed.

    current: amax of the tensor being cast (torchao's tensorwise dynamic scaling).
    delayed: max over the amaxes of the last `history_len` casts, this one excluded once a history
      exists (Transformer Engine's DelayedScaling); the first cast uses its own amax.
    pow2: round s down to a power of two, so scaling itself adds no rounding error.
    Formats with FP32's exponent range (bf16, tf32) map amax to 2^64 instead of their max (~3.4e38):
    scaling to their max would overflow FP32 arithmetic itself, and 2^64 is as far from underflow.
    """

    WIDE_TARGET = 2.0**64

    def __init__(self, spec: ElementFormat, amax: str = "current", history_len: int = 16, margin: int = 0,
                 pow2: bool = False, on_scale=None):
        if amax not in AMAX_MODES:
            raise ValueError(f"unknown scaling.amax {amax!r}; valid: {', '.join(AMAX_MODES)}")
        self.spec, self.amax_mode, self.margin, self.pow2 = spec, amax, margin, pow2
        self.target = min(spec.max, self.WIDE_TARGET)
        self.history: deque[torch.Tensor] = deque(maxlen=history_len)
        self.on_scale = on_scale  # telemetry callback (amax, scale)
        self.recording = True  # off while the cell evaluates: an evaluation's amaxes never enter the history

    @torch.no_grad()
    def scale_for(self, x: torch.Tensor) -> torch.Tensor:
        current = tensor_amax_of(x).float()
        if self.amax_mode == "delayed" and self.history:
            amax = torch.stack(list(self.history)).max()
        else:
            amax = current
        if self.recording:
            self.history.append(current)
        usable = torch.isfinite(amax) & (amax > 0)
        scale = torch.where(usable, self.target / amax / 2.0**self.margin, torch.ones_like(amax))
        if self.pow2:
            scale = torch.exp2(torch.floor(torch.log2(scale)))
        if self.on_scale is not None:
            self.on_scale(amax, scale)
        return scale
