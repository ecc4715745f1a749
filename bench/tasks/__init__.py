"""Tasks: model + data + loss + metric. `build_task(cfg, device, seed)` is the one entry point."""

from __future__ import annotations

import torch
from omegaconf import DictConfig

from bench.tasks.base import Task


def build_task(model_cfg: DictConfig, device: torch.device, seed: int) -> Task:
    if model_cfg.name == "lenet":
        from bench.tasks.lenet import lenet_task

        return lenet_task(model_cfg, device, seed)
    raise ValueError(f"unknown model {model_cfg.name!r}")
