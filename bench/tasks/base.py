"""What the training loop needs from a task, and nothing more."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class Task:
    model: nn.Module
    train_batches: Callable[[int], Iterator]  # epoch -> batches, reshuffled per epoch, deterministic
    forward: Callable[[nn.Module, object, Callable], tuple]  # (model, batch, cast_inputs) -> (outputs, targets)
    loss: Callable[[object, object, Callable], torch.Tensor]  # (outputs, targets, cross_entropy) -> scalar loss
    evaluate: Callable[[nn.Module, Callable], dict]  # (model, cast_inputs) -> final metrics
    batch_size: int
    steps_per_epoch: int
    validate: Callable[[nn.Module, Callable], dict] | None = None  # per-epoch metrics, when the task has them
    cross_entropy: Callable[..., torch.Tensor] = F.cross_entropy  # unit scaling swaps in unit_scaling's
    source: dict | None = None  # what the model was built from (checkpoint, commit, initialised head), for the record
    lr_multipliers: dict | None = None  # parameter -> factor on the optimiser's lr (unit scaling's relative rule)

    def compute_loss(self, outputs, targets) -> torch.Tensor:
        return self.loss(outputs, targets, self.cross_entropy)
