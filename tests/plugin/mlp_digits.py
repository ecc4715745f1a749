"""A model and a format defined outside bench/, as a user would: a two-layer MLP on the bundled digits, and FP8 E3M4
(`format.name=fp8e3m4`), registered when the suite imports this module: the config check does, to find the model's
functions, so E3M4 is known wherever `model=mlp` runs; a format for every model goes in a plug-in module named in
`plugins:` instead (tests/plugin/amd_fp8.py). With this directory on PYTHONPATH and `hydra.searchpath=[file://tests/plugin/conf]`,
`model=mlp` runs through the whole suite (tests/test_plugin.py). docs/extending.md walks through it."""

from __future__ import annotations

import torch
from omegaconf import DictConfig
from torch import nn

from bench.errors import ConfigError
from bench.formats import ElementFormat, FormatSpec, Recipe, emulated_everywhere, register_element, register_format
from bench.tasks.base import Task
from bench.tasks.lenet import load_digits

register_element(ElementFormat.from_bits("fp8_e3m4", 3, 4))  # 1 sign, 3 exponent, 4 mantissa bits, IEEE-like
register_format(FormatSpec("fp8e3m4", ("mixed",), Recipe("fp8_e3m4", "fp8_e3m4", False),
                           emulated_everywhere("fp8e3m4 has no native path: a user's format")))


def check(model: DictConfig) -> None:
    if model.arch.hidden < 1:
        raise ConfigError(f"model.arch.hidden={model.arch.hidden} must be >= 1")


def describe(model_cfg: dict) -> tuple[str, str]:
    return "digits", f"{model_cfg['name']} ({model_cfg['arch']['hidden']} hidden, digits)"


def mlp_task(cfg: DictConfig, device: torch.device, seed: int) -> Task:
    model = nn.Sequential(nn.Flatten(), nn.Linear(32 * 32, cfg.arch.hidden), nn.ReLU(),
                          nn.Linear(cfg.arch.hidden, 10)).to(device)
    return digits_task(model, cfg, device, seed)


class Block(nn.Module):
    """A residual block with BatchNorm: conv, BN, ReLU, conv, BN, plus the input."""

    def __init__(self, channels: int):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(channels, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels),
                                  nn.ReLU(inplace=True), nn.Conv2d(channels, channels, 3, padding=1, bias=False),
                                  nn.BatchNorm2d(channels))

    def forward(self, x):
        return torch.relu(x + self.body(x))


def resnet_task(cfg: DictConfig, device: torch.device, seed: int) -> Task:
    """A tiny ResNet with BatchNorm (running statistics: buffers, not parameters), in-place ReLUs and a max-pool, on
    the same digits."""
    width = cfg.arch.hidden
    model = nn.Sequential(nn.Conv2d(1, width, 3, padding=1, bias=False), nn.BatchNorm2d(width),
                          nn.ReLU(inplace=True), nn.MaxPool2d(2), Block(width), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(width, 10)).to(device)
    return digits_task(model, cfg, device, seed)


def digits_task(model: nn.Module, cfg: DictConfig, device: torch.device, seed: int) -> Task:
    """`model` trained on the digits (1 x 32 x 32 images)."""
    x_train, y_train, x_test, y_test = (t.to(device) for t in load_digits(cfg.data.test_fraction))
    held_out = len(y_train) // 10  # the validation split, for the quality curve (never the test set)
    x_train, y_train, x_val, y_val = x_train[held_out:], y_train[held_out:], x_train[:held_out], y_train[:held_out]
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
        return (model(cast_inputs(x)).argmax(1) == y).sum().item() / len(y)

    def evaluate(model, cast_inputs) -> dict:
        return {"test_accuracy": accuracy(model, cast_inputs, x_test, y_test), "test_examples": len(y_test),
                "val_accuracy": accuracy(model, cast_inputs, x_val, y_val)}

    def validate(model, cast_inputs) -> dict:
        return {"val_accuracy": accuracy(model, cast_inputs, x_val, y_val)}

    return Task(model=model, train_batches=train_batches, forward=forward,
                loss=lambda logits, y, cross_entropy: cross_entropy(logits, y), evaluate=evaluate,
                batch_size=cfg.batch_size, steps_per_epoch=batches_per_epoch, validate=validate)
