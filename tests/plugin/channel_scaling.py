"""A user's scaling method, defined outside bench/: each weight scaled per output channel (row) before its cast, so
that every row uses its format's whole range, as FP8 recipes that scale weights per channel do. Activations and
gradients are cast as they are. One class, registered under its name, and conf/scaling/channel_scale.yaml."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bench.errors import ConfigError
from bench.numerics.scaling_methods import ScalingMethod, register


class ChannelScale:
    """s = (max / amax of the row) / 2^margin, one per output channel of a weight [out, in, ...]."""

    def __init__(self, element, margin: int, observe):
        self.target, self.margin, self.observe = element.max, margin, observe
        self.recording = True  # (nothing to pause: the scale has no history)

    @torch.no_grad()
    def scale_for(self, x: torch.Tensor) -> torch.Tensor:
        amax = x.detach().abs().amax(dim=tuple(range(1, x.dim())), keepdim=True).float()
        scale = torch.where(amax > 0, self.target / amax / 2.0**self.margin, torch.ones_like(amax))
        self.observe(amax.max(), scale.min())
        return scale


@register("channel_scale")
class PerChannelWeightScale(ScalingMethod):
    """Weights scaled per output channel; no loss scale unless `loss_scaling` says so."""

    @dataclass
    class Options:  # scaling.options.*
        margin: int = 0  # the headroom, in powers of two, below the format's max

    site_scales = True
    title = "per-channel weight scaling"

    def check(self) -> None:
        super().check()
        if self.options.margin < 0:
            raise ConfigError(f"scaling.options.margin={self.options.margin} must be >= 0")

    def site_scale(self, tensor_class, element, observe):
        return ChannelScale(element, self.options.margin, observe) if tensor_class == "weights" else None
