"""Tasks: model + data + loss + metric. A model's yaml names its builder (`model.task._target_`, TaskSpec in
base.py); `build_task(model_cfg, device, seed)` calls it, so bench/ holds no list of models."""

from __future__ import annotations

import torch
from hydra.utils import get_method
from omegaconf import DictConfig

from bench.tasks.base import Task


def build_task(model_cfg: DictConfig, device: torch.device, seed: int) -> Task:
    return get_method(model_cfg.task._target_)(model_cfg, device, seed)
