"""Scaling methods. Loss scalers (none / static / dynamic) share one small protocol; per-tensor
scaling is a cast policy (`PerTensorScale`, used by the precision sites); unit scaling is a model
transform (bench/unit.py).

`LossScaler` follows torch.amp.GradScaler's semantics step for step (tests check it against
GradScaler itself) but is our own because GradScaler cannot express a static scale (it refuses
growth/backoff factors of 1) and refuses to unscale 16-bit gradients, which "true" runs have.
"""

from __future__ import annotations

import math
from collections import defaultdict, deque

import torch

from bench.formats import ElementFormat

LOSS_SCALING = ("none", "static", "dynamic")
SCALING_METHODS = ("none", "static", "dynamic", "per_tensor", "unit")
AMAX_MODES = ("current", "delayed")


def _float32(value: float) -> float:
    """GradScaler keeps its scale in a float32 tensor; round our Python float the same way."""
    return torch.tensor(value, dtype=torch.float32).item()


class LossScaler:
    """Scale the loss, unscale and check the gradients, step or skip, update the scale.

    kind="none": scale 1, never skips (a non-finite gradient is still counted as an overflow step, on the
      steps the loop asks to be checked: its telemetry-sampled ones);
    kind="static": fixed scale, a step whose unscaled gradients hold inf/NaN is skipped and counted
      (MindSpore's FixedLossScaleManager with drop_overflow_update=True);
    kind="dynamic": GradScaler: skip and multiply by backoff_factor on inf/NaN, multiply by
      growth_factor after growth_interval clean steps in a row.
    """

    def __init__(self, kind: str = "none", init_scale: float = 1.0, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000, loss_multiplier: float = 1.0):
        """loss_multiplier: a fixed factor on the loss that unscaling divides out again, so it changes only
        what the low-precision backward sees (train.loss_multiplier, a numerics stress test)."""
        if kind not in LOSS_SCALING:
            raise ValueError(f"unknown loss scaling {kind!r}; valid: {', '.join(LOSS_SCALING)}")
        self.kind = kind
        self.loss_multiplier = loss_multiplier
        self.scale = _float32(1.0 if kind == "none" else init_scale)
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval
        self._clean_steps = 0
        self._device_flags: dict = {}
        self.steps = 0
        self.checked_steps = 0  # steps whose gradients were checked for inf/NaN
        self.skipped_steps = 0
        self.overflow_steps = 0
        self.history: list[list] = [[0, self.scale]]  # [step, scale] at every change

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        factor = self.scale * self.loss_multiplier
        return loss if factor == 1.0 else loss * factor

    def _flags(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per device, reused every step: found_inf, 1/(scale * multiplier), and an on-device overflow count."""
        if device not in self._device_flags:
            self._device_flags[device] = (torch.zeros(1, device=device), torch.ones(1, device=device),
                                          torch.zeros(1, device=device))
        found_inf, inv_scale, count = self._device_flags[device]
        inv_scale.fill_(1.0 / (self.scale * self.loss_multiplier))
        found_inf.zero_()
        return found_inf, inv_scale, count

    def unscale_(self, params) -> bool:
        """Divide gradients by the scale in place and flag inf/NaN (GradScaler's fused kernel).

        As GradScaler, one found_inf flag per device is shared by that device's dtype groups, so a step
        is flagged once however many groups hold inf/NaN. Returns whether any gradient did. Under
        kind="none" nothing depends on the answer during training, so the step is counted on the device
        instead and read once, in state(): no host sync.
        """
        groups: dict = defaultdict(lambda: defaultdict(list))
        for p in params:
            if p.grad is not None:
                groups[p.grad.device][p.grad.dtype].append(p.grad)
        flags = []
        for device, by_dtype in groups.items():
            found_inf, inv_scale, _ = self._flags(device)
            for grads in by_dtype.values():
                torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)
            flags.append(found_inf)
        if not flags:
            return False
        if self.kind == "none":
            count = self._device_flags[flags[0].device][2]
            count.add_(flags[0] if len(flags) == 1 else torch.stack([f.to(count.device) for f in flags]).amax(0))
            return False
        return any(bool(f.item()) for f in flags)

    def step(self, optimizer: torch.optim.Optimizer, params, check: bool = True) -> bool:
        """Unscale, check, then step or skip; update the scale. Returns whether the optimiser stepped.

        check=False is honoured only under kind="none", where nothing depends on the check: the loop
        checks on its telemetry-sampled steps only (the check costs ~70 us per step on LeNet on CPU).
        """
        if self.kind == "none" and not check and self.loss_multiplier == 1.0:
            optimizer.step()
            self.update(False)
            return True
        self.checked_steps += 1
        found_inf = self.unscale_(params)
        self.overflow_steps += found_inf
        skip = found_inf and self.kind != "none"
        if skip:
            self.skipped_steps += 1
        else:
            optimizer.step()
        self.update(found_inf)
        return not skip

    def update(self, found_inf: bool) -> None:
        self.steps += 1
        if self.kind != "dynamic":
            return
        old = self.scale
        if found_inf:
            self.scale = _float32(self.scale * self.backoff_factor)
            self._clean_steps = 0
        else:
            self._clean_steps += 1
            if self._clean_steps == self.growth_interval:
                grown = _float32(self.scale * self.growth_factor)
                if math.isfinite(grown):
                    self.scale = grown
                self._clean_steps = 0
        if self.scale != old:
            self.history.append([self.steps, self.scale])

    def state_dict(self) -> dict:
        """Plain values for a checkpoint (the on-device overflow count folded in)."""
        plain = {k: v for k, v in self.__dict__.items() if k != "_device_flags"}
        return plain | {"overflow_steps": self.state()["overflow_steps"]}

    def load_state_dict(self, state: dict) -> None:
        self.__dict__.update(state)
        self._device_flags = {}

    def state(self) -> dict:
        """The record's loss-scale fields."""
        scales = [s for _, s in self.history]
        counted_on_device = sum(int(count.item()) for _, _, count in self._device_flags.values()) \
            if self.kind == "none" else 0
        return {
            "loss_scaling": self.kind,
            "skipped_steps": self.skipped_steps,
            "overflow_steps": self.overflow_steps + counted_on_device,
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

    @torch.no_grad()
    def scale_for(self, x: torch.Tensor) -> torch.Tensor:
        current = x.detach().abs().amax().float()
        if self.amax_mode == "delayed" and self.history:
            amax = torch.stack(list(self.history)).amax()
        else:
            amax = current
        self.history.append(current)
        usable = torch.isfinite(amax) & (amax > 0)
        scale = torch.where(usable, self.target / amax / 2.0**self.margin, torch.ones_like(amax))
        if self.pow2:
            scale = torch.exp2(torch.floor(torch.log2(scale)))
        if self.on_scale is not None:
            self.on_scale(amax, scale)
        return scale
