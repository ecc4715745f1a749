"""Parameter-free ops as modules, so that a model transform can find and swap them by type.

Unit scaling (bench/numerics/unit.py) replaces nn.Linear by UnitLinear; the same way it replaces these: a residual add
by the weighted sqrt(1-tau) x + sqrt(tau) f(x), attention (bidirectional or causal) by its unit-scaled version, a sum
of embeddings by a unit-scaled add. A model that writes `x + f(x)` or calls F.scaled_dot_product_attention inline
hides those ops from any transform. Being parameter-free, they leave a model's initialisation untouched.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import nn


class Residual(nn.Module):
    """x + branch(x)."""

    def forward(self, x, branch):
        return x + branch(x)


class Attention(nn.Module):
    """softmax(q k^T / sqrt(d_head) + mask) v over (batch, heads, length, d_head) tensors, every position attending
    to every other (an encoder's, a ViT's); `mask`, optional, is F.scaled_dot_product_attention's attn_mask (True:
    attend; or a float bias), e.g. to leave out padding."""

    causal = False

    def __init__(self, dropout: float = 0.0):
        super().__init__()
        self.dropout = dropout

    def forward(self, q, k, v, mask=None):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=self.dropout if self.training else 0.0,
                                              is_causal=self.causal)


class CausalAttention(Attention):
    """softmax(q k^T / sqrt(d_head) + causal mask) v, over (batch, heads, length, d_head) tensors (a decoder's)."""

    causal = True


class Add(nn.Module):
    """a + b (a sum of embeddings)."""

    def forward(self, a, b):
        return a + b
