"""What the training loop needs from a task, and nothing more."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from torch import nn


@dataclass
class Task:
    model: nn.Module
    train_batches: Callable[[int], Iterator[tuple]]  # epoch -> batches, reshuffled per epoch, deterministic
    loss: Callable[[nn.Module, tuple, Callable], torch.Tensor]  # (model, batch, cast_inputs) -> scalar loss
    evaluate: Callable[[nn.Module, Callable], dict]  # (model, cast_inputs) -> metrics
    batch_size: int
    steps_per_epoch: int
