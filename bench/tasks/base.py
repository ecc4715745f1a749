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
    forward: Callable[[nn.Module, tuple, Callable], tuple]  # (model, batch, cast_inputs) -> (outputs, targets)
    criterion: Callable[..., torch.Tensor]  # (outputs, targets) -> scalar loss; unit scaling swaps it
    evaluate: Callable[[nn.Module, Callable], dict]  # (model, cast_inputs) -> metrics
    batch_size: int
    steps_per_epoch: int
