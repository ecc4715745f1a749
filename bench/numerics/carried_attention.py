"""A transformers encoder's attention on BF16's values carried in FP32 tensors, where the emulated ops before it hand
them on so (format.elsewhere=bf16 on a CPU, `Precision.carried_to_attention`).

Under CPU BF16 autocast, a training step's `F.scaled_dot_product_attention` (dropout on) takes torch's math path, which
widens BF16 q, k and v to FP32, computes in FP32 and rounds its result to BF16 (and, backward, rounds the gradients
of q, k and v to BF16). An emulated FP8 op computes q, k and v in FP32 and rounds them to BF16 only for the
attention to widen them again: on BERT-tiny, 16 of a step's extra casts against FP8 with FP32 elsewhere
(docs/performance.md). Here the query, key and value ops hand on BF16's values in FP32 tensors
(`OpCasts.carries_out`, rounding the gradients they get back at their entry, as autograd's casts would have), and the
attention, where torch would take its math path, runs that math path in FP32 on them with autocast off and hands its
result on in BF16: the same values, forward and backward (tests/test_carried.py checks them against the native
autocast step, bit for bit). Anywhere else (no dropout, as in evaluation, where a BF16 call takes another kernel that
rounds inside; another device or dtype) it calls transformers' SDPA attention as it was, under the autocast there,
which rounds the carried values to BF16 exactly.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.attention import SDPBackend

from bench.numerics.emulation import CastOp, _exact_op, _outside_autocast
from bench.numerics.formats import rounded_through
from bench.numerics.unit import registry_attention_modules

# Our entry in transformers' attention-function registry (and its mask registry: SDPA's masks)
ATTENTION = "precision_bench_carried_sdpa"


# The query, key and value projections' names in the transformers attention modules whose forward hands their results
# to the attention function through views alone (no rotary embedding between): BERT's (and its copies'), DistilBERT's
PROJECTIONS = (("query", "key", "value"), ("q_lin", "k_lin", "v_lin"))


def carried_attention_ops(model: nn.Module) -> list[CastOp]:
    """The query, key and value ops of `model`'s registry-attention modules (`unit.registry_attention_modules`) that
    can hand the attention BF16's values in FP32 tensors: the model attends by transformers' SDPA, and each such
    module's three projections (named as in PROJECTIONS) are emulated ops accumulated exactly. [] otherwise."""
    if getattr(getattr(model, "config", None), "_attn_implementation", None) != "sdpa":
        return []
    ops = []
    for module in registry_attention_modules(model).values():
        names = next((names for names in PROJECTIONS if all(hasattr(module, name) for name in names)), None)
        if names is None:  # an attention module of another make: its forward is not known here
            return []
        ops += [getattr(module, name) for name in names]
    return ops if ops and all(isinstance(op, CastOp) and _exact_op(op) for op in ops) else []


def route(model: nn.Module) -> None:
    """Switch `model` to the attention here (registered once with transformers, SDPA's masks with it)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION, _attention)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)
    model.set_attn_implementation(ATTENTION)


def _attention(module, query, key, value, attention_mask, dropout: float = 0.0, **kwargs):
    """transformers' attention-function signature: `sdpa_attention_forward`, in FP32 with autocast off where torch's
    BF16 call would take its math path (the module docstring), its result handed on in BF16; as it is elsewhere
    (in a compiled step too, where asking which path breaks the graph)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    device = query.device.type
    if torch.compiler.is_compiling() or not (  # a compiled step's inductor takes autocast's casts in as they are
            device == "cpu" and query.dtype == torch.float32 and torch.is_autocast_enabled(device)
            and torch.get_autocast_dtype(device) == torch.bfloat16 and dropout > 0
            and _takes_math_path(query, key, value, attention_mask, dropout)):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, **kwargs)
    if attention_mask is not None and attention_mask.is_floating_point():  # as autocast rounds it, the FP32 path's
        attention_mask = rounded_through(attention_mask, torch.bfloat16)  # dtype (SDPA takes no BF16 mask for FP32 q)
    output, weights = _outside_autocast(device, lambda widen, dtype: sdpa_attention_forward(
        module, query, key.float(), value.float(), attention_mask, dropout=dropout, **kwargs))
    return output.to(torch.bfloat16), weights


def _takes_math_path(query, key, value, attention_mask, dropout: float) -> bool:
    """Whether torch's SDPA picks its math path for this call (on a CPU: wherever dropout is on, which its flash
    kernel does not take)."""
    return torch._fused_sdp_choice(query, key, value, attention_mask, dropout) == SDPBackend.MATH.value
