"""Unit scaling (Blake, Orr, Luschi, "Unit Scaling", ICML 2023) as a model transform.

Every op is scaled so that, at initialisation, its output and its input gradient have unit variance
when its inputs do: weights are initialised N(0, 1), a matmul/conv multiplies its output by
alpha = fan_in^-1/2 in the forward pass and its input gradient by beta = fan_out^-1/2 in the backward
pass, constrained to one shared value by their geometric mean (the paper's rule for ops on the
non-residual path, which keeps forward and backward within sqrt(max/min fan)^1/2 of unit scale);
the weight gradient is scaled by batch^-1/2. Nonlinearities get the paper's fixed factors, and the
loss is unit_scaling's cross-entropy (no 1/batch in the backward pass). No loss scale is needed.

The scale primitives (`scale_fwd`, `scale_bwd`, `scale_elementwise`, `apply_constraint`) and the
cross-entropy come from the `unit-scaling` package; its Linear calls F.linear internally, so the
scaled Linear and the Conv2d it lacks are written here in the same style, with the emulated
precision's rounding sites (`CastOp`) between the scaling and the matmul.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import unit_scaling.functional as U
from torch import nn
from unit_scaling.constraints import apply_constraint
from unit_scaling.core.functional import scale_elementwise
from unit_scaling.scale import scale_bwd, scale_fwd

from bench.precision import CastOp

CONSTRAINT = "gmean"
# ReLU on N(0, 1): output std sqrt(1/2 - 1/(2 pi)) = 0.584 -> x1.713; half the gradients pass -> x sqrt(2).
RELU_SCALES = (1.713, math.sqrt(2.0))


def _unit_init(module: nn.Module) -> None:
    nn.init.normal_(module.weight)
    if module.bias is not None:
        nn.init.zeros_(module.bias)


class UnitLinear(CastOp, nn.Linear):
    """y = alpha * x W^T + b, grad_x * beta, grad_W * batch^-1/2, alpha = beta = (fan_in * fan_out)^-1/4."""

    def reset_parameters(self) -> None:
        _unit_init(self)

    def forward(self, x):
        fan_out, fan_in = self.weight.shape
        output_scale, grad_input_scale = apply_constraint(CONSTRAINT, fan_in**-0.5, fan_out**-0.5)
        grad_weight_scale = (x.numel() // fan_in) ** -0.5
        x = scale_bwd(x, grad_input_scale)
        weight = scale_bwd(self.weight, grad_weight_scale)
        bias = None if self.bias is None else scale_bwd(self.bias, grad_weight_scale)
        return scale_fwd(self.cast_result(F.linear(*self.cast_inputs(x, weight, bias))), output_scale)


class UnitConv2d(CastOp, nn.Conv2d):
    """unit_scaling.functional.conv1d's scales in two dimensions.

    fan_in = C_in/groups * kh * kw; each input pixel receives C_out * kh * kw / (sh * sw) gradient terms;
    the weight gradient sums over batch * H_out * W_out positions.
    """

    def reset_parameters(self) -> None:
        _unit_init(self)

    def forward(self, x):
        out_channels, in_per_group, kh, kw = self.weight.shape
        sh, sw = self.stride
        fan_in = in_per_group * kh * kw
        grad_fan = out_channels * kh * kw / (sh * sw * self.groups)
        output_scale, grad_input_scale = apply_constraint(CONSTRAINT, fan_in**-0.5, grad_fan**-0.5)
        positions = x.shape[0] * math.prod(
            (size + 2 * pad - dil * (k - 1) - 1) // stride + 1
            for size, pad, dil, k, stride in zip(x.shape[-2:], self.padding, self.dilation, (kh, kw), self.stride))
        x = scale_bwd(x, grad_input_scale)
        weight = scale_bwd(self.weight, positions**-0.5)
        bias = None if self.bias is None else scale_bwd(self.bias, positions**-0.5)
        return scale_fwd(self.cast_result(self._conv_forward(*self.cast_inputs(x, weight, bias))), output_scale)


class UnitReLU(nn.ReLU):
    _scaled = staticmethod(scale_elementwise(F.relu, *RELU_SCALES, constraint=None))

    def forward(self, x):
        return self._scaled(x)


class UnitMaxPool2d(nn.MaxPool2d):
    """Each output sends its gradient to one input, so about 1 in (sh * sw) inputs gets one: scale by sqrt(sh * sw).

    The forward pass is left unscaled (the paper gives no rule for max-pooling; the max of a 2x2 window of
    unit normals has std 0.70).
    """

    def forward(self, x):
        sh, sw = nn.modules.utils._pair(self.stride)
        return super().forward(scale_bwd(x, math.sqrt(sh * sw)))


PARAMETER_FREE = (nn.Flatten, nn.Identity, nn.Dropout)


def _unit_module(module: nn.Module) -> nn.Module | None:
    """The unit-scaled replacement of `module` (fresh unit-variance weights), or None to recurse into it."""
    if type(module) is nn.Linear:
        return UnitLinear(module.in_features, module.out_features, module.bias is not None,
                          device=module.weight.device)
    if type(module) is nn.Conv2d:
        if module.padding_mode != "zeros" or isinstance(module.padding, str):
            raise NotImplementedError("unit scaling supports Conv2d with numeric zero padding only")
        return UnitConv2d(module.in_channels, module.out_channels, module.kernel_size, module.stride,
                          module.padding, module.dilation, module.groups, module.bias is not None,
                          device=module.weight.device)
    if type(module) is nn.ReLU:
        return UnitReLU()
    if type(module) is nn.MaxPool2d:
        return UnitMaxPool2d(module.kernel_size, module.stride, module.padding, module.dilation,
                             ceil_mode=module.ceil_mode)
    if isinstance(module, PARAMETER_FREE):
        return module
    if type(module) in (nn.Sequential, nn.ModuleList) or not any(True for _ in module.parameters(recurse=False)):
        return None
    raise NotImplementedError(f"unit scaling has no rule for {type(module).__name__}")


def unit_scale(model: nn.Module) -> nn.Module:
    """Replace, in place, every Linear / Conv2d / ReLU / MaxPool2d by its unit-scaled version (fresh init)."""
    for name, child in model.named_children():
        replacement = _unit_module(child)
        if replacement is None:
            unit_scale(child)
        else:
            setattr(model, name, replacement)
    return model


def unit_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """unit_scaling's cross-entropy: mean loss forward, unit-scale gradient backward (no 1/batch)."""
    return U.cross_entropy(logits, targets)
