"""u-μP (Blake et al., "u-μP: The Unit-Scaled Maximal Update Parametrization", ICLR 2025) as a model transform.

u-μP is unit scaling made width-transferable: every op is unit-scaled as in bench/numerics/unit.py, and on top
- hidden weights keep the matmul's 1/sqrt(fan_in) forward scale, the readout (the last Linear) takes 1/fan_in
  (`unit_scaling.LinearReadout`), embeddings none: μP's multipliers, with every weight initialised N(0, 1);
- attention logits are scaled by mult/d_head (μP's 1/d_head, not 1/sqrt(d_head));
- the residual branches are weighted by the library's `transformer_residual_scaling_rule` (its Appendix G);
- norms have no trainable parameters, and the head is not tied to the embedding (a readout and an input weight
  follow different rules), as the library's modules and its u-μP demo model do;
- the readout is the model's last Linear (the one that makes the logits: charlm's lm_head, BERT's MLM decoder, a
  QA or classification head); every other Linear, a task head's hidden ones included, is a hidden weight;
- the optimiser scales each parameter's learning rate by its type and depth (`unit_scaling.optim`): hidden weights
  by fan_in^-1/2, embeddings by width^-1/2, the readout, norms and biases by 1, everything inside the residual stack
  also by depth^-1/2; the weight decay is independent of the learning rate (the library's default).

What the library has is used as it is: its Embedding, LayerNorm, GELU, Dropout, attention, residual split/add,
cross-entropy, Parameter tags, DepthModuleList and optimiser rules. The one thing written here is the Linear: the
library's computes F.linear inside, where an emulated precision needs its rounding sites (`CastOp`) between the scales
and the GEMM; `UmupLinear` is unit_scaling.functional.linear line for line with the GEMM through CastOp.linear, and
tests/test_umup.py holds it to the library's output and gradients bit for bit.

A transformers encoder (BERT, DistilBERT) from scratch is covered too, as unit scaling covers it (bench/numerics/
unit.py): its attention through transformers' attention-function registry (the library's attention with u-μP's
mult/d_head), its GELUActivation by the library's GELU, and its post-norm residual adds, LayerNorm(x + f(x)), which
the paper's rule (written for pre-norm stacks) does not reach: each branch is weighted by unit scaling's
post-norm rule (`weight_post_norm_branches`, tau = POST_NORM_TAU), and `residual_mult` / `residual_attn_ratio`,
which have no meaning there, are refused away from 1.

The abc-parametrisation's hyper-parameters (`UmupHyper`, config `scaling.*`) are the paper's, all 1 by default.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass

import unit_scaling as uu
import unit_scaling.functional as U
from torch import nn
from unit_scaling.constraints import apply_constraint
from unit_scaling.core.functional import transformer_residual_scaling_rule
from unit_scaling.optim import lr_scale_func_adam, scaled_parameters
from unit_scaling.scale import scale_bwd, scale_fwd

from bench.errors import ConfigError
from bench.numerics.emulation import CastOp
from bench.numerics.ops import Add, Attention, CausalAttention, Residual
from bench.numerics.swap import swap_modules, tied_parameters
from bench.numerics.unit import (
    POST_NORM_TAU,
    UnitAdd,
    UnitAttention,
    UnitResidual,
    dropout_of,
    refuse_unscaled_ops,
    route_registry_attention,
    weight_post_norm_branches,
)


@dataclass(frozen=True)
class UmupHyper:
    """u-μP's hyper-parameters (the paper's α_res, α_res-attn-ratio, α_attn-softmax, α_ffn-act, α_loss-softmax),
    each a multiplier that is 1 at the paper's defaults."""

    residual_mult: float = 1.0  # the residual branches' total contribution relative to the embedding's
    residual_attn_ratio: float = 1.0  # attention branches' contribution relative to the MLP branches'
    attn_softmax_mult: float = 1.0  # attention logits: q k^T * mult / d_head
    ffn_act_mult: float = 1.0  # the MLP's activation: gelu(mult * x) / mult
    output_mult: float = 1.0  # the loss's softmax: cross_entropy(mult * logits)


class UmupLinear(CastOp, uu.Linear):
    """unit_scaling.Linear whose GEMM an emulated precision rounds (CastOp): unit_scaling.functional.linear's
    scales, in its own order and arithmetic, so that with nothing to round it is the library's Linear bit for bit."""

    scale_power = (0.5, 0.5, 0.5)  # (output, input gradient, weight gradient), as the library's linear
    branch_weight: float = 1.0  # a post-norm residual branch's weight (bench.numerics.unit.weight_post_norm_branches)

    def forward(self, x):
        fan_out, fan_in = self.weight.shape
        batch_size = x.numel() // fan_in
        output_scale = 1 / fan_in ** self.scale_power[0]
        grad_input_scale = 1 / fan_out ** self.scale_power[1]
        grad_weight_scale = 1 / batch_size ** self.scale_power[2]
        output_scale, grad_input_scale = apply_constraint(self.constraint, output_scale, grad_input_scale)
        x = scale_bwd(x, grad_input_scale)
        weight = scale_bwd(self.weight, grad_weight_scale)
        bias = None if self.bias is None else scale_bwd(self.bias, grad_weight_scale)
        out = scale_fwd(self.linear(x, weight, bias), output_scale)
        return out if self.branch_weight == 1.0 else out * self.branch_weight


class UmupReadout(UmupLinear):
    """unit_scaling.LinearReadout the same way: output scale 1/fan_in, unconstrained, weight tagged `output`."""

    scale_power = (1.0, 0.5, 0.5)

    def __init__(self, in_features: int, out_features: int, bias: bool = False, device=None):
        super().__init__(in_features, out_features, bias, device, constraint=None, weight_mup_type="output")


class UmupResidual(UnitResidual):
    """The same residual split and add, given the library's tau (transformer_residual_scaling_rule's ratio of the
    branch's weight to the skip's) as it is rather than as a variance share, so u-μP's residuals are the library's
    to the bit."""

    def __init__(self, ratio: float):
        super().__init__(ratio**2 / (1 + ratio**2))
        self.ratio = ratio


COVERED = (nn.Linear, nn.Embedding, nn.LayerNorm, nn.GELU, nn.Dropout, nn.Identity, Residual, Attention,
           CausalAttention, Add)
GELU_ACTIVATION = "GELUActivation"  # transformers' exact GELU (hidden_act "gelu"), by name: no import of transformers


def _umup_module(module: nn.Module, hyper: UmupHyper, readout: bool) -> nn.Module | None:
    """The u-μP replacement of `module`, or None to recurse into it; ConfigError for a layer with no u-μP rule."""
    kind = type(module)
    device = next((p.device for p in module.parameters()), None)
    if kind is nn.Linear:
        if readout:
            return UmupReadout(module.in_features, module.out_features, module.bias is not None, device=device)
        return UmupLinear(module.in_features, module.out_features, module.bias is not None, device=device)
    if kind is nn.Embedding:
        return uu.Embedding(module.num_embeddings, module.embedding_dim, module.padding_idx, device=device)
    if kind is nn.LayerNorm:
        return uu.LayerNorm(module.normalized_shape, module.eps, elementwise_affine=False)
    if kind is nn.GELU or kind.__name__ == GELU_ACTIVATION:
        return uu.GELU(mult=hyper.ffn_act_mult, approximate=getattr(module, "approximate", "none"))
    if kind is nn.Dropout:
        return uu.Dropout(module.p)
    if kind in (Attention, CausalAttention):
        return UnitAttention(module.dropout, hyper.attn_softmax_mult, causal=module.causal)
    if kind is Add:
        return UnitAdd()
    if kind in (nn.Identity, Residual):
        return module  # residual adds are weighted once the whole model is known (umup_scale)
    if kind is nn.CrossEntropyLoss:
        return module  # a transformers model's own loss: the tasks here compute theirs (task.cross_entropy)
    held_by_children = {id(p) for child in module.children() for p in child.parameters()}
    if any(True for _ in module.children()) and all(id(p) in held_by_children
                                                    for p in module.parameters(recurse=False)):
        return None  # a container (its own parameters, if any, tied to its children's: BERT's MLM head's bias)
    raise ConfigError(f"scaling=umup has no rule for {kind.__name__}: u-μP here covers "
                      f"{', '.join(c.__name__ for c in COVERED)}, transformers' GELUActivation, and modules made of "
                      "them (a model built from bench/numerics/ops.py's ops, such as charlm, or transformers' BERT "
                      "and DistilBERT)")


def _convert(model: nn.Module, hyper: UmupHyper, readout: nn.Module) -> None:
    """Every module's `_umup_module` in its place (bench/numerics/swap.py), `readout` (a Linear) as the readout;
    then each residual stack (an nn.ModuleList) as the library's DepthModuleList, which tags every parameter inside
    with its depth."""
    swap_modules(model, lambda name, module: _umup_module(module, hyper, readout=module is readout))
    swap_modules(model, lambda name, module: uu.DepthModuleList(list(module)) if type(module) is nn.ModuleList
                 else None)


def _retie_containers(model: nn.Module, ties: list[list[tuple[nn.Module, str, str]]]) -> None:
    """`ties`: each shared parameter's (module, name, attribute) owners before the conversion. A container that
    shared a parameter with a module the conversion replaced (BERT's MLM head's `bias`, its decoder's) holds the
    replacement's; parameters that two replaced modules shared (a head tied to the embedding) stay untied."""
    for owners in ties:
        now = [(model.get_submodule(name), attribute, was) for was, name, attribute in owners]
        fresh = [getattr(module, attribute) for module, attribute, was in now if module is not was]
        for module, attribute, was in now:
            if module is was and fresh:
                setattr(module, attribute, fresh[0])


def umup_scale(model: nn.Module, hyper: UmupHyper = UmupHyper(), post_norm_tau: float = POST_NORM_TAU) -> nn.Module:
    """Make `model` (in place) a u-μP model with fresh N(0, 1) weights: see the module docstring. Residual adds are
    weighted in the order the model holds them (attention, MLP, attention, ...), as unit_scaling.TransformerStack
    weights its layers; a transformers encoder's post-norm branches by `post_norm_tau`. Tied weights are untied:
    each module gets its own parameter."""
    linears = [m for m in model.modules() if type(m) is nn.Linear]
    ties = [[(model.get_submodule(name), name, attribute) for name, attribute in owners]
            for owners in tied_parameters(model)]
    _convert(model, hyper, readout=linears[-1] if linears else None)
    _retie_containers(model, ties)
    if route_registry_attention(model, lambda module: UnitAttention(dropout_of(module), hyper.attn_softmax_mult)):
        if (hyper.residual_mult, hyper.residual_attn_ratio) != (1.0, 1.0):
            raise ConfigError(f"scaling.residual_mult={hyper.residual_mult:g} and scaling.residual_attn_ratio="
                              f"{hyper.residual_attn_ratio:g}: u-μP's residual rule is for pre-norm stacks, and "
                              f"{type(model).__name__} is post-norm (its branches weighted by unit scaling's "
                              f"post-norm rule, tau = {post_norm_tau}); valid here: 1.0 for both")
        weight_post_norm_branches(model, post_norm_tau)
    residuals = [(parent, name) for parent in model.modules() for name, child in parent.named_children()
                 if type(child) is Residual]
    rule = transformer_residual_scaling_rule(hyper.residual_mult, hyper.residual_attn_ratio)
    for index, (parent, name) in enumerate(residuals):
        setattr(parent, name, UmupResidual(rule(index, len(residuals))))
    return model


def umup_task(task, hyper: UmupHyper) -> dict:
    """u-μP `task.model` and its loss (the library's cross-entropy, softmax multiplier output_mult); what the record
    says of the conversion."""
    umup_scale(task.model, hyper)
    refuse_unscaled_ops("umup", task)
    task.cross_entropy = functools.partial(U.cross_entropy, mult=hyper.output_mult)
    task.gradient_averages_terms = False
    scales = sorted(lr_scale_func_adam(p) for p in task.model.parameters())
    return {"parametrisation": "u-μP", "hyper": asdict(hyper),
            "lr_scale": {"min": scales[0], "median": scales[len(scales) // 2], "max": scales[-1]},
            "readout": next((n for n, m in task.model.named_modules() if isinstance(m, UmupReadout)), None),
            "scaled_attention": [n for n, m in task.model.named_modules() if isinstance(m, UnitAttention)],
            "post_norm_branches": [n for n, m in task.model.named_modules()
                                   if isinstance(m, UmupLinear) and m.branch_weight != 1.0],
            "why": "fresh N(0, 1) weights, the library's u-μP ops and optimiser rules; head untied, norms without "
                   "trainable parameters"}


def umup_parameter_groups(groups: list[dict], lr: float) -> list[dict]:
    """The optimiser's groups under u-μP: unit_scaling.optim's, one per parameter, lr * its type-and-depth scale, its
    weight decay made independent of the learning rate (as unit_scaling.optim.AdamW makes them). The Adam rule
    serves SGD too: the library's SGD rule for an unconstrained readout (ours) is the Adam rule."""
    return scaled_parameters(groups, lr_scale_func_adam, lr=lr, independent_weight_decay=True)


