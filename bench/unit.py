"""Unit scaling (Blake, Orr, Luschi, "Unit Scaling", ICML 2023) as a model transform.

Two uses. From scratch (`preserve=False`): fresh unit-variance weights, every op scaled. A pretrained
checkpoint (`preserve=True`): each matmul's weight is divided by its forward scale alpha, so
alpha * x (W/alpha)^T = x W^T reproduces the pretrained output, and with alpha = beta the input
gradient too; activations keep their forward (scale 1) and scale only their backward; embeddings and
LayerNorm are kept as they are (they stay in higher precision). Residual adds are not re-weighted:
sqrt(1-tau) x + sqrt(tau) f(x) would change the pretrained function. `unit_scale_task` measures how
far the converted model's outputs are from the original on a batch and returns it for the record.

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

import copy
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
# (forward, backward) factors from the paper. ReLU on N(0, 1): output std sqrt(1/2 - 1/(2 pi)) = 0.584
# -> x1.713, half the gradients pass -> x sqrt(2). GELU: 1.701 / 1.481.
ACTIVATION_SCALES = {"relu": (1.713, math.sqrt(2.0)), "gelu": (1.701, 1.481)}
KEPT = (nn.Embedding, nn.LayerNorm)  # forward unchanged, not unit-scaled, higher precision


def _unit_init(module: nn.Module) -> None:
    nn.init.normal_(module.weight)
    if module.bias is not None:
        nn.init.zeros_(module.bias)


def _linear_output_scale(weight: torch.Tensor) -> float:
    fan_out, fan_in = weight.shape
    return apply_constraint(CONSTRAINT, fan_in**-0.5, fan_out**-0.5)[0]


def _conv_scales(weight: torch.Tensor, stride, groups: int) -> tuple[float, float]:
    out_channels, in_per_group, kh, kw = weight.shape
    fan_in = in_per_group * kh * kw
    grad_fan = out_channels * kh * kw / (stride[0] * stride[1] * groups)
    return apply_constraint(CONSTRAINT, fan_in**-0.5, grad_fan**-0.5)


class UnitLinear(CastOp, nn.Linear):
    """y = alpha * x W^T + b, grad_x * beta, grad_W * batch^-1/2, alpha = beta = (fan_in * fan_out)^-1/4."""

    def reset_parameters(self) -> None:
        _unit_init(self)

    def forward(self, x):
        output_scale = grad_input_scale = _linear_output_scale(self.weight)
        grad_weight_scale = (x.numel() // self.in_features) ** -0.5
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
        output_scale, grad_input_scale = _conv_scales(self.weight, self.stride, self.groups)
        positions = x.shape[0] * math.prod(
            (size + 2 * pad - dil * (k - 1) - 1) // stride + 1
            for size, pad, dil, k, stride in zip(x.shape[-2:], self.padding, self.dilation, self.kernel_size,
                                                 self.stride))
        x = scale_bwd(x, grad_input_scale)
        weight = scale_bwd(self.weight, positions**-0.5)
        bias = None if self.bias is None else scale_bwd(self.bias, positions**-0.5)
        return scale_fwd(self.cast_result(self._conv_forward(*self.cast_inputs(x, weight, bias))), output_scale)


class ScaledActivation(nn.Module):
    """f(x) * output_scale forward, gradient * grad_scale backward (unit_scaling's scale_elementwise)."""

    def __init__(self, fn, output_scale: float, grad_scale: float):
        super().__init__()
        self.output_scale, self.grad_scale = output_scale, grad_scale
        self._scaled = scale_elementwise(fn, output_scale, grad_scale, constraint=None)

    def forward(self, x):
        return self._scaled(x)

    def extra_repr(self) -> str:
        return f"output_scale={self.output_scale:.3f}, grad_scale={self.grad_scale:.3f}"


class UnitReLU(ScaledActivation):
    def __init__(self, preserve_forward: bool = False):
        forward, backward = ACTIVATION_SCALES["relu"]
        super().__init__(F.relu, 1.0 if preserve_forward else forward, backward)


class UnitGELU(ScaledActivation):
    def __init__(self, preserve_forward: bool = False):
        forward, backward = ACTIVATION_SCALES["gelu"]
        super().__init__(F.gelu, 1.0 if preserve_forward else forward, backward)


class UnitMaxPool2d(nn.MaxPool2d):
    """Each output sends its gradient to one input, so about 1 in (sh * sw) inputs gets one: scale by sqrt(sh * sw).

    The forward pass is left unscaled (the paper gives no rule for max-pooling; the max of a 2x2 window of
    unit normals has std 0.70).
    """

    def forward(self, x):
        sh, sw = nn.modules.utils._pair(self.stride)
        return super().forward(scale_bwd(x, math.sqrt(sh * sw)))


PARAMETER_FREE = (nn.Flatten, nn.Identity, nn.Dropout, nn.Tanh)


@torch.no_grad()
def _carry_weights(new: nn.Module, old: nn.Module, output_scale: float) -> nn.Module:
    """Pretrained conversion: W' = W / alpha so that alpha * (x W'^T) = x W^T."""
    new.weight.copy_(old.weight / output_scale)
    if old.bias is not None:
        new.bias.copy_(old.bias)
    return new


def _unit_module(module: nn.Module, preserve: bool) -> nn.Module | None:
    """The unit-scaled replacement of `module`, `module` itself where it is kept, or None to recurse into it."""
    kind = type(module)
    if kind is nn.Linear:
        new = UnitLinear(module.in_features, module.out_features, module.bias is not None,
                         device=module.weight.device)
        return _carry_weights(new, module, _linear_output_scale(module.weight)) if preserve else new
    if kind is nn.Conv2d:
        if module.padding_mode != "zeros" or isinstance(module.padding, str):
            raise NotImplementedError("unit scaling supports Conv2d with numeric zero padding only")
        new = UnitConv2d(module.in_channels, module.out_channels, module.kernel_size, module.stride,
                         module.padding, module.dilation, module.groups, module.bias is not None,
                         device=module.weight.device)
        scale = _conv_scales(module.weight, module.stride, module.groups)[0]
        return _carry_weights(new, module, scale) if preserve else new
    if kind is nn.ReLU:
        return UnitReLU(preserve)
    if (kind is nn.GELU and module.approximate == "none") or kind.__name__ == "GELUActivation":
        return UnitGELU(preserve)
    if kind is nn.MaxPool2d:
        return UnitMaxPool2d(module.kernel_size, module.stride, module.padding, module.dilation,
                             ceil_mode=module.ceil_mode)
    if isinstance(module, PARAMETER_FREE + KEPT):
        return module
    if not any(True for _ in module.parameters(recurse=False)):
        return None
    raise NotImplementedError(f"unit scaling has no rule for {kind.__name__}")


def unit_scale(model: nn.Module, preserve: bool = False) -> nn.Module:
    """Replace, in place, Linear / Conv2d / ReLU / GELU / MaxPool2d by their unit-scaled versions.

    preserve=False: fresh unit-variance weights (training from scratch). preserve=True: keep the
    pretrained function (weights rescaled, activations scaled in the backward pass only).
    """
    for name, child in model.named_children():
        replacement = _unit_module(child, preserve)
        if replacement is None:
            unit_scale(child, preserve)
        elif replacement is not child:
            setattr(model, name, replacement)
    return model


def unit_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """unit_scaling's cross-entropy: mean loss forward, unit-scale gradient backward (no 1/batch)."""
    return U.cross_entropy(logits, targets)


def _flat(outputs) -> torch.Tensor:
    return torch.cat([o.flatten() for o in outputs]) if isinstance(outputs, tuple) else outputs.flatten()


def unit_scale_task(task, preserve: bool) -> dict:
    """Unit-scale `task.model` and its loss; with `preserve`, measure the output change on one training batch."""
    if not preserve:
        unit_scale(task.model)
        task.cross_entropy = unit_cross_entropy
        return {"preserve_function": False, "why": "fresh unit-variance init (model.pretrained=false or no checkpoint)"}
    reference = copy.deepcopy(task.model).eval()
    batch = next(iter(task.train_batches(0)))
    unit_scale(task.model, preserve=True)
    task.cross_entropy = unit_cross_entropy
    was_training = task.model.training
    task.model.eval()
    with torch.no_grad():
        before = _flat(task.forward(reference, batch, lambda x: x)[0])
        after = _flat(task.forward(task.model, batch, lambda x: x)[0])
    task.model.train(was_training)
    max_abs = (after - before).abs().max().item()
    return {"preserve_function": True, "max_abs_output_diff": max_abs,
            "max_rel_output_diff": max_abs / max(before.abs().max().item(), 1e-30),
            "measured_on": "one training batch, eval mode (no dropout), FP32, before training"}
