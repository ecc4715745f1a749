"""Unit scaling (Blake, Orr, Luschi, "Unit Scaling", ICML 2023) as a model transform.

Two uses. From scratch (`preserve=False`): fresh unit-variance weights, every op scaled, including the
transformer ops that bench/numerics/ops.py exposes as modules (residual adds, causal attention, embedding sums) and
Embedding / LayerNorm (unit_scaling's functional ops, their weight gradients scaled). A pretrained
checkpoint (`preserve=True`): each matmul's weight *and bias* are divided by its forward scale alpha, so
alpha * (x (W/alpha)^T + b/alpha) = x W^T + b reproduces the pretrained output; activations keep their
forward (scale 1) and scale only their backward; embeddings and LayerNorm are kept as they are (they stay
in higher precision). Residual adds are not re-weighted: sqrt(1-tau) x + sqrt(tau) f(x) would change the
pretrained function. `unit_scale_task` compares every layer's output of the converted model with the
original's on a training batch and refuses a conversion that changed the function (ConversionError).

Every op is scaled so that, at initialisation, its output and its input gradient have unit variance
when its inputs do: weights are initialised N(0, 1), a matmul/conv multiplies its output by
alpha = fan_in^-1/2 in the forward pass and its input gradient by beta = fan_out^-1/2 in the backward
pass; the weight gradient is scaled by batch^-1/2. Which ops constrain alpha and beta to one shared value
follows unit-scaling's `unit_scale` transform ("unconstraining of all operations after the final residual
layer"): ops inside the model's stack of residual blocks (an nn.ModuleList, as Hugging Face encoders keep
them) use the geometric mean, so their output std is (fan_in/fan_out)^1/4 and their input-gradient std
its inverse; every other op (all of LeNet, which has no residual adds; a transformer's pooler and task
head, which follow the last residual add) is unconstrained, with output and input-gradient std 1.
Nonlinearities get the paper's fixed factors, and the loss is unit_scaling's cross-entropy (no 1/batch in
the backward pass). No loss scale is needed.

The scale primitives (`scale_fwd`, `scale_bwd`, `scale_elementwise`, `apply_constraint`) and the
cross-entropy come from the `unit-scaling` package; its Linear calls F.linear internally, so the
scaled Linear and the Conv2d it lacks are written here in the same style, with the emulated
precision's rounding sites (`CastOp`), or a block format's GEMM operands, between the scaling and the matmul.
"""

from __future__ import annotations

import contextlib
import copy
import math

import torch
import torch.nn.functional as F
import unit_scaling.functional as U
from torch import nn
from torch.overrides import TorchFunctionMode
from unit_scaling.constraints import apply_constraint
from unit_scaling.core.functional import scale_elementwise, transformer_residual_scaling_rule
from unit_scaling.scale import scale_bwd, scale_fwd

from bench.errors import ConfigError
from bench.numerics.emulation import CastOp
from bench.numerics.ops import Add, Attention, CausalAttention, Residual
from bench.numerics.swap import retie, swap_modules, tied_parameters

RESIDUAL_CONSTRAINT = "gmean"  # ops with a residual add after them; unit-scaling leaves the rest unconstrained
# (forward, backward) factors from the paper. ReLU on N(0, 1): output std sqrt(1/2 - 1/(2 pi)) = 0.584
# -> x1.713, half the gradients pass -> x sqrt(2). GELU: 1.701 / 1.481.
ACTIVATION_SCALES = {"relu": (1.713, math.sqrt(2.0)), "gelu": (1.701, 1.481)}
KEPT = (nn.Embedding, nn.LayerNorm)  # forward unchanged, not unit-scaled, higher precision
# transformers' post-norm encoders (BERT, DistilBERT) add each residual branch inline before a LayerNorm,
# LayerNorm(x + f(x)): the module class holding f's last Linear, and that Linear's attribute.
POST_NORM_BRANCH_OUTPUTS = {"BertSelfOutput": "dense", "BertOutput": "dense", "DistilBertSelfAttention": "out_lin",
                            "FFN": "lin2"}
POST_NORM_TAU = 0.02  # scaling.post_norm_tau's default: see weight_post_norm_branches


def _unit_init(module: nn.Module) -> None:
    nn.init.normal_(module.weight)
    if module.bias is not None:
        nn.init.zeros_(module.bias)


def _linear_scales(weight: torch.Tensor, constraint: str | None) -> tuple[float, float]:
    """(output scale alpha, input-gradient scale beta)."""
    fan_out, fan_in = weight.shape
    return apply_constraint(constraint, fan_in**-0.5, fan_out**-0.5)


def _conv_scales(weight: torch.Tensor, stride, groups: int, constraint: str | None) -> tuple[float, float]:
    out_channels, in_per_group, kh, kw = weight.shape
    fan_in = in_per_group * kh * kw
    grad_fan = out_channels * kh * kw / (stride[0] * stride[1] * groups)
    return apply_constraint(constraint, fan_in**-0.5, grad_fan**-0.5)


class UnitLinear(CastOp, nn.Linear):
    """y = alpha * (x W^T + b), grad_x * beta, grad_W * batch^-1/2.

    constraint=None: alpha = fan_in^-1/2, beta = fan_out^-1/2; "gmean": alpha = beta = (fan_in * fan_out)^-1/4.
    """

    branch_weight: float = 1.0  # a post-norm residual branch's weight (`weight_post_norm_branches`)

    def __init__(self, *args, constraint: str | None = None, **kwargs):
        self.constraint = constraint
        super().__init__(*args, **kwargs)

    def reset_parameters(self) -> None:
        _unit_init(self)

    def forward(self, x):
        output_scale, grad_input_scale = _linear_scales(self.weight, self.constraint)
        grad_weight_scale = (x.numel() // self.in_features) ** -0.5
        x = scale_bwd(x, grad_input_scale)
        weight = scale_bwd(self.weight, grad_weight_scale)
        bias = None if self.bias is None else scale_bwd(self.bias, grad_weight_scale)
        out = scale_fwd(self.linear(x, weight, bias), output_scale)
        return out if self.branch_weight == 1.0 else out * self.branch_weight


class UnitConv2d(CastOp, nn.Conv2d):
    """unit_scaling.functional.conv1d's scales in two dimensions.

    fan_in = C_in/groups * kh * kw; each input pixel receives C_out * kh * kw / (sh * sw) gradient terms;
    the weight gradient sums over batch * H_out * W_out positions.
    """

    def __init__(self, *args, constraint: str | None = None, **kwargs):
        self.constraint = constraint
        super().__init__(*args, **kwargs)

    def reset_parameters(self) -> None:
        _unit_init(self)

    def forward(self, x):
        output_scale, grad_input_scale = _conv_scales(self.weight, self.stride, self.groups, self.constraint)
        positions = x.shape[0] * math.prod(
            (size + 2 * pad - dil * (k - 1) - 1) // stride + 1
            for size, pad, dil, k, stride in zip(x.shape[-2:], self.padding, self.dilation, self.kernel_size,
                                                 self.stride))
        x = scale_bwd(x, grad_input_scale)
        weight = scale_bwd(self.weight, positions**-0.5)
        bias = None if self.bias is None else scale_bwd(self.bias, positions**-0.5)
        return scale_fwd(self.gemm(self._conv_forward, x, weight, bias), output_scale)


class ScaledActivation(nn.Module):
    """f(x) * output_scale forward, gradient * grad_scale backward (unit_scaling's scale_elementwise)."""

    def __init__(self, fn, output_scale: float, grad_scale: float):
        super().__init__()
        self.output_scale, self.grad_scale = output_scale, grad_scale
        self.scaled = scale_elementwise(fn, output_scale, grad_scale, constraint=None)

    def forward(self, x):
        return self.scaled(x)

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


class UnitEmbedding(nn.Embedding):
    """N(0, 1) rows (output std 1); the weight gradient scaled by (rows / lookups)^1/2 (unit_scaling's embedding)."""

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight)
        self._fill_padding_idx_with_zero()

    def forward(self, idx):
        return U.embedding(idx, self.weight, self.padding_idx)


class UnitLayerNorm(nn.LayerNorm):
    """Forward unchanged (its output has unit variance already); the weight and bias gradients, sums over every
    position, scaled by (features / elements)^1/2 (unit_scaling's layer_norm)."""

    def forward(self, x):
        return U.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)


class UnitResidual(Residual):
    """sqrt(1 - tau) x + sqrt(tau) f(x): both branches unit-scaled, tau the residual branch's share of the
    output variance; in the backward pass the split scales the gradients, so f itself sees a unit gradient
    (unit_scaling's residual_split / residual_add, whose own tau is the ratio sqrt(tau / (1 - tau)))."""

    def __init__(self, tau: float):
        super().__init__()
        self.tau = tau
        self.ratio = math.sqrt(tau / (1 - tau))  # the library's tau: the branch's weight relative to the skip's

    def forward(self, x, branch):
        residual, skip = U.residual_split(x, self.ratio)
        return U.residual_add(branch(residual), skip, self.ratio)

    def extra_repr(self) -> str:
        return f"tau={self.tau:.4f}"


def residual_taus(count: int) -> list[float]:
    """tau of each of a stack's `count` residual adds (attention, MLP, attention, ...), from unit-scaling's
    transformer rule: every attention and every MLP branch ends up contributing the same share of the final
    residual stream, and all of them together twice the embedding's (1/3 embedding, 2/3 branches)."""
    rule = transformer_residual_scaling_rule()
    return [rule(i, count) ** 2 / (1 + rule(i, count) ** 2) for i in range(count)]


class UnitAttention(Attention):
    """unit_scaling's attention, bidirectional or causal as the op it replaces: softmax(q k^T * mult / d_head), by
    default the same softmax(q k^T / sqrt(d_head)) (mult = sqrt(d_head); u-μP passes its own), its output and the
    q, k, v gradients divided by the library's model of their std at initialisation (averaging over a causal window
    shrinks it to about sqrt(log(length) / length); over the whole sequence, to about sqrt(1 / length))."""

    def __init__(self, dropout: float = 0.0, mult: float | None = None, causal: bool = False):
        super().__init__(dropout)
        self.mult, self.causal = mult, causal

    def forward(self, q, k, v, mask=None):
        mult = q.shape[-1] ** 0.5 if self.mult is None else self.mult
        return U.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=self.dropout if self.training else 0.0,
                                              is_causal=self.causal, mult=mult)


class UnitAdd(Add):
    """(a + b) / sqrt(2), each input's gradient scaled by 1/sqrt(its broadcast factor) (unit_scaling's add,
    unconstrained: its inputs are embedding lookups, leaves whose gradients only reach their own weights, so the
    forward and backward scales need not agree; the library's default would scale both gradients by 1/sqrt(2))."""

    def forward(self, a, b):
        return U.add(a, b, constraint=None)


PARAMETER_FREE = (nn.Flatten, nn.Identity, nn.Dropout, nn.Tanh)


@torch.no_grad()
def _carry_weights(new: nn.Module, old: nn.Module, output_scale: float) -> nn.Module:
    """Pretrained conversion: W' = W / alpha and b' = b / alpha, so that alpha * (x W'^T + b') = x W^T + b."""
    new.weight.copy_(old.weight / output_scale)
    if old.bias is not None:
        new.bias.copy_(old.bias / output_scale)
    return new


def _unit_module(module: nn.Module, preserve: bool, constraint: str | None) -> nn.Module | None:
    """The unit-scaled replacement of `module`, `module` itself where it is kept, or None to recurse into it."""
    kind = type(module)
    if kind is nn.Linear:
        new = UnitLinear(module.in_features, module.out_features, module.bias is not None,
                         device=module.weight.device, constraint=constraint)
        return _carry_weights(new, module, _linear_scales(module.weight, constraint)[0]) if preserve else new
    if kind is nn.Conv2d:
        if module.padding_mode != "zeros" or isinstance(module.padding, str):
            raise ConfigError("scaling=unit supports Conv2d with numeric zero padding only")
        new = UnitConv2d(module.in_channels, module.out_channels, module.kernel_size, module.stride,
                         module.padding, module.dilation, module.groups, module.bias is not None,
                         device=module.weight.device, constraint=constraint)
        scale = _conv_scales(module.weight, module.stride, module.groups, constraint)[0]
        return _carry_weights(new, module, scale) if preserve else new
    if kind is nn.ReLU:
        return UnitReLU(preserve)
    if (kind is nn.GELU and module.approximate == "none") or kind.__name__ == "GELUActivation":
        return UnitGELU(preserve)
    if kind is nn.MaxPool2d:
        return UnitMaxPool2d(module.kernel_size, module.stride, module.padding, module.dilation,
                             ceil_mode=module.ceil_mode)
    if not preserve:  # from scratch: the transformer's other ops are unit-scaled too
        if kind is nn.Embedding:
            return UnitEmbedding(module.num_embeddings, module.embedding_dim, module.padding_idx,
                                 device=module.weight.device)
        if kind is nn.LayerNorm:
            return UnitLayerNorm(module.normalized_shape, module.eps, module.elementwise_affine,
                                 module.bias is not None,
                                 device=None if module.weight is None else module.weight.device)
        if kind in (Attention, CausalAttention):
            return UnitAttention(module.dropout, causal=module.causal)
        if kind is Add:
            return UnitAdd()
    if isinstance(module, PARAMETER_FREE + KEPT + (Residual, Attention, Add)):
        return module
    held_by_children = {id(p) for child in module.children() for p in child.parameters()}
    if all(id(p) in held_by_children for p in module.parameters(recurse=False)):
        return None  # a container (its own parameters, if any, tied to its children's: BERT's MLM head's bias)
    raise ConfigError(f"scaling=unit has no rule for {kind.__name__}: unit scaling here covers Linear, Conv2d, ReLU, "
                      "GELU, MaxPool2d, Embedding, LayerNorm, bench/numerics/ops.py's ops and parameter-free modules")


def unit_scale(model: nn.Module, preserve: bool = False, post_norm_tau: float = POST_NORM_TAU) -> nn.Module:
    """Replace, in place, Linear / Conv2d / ReLU / GELU / MaxPool2d by their unit-scaled versions; from scratch,
    also Embedding, LayerNorm, causal attention, embedding sums and residual adds (bench/numerics/ops.py).

    preserve=False: fresh unit-variance weights (training from scratch). preserve=True: keep the
    pretrained function (weights and biases rescaled, activations scaled in the backward pass only; the
    other ops kept). Ops inside an nn.ModuleList (the stack of residual blocks) are constrained to the
    geometric mean; ops outside it are unconstrained (see the module docstring). Residual adds get their tau
    from `residual_taus`, in the order the model holds them. Tied weights (a GPT's embedding and head) stay tied.
    A transformers encoder, from scratch: its attention through `route_registry_attention`, its post-norm residual
    branches weighted by `post_norm_tau` (`weight_post_norm_branches`).
    """
    ties = tied_parameters(model)
    _convert(model, preserve)
    if not preserve:
        if route_registry_attention(model, lambda module: UnitAttention(dropout_of(module))):
            weight_post_norm_branches(model, post_norm_tau)
        residuals = [(parent, name) for parent in model.modules() for name, child in parent.named_children()
                     if type(child) is Residual]
        for (parent, name), tau in zip(residuals, residual_taus(len(residuals))):
            setattr(parent, name, UnitResidual(tau))
    retie(model, ties)
    return model


def weight_post_norm_branches(model: nn.Module, tau: float) -> None:
    """Weight each residual branch of a transformers post-norm encoder: LayerNorm(x + r f(x)) with r = sqrt(tau / (1 -
    tau)), which is LayerNorm(sqrt(1 - tau) x + sqrt(tau) f(x)) exactly (LayerNorm ignores a common factor): tau is
    the branch's share of the sum's variance when both are unit-scaled. r multiplies both passes, as regular BERT's
    small branch weights do: scaled in the forward pass only (unit_scaling's scale_fwd), the branch would send back
    1/r times the skip's share of every lower layer's gradient, and the masked LM stalls as unweighted. The add is
    inline in transformers' code, so the weight goes on the branch's last Linear (POST_NORM_BRANCH_OUTPUTS). Why it
    is needed: a LayerNorm after the add renormalises whatever the weights, but not the mix. Regular BERT starts
    with each branch ~0.02 of the skip's scale (N(0, 0.02) weights); unit scaling makes both unit, and more:
    attention averages its values over positions, which share part of their variance (a one-segment batch's segment
    embedding, then every layer's attention output), so the library's attention scale (which assumes independent
    values) leaves its output at std 1.4-4.7. Unweighted (tau = 0.5) or at the pre-norm rule's 0.1-0.3, that shared
    part swamps each position's own and a masked LM stalls at predicting the commonest piece (measured:
    bert_mlm_tiny, 400 steps, tau 0.1 stalls, 0.02 trains)."""
    ratio = math.sqrt(tau / (1 - tau))
    for module in model.modules():
        attribute = POST_NORM_BRANCH_OUTPUTS.get(type(module).__name__)
        if attribute and hasattr(getattr(module, attribute, None), "branch_weight"):  # UnitLinear, u-μP's UmupLinear
            getattr(module, attribute).branch_weight = ratio


# The name our attention function is registered under in transformers' attention-function registry.
REGISTRY_ATTENTION = "precision_bench_scaled"


def registry_attention_modules(model: nn.Module) -> dict[str, nn.Module]:
    """{name: module} of the modules of a transformers model that compute attention by calling its
    attention-function registry (`ALL_ATTENTION_FUNCTIONS[config._attn_implementation]`): the classes it records
    attentions of. Empty for a model that has no such registry (any other model, or a transformers model with
    attention of its own)."""
    if not getattr(type(model), "_supports_attention_backend", False):
        return {}
    kinds = (getattr(model, "_can_record_outputs", None) or {}).get("attentions") or ()
    kinds = tuple(getattr(kind, "target_class", kind) for kind in (kinds if isinstance(kinds, (list, tuple))
                                                                    else (kinds,)))
    return {name: module for name, module in model.named_modules() if kinds and isinstance(module, kinds)}


def _registry_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **_):
    """transformers' attention-function signature, computed by the scaled attention module the transform attached
    to the calling module (so that the op runs inside a module of ours, which `unscaled_ops` can tell apart)."""
    if scaling is not None and not math.isclose(scaling, query.shape[-1] ** -0.5, rel_tol=1e-6):
        raise ConfigError(f"{type(module).__name__} scales its attention scores by {scaling:g}, not 1/sqrt(d_head): "
                          "no unit-scaling rule here for another softmax scale")
    return module.scaled_attention(query, key, value, attention_mask).transpose(1, 2).contiguous(), None


def dropout_of(module: nn.Module) -> float:
    """The attention-probability dropout a transformers attention module passes to its attention function."""
    dropout = getattr(module, "dropout", 0.0)
    return dropout.p if isinstance(dropout, nn.Dropout) else float(dropout)


def route_registry_attention(model: nn.Module, make_attention) -> list[str]:
    """A transformers encoder's attention computed by our scaled attention: `make_attention(module)` attached to each
    of its registry-attention modules as `scaled_attention` (parameter-free: the state dict is unchanged), and the
    model switched to the registry entry that calls it, with torch SDPA's boolean masks. The modules' names."""
    modules = registry_attention_modules(model)
    if not modules:
        return []
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(REGISTRY_ATTENTION, _registry_attention)
    AttentionMaskInterface.register(REGISTRY_ATTENTION, sdpa_mask)
    for module in modules.values():
        module.scaled_attention = make_attention(module)
    model.set_attn_implementation(REGISTRY_ATTENTION)
    return list(modules)


def _convert(model: nn.Module, preserve: bool) -> None:
    """Every module's `_unit_module` in its place (bench/numerics/swap.py), constrained to the geometric mean inside
    a residual stack (an nn.ModuleList), unconstrained outside it."""
    stacks = tuple(f"{name}." for name, module in model.named_modules() if isinstance(module, nn.ModuleList))
    swap_modules(model, lambda name, module: _unit_module(
        module, preserve, RESIDUAL_CONSTRAINT if name.startswith(stacks) else None))


# Functions that compute attention, or build it by hand (scores, softmax, weighted sum): called by a module that no rule
# replaced, they run unscaled. Matched by the function torch dispatches, however the model spells it (`a @ b`, ...).
ATTENTION_FUNCTIONS = {F.scaled_dot_product_attention: "F.scaled_dot_product_attention", torch.softmax: "softmax",
                       F.softmax: "softmax", torch.Tensor.softmax: "softmax", torch.matmul: "matmul",
                       torch.Tensor.__matmul__: "matmul (@)", torch.bmm: "bmm", torch.einsum: "einsum",
                       torch.baddbmm: "baddbmm"}
SCALED_OP_MODULES = ("unit_scaling", "bench.numerics.unit", "bench.numerics.umup")  # where the scaled ops live


class _UnscaledOps(TorchFunctionMode):
    """Records each ATTENTION_FUNCTIONS call whose innermost running module is not a scaled op's."""

    def __init__(self, stack: list):
        super().__init__()
        self.stack, self.found = stack, {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in ATTENTION_FUNCTIONS and self.stack and not type(self.stack[-1][1]).__module__.startswith(
                SCALED_OP_MODULES):
            name, module = self.stack[-1]
            self.found.setdefault(name or "<model>", (type(module).__name__, ATTENTION_FUNCTIONS[func]))
        return func(*args, **(kwargs or {}))


def unscaled_ops(model: nn.Module, forward) -> dict[str, tuple[str, str]]:
    """{module name: (its class, the op)} for every attention op a module of `model` computes itself, found by running
    `forward(model)` once (no gradients; the global RNG as it was before)."""
    stack: list = []

    def enter(name):
        def push(module, _inputs):
            stack.append((name, module))
        return push

    def leave(*_):
        stack.pop()  # returns nothing: a forward hook's value would replace the module's output

    handles = []
    for name, module in model.named_modules():
        handles += [module.register_forward_pre_hook(enter(name)), module.register_forward_hook(leave)]
    mode = _UnscaledOps(stack)
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad(), mode:
            forward(model)
    finally:
        for handle in handles:
            handle.remove()
    return mode.found


def refuse_unscaled_ops(method: str, task) -> None:
    """ConfigError naming each module of the converted `task.model` that computes attention itself (it would train
    unscaled), and the op to build it from instead."""
    with torch.random.fork_rng(devices=[]):  # the batch may be drawn from the global RNG: training's, untouched
        batch = next(iter(task.train_batches(0)))
        found = unscaled_ops(task.model, lambda model: task.forward(model, batch, lambda x: x))
    if found:
        where = "; ".join(f"{name} ({kind}) calls {op}" for name, (kind, op) in found.items())
        raise ConfigError(f"scaling={method} has no rule for attention computed inside a module: {where}. Compute it "
                          "with bench.numerics.ops.Attention (bidirectional) or CausalAttention, which scaling="
                          f"{method} replaces by its scaled version; as written it would train unscaled")


def unit_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """unit_scaling's cross-entropy: mean loss forward, unit-scale gradient backward (no 1/batch)."""
    return U.cross_entropy(logits, targets)


class ConversionError(RuntimeError):
    """A pretrained conversion whose measured output change exceeds the tolerance: the cell must not train."""

    def __init__(self, message: str, measured: dict):
        super().__init__(message)
        self.measured = measured  # what was measured, for the failed cell's record


def _tensors(value) -> list[torch.Tensor]:
    """The floating-point tensors in a module's output (a tensor, a tuple, or a Hugging Face ModelOutput)."""
    if isinstance(value, torch.Tensor):
        return [value] if value.is_floating_point() else []
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    return []


def _relative_difference(before: torch.Tensor, after: torch.Tensor) -> float:
    """max |after - before| / max |before| (0 when both are zero), in float64."""
    before, after = before.double(), after.double()
    scale = before.abs().max().item()
    diff = (after - before).abs().max().item()
    return diff / scale if scale > 0 else diff


def _flat(value) -> torch.Tensor | None:
    tensors = _tensors(value)
    return torch.cat([t.detach().flatten() for t in tensors]) if tensors else None


@contextlib.contextmanager
def _each_layer(model: nn.Module, on_output):
    """Within the block, on_output(name, flat output) is called once per module (its first call), in execution order."""
    seen: set[str] = set()

    def hook(name):
        def fire(_module, _inputs, output):
            flat = _flat(output)
            if flat is not None and name not in seen:
                seen.add(name)
                on_output(name, flat)
        return fire

    handles = [m.register_forward_hook(hook(name or "<model>")) for name, m in model.named_modules()]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def conversion_difference(reference: nn.Module, converted: nn.Module, forward) -> dict:
    """Compare the task outputs and every layer's output of `converted` with `reference`.

    forward(model) -> the task's outputs for one fixed batch. Layers are matched by module name (the
    conversion swaps modules in place, so names are kept) and listed in execution order; both models run
    in eval mode (no dropout). Only the reference's layer outputs are held in memory.
    """
    modes = reference.training, converted.training
    reference.eval(), converted.eval()
    kept: dict[str, torch.Tensor] = {}
    layers: dict[str, float] = {}

    def compare(name, after):
        before = kept.pop(name, None)
        if before is not None and before.shape == after.shape:
            layers[name] = _relative_difference(before, after)

    with torch.no_grad():
        with _each_layer(reference, kept.__setitem__):
            y0 = _flat(forward(reference))
        with _each_layer(converted, compare):
            y1 = _flat(forward(converted))
    reference.train(modes[0]), converted.train(modes[1])
    worst = max(layers, key=layers.get) if layers else None
    return {"max_abs_output_diff": (y1.double() - y0.double()).abs().max().item(),
            "max_rel_output_diff": _relative_difference(y0, y1),
            "max_rel_layer_diff": layers[worst] if worst else 0.0, "worst_layer": worst,
            "layers_compared": len(layers), "layer_diffs": layers}


LR_RULES = ("same", "relative")  # scaling.lr_rule: the model's lr as configured | relative_lr_multipliers
ADAM_FAMILY = ("adam", "adamw")  # optimisers whose step size does not follow the gradient's scale (the relative rule's)


def relative_lr_multipliers(before: dict[str, float], model: nn.Module) -> dict[nn.Parameter, float]:
    """Per parameter, its RMS now over its RMS in the regular model (`before`, by name; 1 where either is 0).

    Adam moves every element by about lr per step whatever the gradient's scale, so a weight initialised at
    RMS 1 instead of the regular 0.02 changes 50x less, relative to itself, at the same lr: the unit-scaled
    model would learn far slower for a reason that has nothing to do with numerics. Multiplying each tensor's
    lr by this ratio keeps its relative step the regular model's (nanoGPT's embeddings and matrices: x50,
    its residual projections: x141, LayerNorm weights: x1); build_optimizer divides the weight decay by it,
    so AdamW's decoupled decay also shrinks each tensor by the regular model's fraction per step.

    A zero-initialised bias has no RMS to compare; a unit-scaled matmul multiplies its bias by its output scale
    alpha (y = alpha (x W^T + b)), so an Adam step of lr moves the output by alpha lr where the regular model's
    moves it by lr: its multiplier is 1/alpha (x8 for a 64-wide BERT's head, whose bias carries the token
    frequencies: at x1 a masked LM stalls at predicting the commonest piece). Other zero-initialised tensors: 1.
    """
    multipliers = {}
    for name, p in model.named_parameters():
        now, then = _rms(p), before.get(name, 0.0)
        multipliers[p] = now / then if now > 0 and then > 0 else 1.0
    for module in model.modules():
        if isinstance(module, (UnitLinear, UnitConv2d)) and module.bias is not None and _rms(module.bias) == 0:
            alpha = (_linear_scales(module.weight, module.constraint) if isinstance(module, UnitLinear) else
                     _conv_scales(module.weight, module.stride, module.groups, module.constraint))[0]
            multipliers[module.bias] = 1 / alpha
    return multipliers


def _rms(p: torch.Tensor) -> float:
    return float(p.detach().double().pow(2).mean().sqrt())


def unit_scale_task(task, preserve: bool, tolerance: float = 1e-4, relative_lr: bool = False,
                    post_norm_tau: float = POST_NORM_TAU, keep_weights: bool = False) -> dict:
    """Unit-scale `task.model` and its loss; with `preserve`, check the conversion kept the function.

    The check runs one training batch through the original and the converted model and compares the
    task outputs and every layer's output; a relative difference above `tolerance` anywhere raises
    ConversionError naming the first layer (in execution order) where it appears. From scratch with
    `relative_lr` (an Adam-family optimiser, scaling.lr_rule=relative), `task.lr_multipliers` gets each
    parameter's `relative_lr_multipliers`. `keep_weights`: the checkpoint was pretrained unit-scaled (bench.tools.
    export_encoder): the model is unit-scaled as from scratch and its pretrained weights put back, all but the
    task head the load initialised, which keeps its fresh unit init.
    """
    if not preserve:
        head = set((task.source or {}).get("initialised_head", []))
        pretrained = {k: v for k, v in task.model.state_dict().items() if k not in head} if keep_weights else None
        # the relative rule compares the two parametrisations' inits: the regular model's own init (from scratch) or,
        # for a checkpoint pretrained unit-scaled, a standard init of the same architecture (transformers'), as it
        # was in pretraining, not the loaded weights
        regular = type(task.model)(task.model.config) if keep_weights and relative_lr else task.model
        before = {name: _rms(p) for name, p in regular.named_parameters()} if relative_lr else None
        unit_scale(task.model, post_norm_tau=post_norm_tau)
        refuse_unscaled_ops("unit", task)
        task.cross_entropy, task.gradient_averages_terms = unit_cross_entropy, False
        result = {"preserve_function": False,
                  "why": "pretrained unit-scaled: its weights in the unit-scaled model, the task head freshly "
                         "unit-initialised" if keep_weights else
                         "fresh unit-variance init (model.pretrained=false or no checkpoint)",
                  "lr_rule": "relative" if relative_lr else "same",
                  "scaled_attention": [n for n, m in task.model.named_modules() if isinstance(m, UnitAttention)],
                  "post_norm_branches": [n for n, m in task.model.named_modules()
                                         if isinstance(m, UnitLinear) and m.branch_weight != 1.0],
                  "post_norm_tau": post_norm_tau}
        if relative_lr:
            task.lr_multipliers = relative_lr_multipliers(before, task.model)
            values = sorted(task.lr_multipliers.values())
            result["lr_multiplier"] = {"min": values[0], "median": values[len(values) // 2], "max": values[-1]}
        if keep_weights:
            loaded = task.model.load_state_dict(pretrained, strict=False)
            if loaded.unexpected_keys or set(loaded.missing_keys) - head:
                raise RuntimeError(f"the unit-scaled model does not hold the checkpoint's weights: {loaded}")
            result["kept_weights"] = len(pretrained)
        return result
    reference = copy.deepcopy(task.model)
    batch = next(iter(task.train_batches(0)))
    unit_scale(task.model, preserve=True)
    task.cross_entropy, task.gradient_averages_terms = unit_cross_entropy, False
    measured = conversion_difference(reference, task.model,
                                     lambda model: task.forward(model, batch, lambda x: x)[0])
    layer_diffs = measured.pop("layer_diffs")
    result = {"preserve_function": True, **measured, "tolerance": tolerance,
              "measured_on": "one training batch, eval mode (no dropout), FP32, before training; "
                             "rel = max|after - before| / max|before| per layer and for the task outputs"}
    first_bad = next((name for name, d in layer_diffs.items() if d > tolerance), None)
    if first_bad is not None or result["max_rel_output_diff"] > tolerance:
        where = (f"first at layer {first_bad!r} (relative difference {layer_diffs[first_bad]:.3g})"
                 if first_bad else "in the task outputs")
        raise ConversionError(
            f"unit-scaling conversion changed the pretrained model's function: task outputs differ by "
            f"{result['max_rel_output_diff']:.3g} (relative), {where}; tolerance "
            f"scaling.conversion_tolerance={tolerance:g}", result | {"first_layer_over_tolerance": first_bad})
    return result
