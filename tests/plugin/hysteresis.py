"""A user's loss-scale rule, defined outside bench/: DeepSpeed's dynamic loss scale with hysteresis. The scale is
halved only after `hysteresis` overflows in a row (a clean step restores the allowance), and doubled after
`growth_interval` clean steps, as GradScaler does. docs/extending.md, "A loss-scale rule of your own"."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bench.errors import ConfigError
from bench.numerics.scaling import LossScaler
from bench.numerics.scaling_methods import ScalingMethod


class HysteresisScaler(LossScaler):
    """The update rule only: everything else (scaling the loss, unscaling, skipping, the record) is LossScaler's."""

    def __init__(self, *args, hysteresis: int = 2, **kwargs):
        super().__init__(*args, **kwargs)
        self.hysteresis, self.allowance = hysteresis, None  # overflows left before the next halving, on the device

    def update_scale(self, scale: torch.Tensor, growth_tracker: torch.Tensor, found_inf: torch.Tensor) -> None:
        if self.allowance is None:
            self.allowance = torch.full((), self.hysteresis, dtype=torch.int32, device=scale.device)
        overflow = found_inf > 0
        halve = overflow & (self.allowance <= 1)
        grow = ~overflow & (growth_tracker + 1 >= self.growth_interval)
        scale.copy_(torch.where(halve, scale * self.backoff_factor,
                                torch.where(grow, scale * self.growth_factor, scale)))
        growth_tracker.copy_(torch.where(overflow | grow, 0, growth_tracker + 1))
        self.allowance.copy_(torch.where(overflow, torch.clamp(self.allowance - 1, min=1), self.hysteresis))


class Hysteresis(ScalingMethod):
    """Dynamic loss scaling with DeepSpeed's hysteresis."""

    @dataclass
    class Options:  # scaling.options.*
        hysteresis: int = 2  # overflows in a row before the scale is halved

    title = "dynamic loss scaling with hysteresis"

    def check(self) -> None:
        super().check()
        if self.options.hysteresis < 1:
            raise ConfigError(f"scaling.options.hysteresis={self.options.hysteresis} must be >= 1")

    def loss_scaler(self, loss_multiplier: float = 1.0, max_grad_norm: float | None = None,
                    reads_every: int = 16) -> LossScaler:
        k = self.knobs
        return HysteresisScaler("dynamic", k.init_scale, k.growth_factor, k.backoff_factor, k.growth_interval,
                                loss_multiplier=loss_multiplier, max_grad_norm=max_grad_norm,
                                reads_every=reads_every, hysteresis=self.options.hysteresis)
