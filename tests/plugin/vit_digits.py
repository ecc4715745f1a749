"""A user's ViT-like classifier on the bundled digits (tests/test_plugin.py sweeps it): 8x8 patches of the 32x32 image,
a learned position embedding, pre-norm blocks of bidirectional attention and an MLP, mean-pooled into a linear head.
Built from bench/numerics/ops.py's ops (Attention, Residual, Add), so unit scaling and u-μP find and scale its
attention and residual adds; with `model.arch.attention=inline` it computes attention itself, as many models do,
and they refuse it (exit 2) instead of leaving it unscaled. Two more knobs make the mistakes tests/test_plugin.py
checks: `arch.pool=none` forgets to pool the tokens (outputs that do not fit the loss), `arch.percent=true` returns
accuracy in percent while the yaml declares a fraction."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from torch import nn

from bench.errors import ConfigError
from bench.numerics.ops import Add, Attention, Residual
from bench.tasks.base import Task
from bench.tasks.lenet import load_digits

PATCH = 8
ATTENTIONS = ("ops", "inline")


class SelfAttention(nn.Module):
    def __init__(self, width: int, heads: int, inline: bool):
        super().__init__()
        self.heads, self.inline = heads, inline
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.attend = None if inline else Attention()

    def forward(self, x):
        batch, length, width = x.shape
        q, k, v = (t.view(batch, length, self.heads, width // self.heads).transpose(1, 2)
                   for t in self.qkv(x).split(width, dim=2))
        y = F.scaled_dot_product_attention(q, k, v) if self.inline else self.attend(q, k, v)
        return self.proj(y.transpose(1, 2).reshape(batch, length, width))


class Block(nn.Module):
    def __init__(self, width: int, heads: int, inline: bool):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = SelfAttention(width, heads, inline)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))
        self.attn_residual, self.mlp_residual = Residual(), Residual()

    def forward(self, x):
        x = self.attn_residual(x, lambda h: self.attn(self.ln_1(h)))
        return self.mlp_residual(x, lambda h: self.mlp(self.ln_2(h)))


class ViT(nn.Module):
    def __init__(self, width: int, layers: int, heads: int, inline: bool, pool: bool = True):
        super().__init__()
        self.pool = pool
        tokens = (32 // PATCH) ** 2
        self.patches = nn.Linear(PATCH * PATCH, width)
        self.position = nn.Embedding(tokens, width)
        self.embedding_sum = Add()
        self.blocks = nn.ModuleList(Block(width, heads, inline) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, 10)

    def forward(self, images):  # (batch, 1, 32, 32) -> (batch, 10)
        patches = F.unfold(images, PATCH, stride=PATCH).transpose(1, 2)  # (batch, 16, 64)
        x = self.embedding_sum(self.patches(patches), self.position(torch.arange(patches.shape[1],
                                                                                 device=images.device)))
        for block in self.blocks:
            x = block(x)
        x = self.ln_f(x)
        return self.head(x.mean(dim=1) if self.pool else x)


def check(model: DictConfig) -> None:
    if model.arch.attention not in ATTENTIONS:
        raise ConfigError(f"model.arch.attention={model.arch.attention} is not valid; valid: {', '.join(ATTENTIONS)}")
    if model.arch.width % model.arch.heads:
        raise ConfigError(f"model.arch.width={model.arch.width} must be a multiple of model.arch.heads")


def vit_task(cfg: DictConfig, device: torch.device, seed: int) -> Task:
    x_train, y_train, x_test, y_test = (t.to(device) for t in load_digits(cfg.data.test_fraction))
    held_out = len(y_train) // 10  # the validation split (the quality curve), never the test set
    x_train, y_train, x_val, y_val = x_train[held_out:], y_train[held_out:], x_train[:held_out], y_train[:held_out]
    model = ViT(cfg.arch.width, cfg.arch.layers, cfg.arch.heads, cfg.arch.attention == "inline",
                cfg.arch.pool == "mean").to(device)
    unit = 100 if cfg.arch.percent else 1
    batches_per_epoch = len(y_train) // cfg.batch_size

    def train_batches(epoch: int):
        order = torch.randperm(len(y_train), generator=torch.Generator().manual_seed(seed * 1000 + epoch))
        for b in range(batches_per_epoch):
            index = order[b * cfg.batch_size:(b + 1) * cfg.batch_size].to(device)
            yield x_train[index], y_train[index]

    def forward(model, batch, cast_inputs):
        x, y = batch
        return model(cast_inputs(x)).float(), y

    @torch.no_grad()
    def accuracy(model, cast_inputs, x, y) -> float:
        return unit * (model(cast_inputs(x)).argmax(1) == y).sum().item() / len(y)

    return Task(model=model, train_batches=train_batches, forward=forward,
                loss=lambda logits, y, cross_entropy: cross_entropy(logits, y),
                evaluate=lambda model, cast: {"test_accuracy": accuracy(model, cast, x_test, y_test),
                                              "test_examples": len(y_test)},
                validate=lambda model, cast: {"val_accuracy": accuracy(model, cast, x_val, y_val)},
                batch_size=cfg.batch_size, steps_per_epoch=batches_per_epoch)
