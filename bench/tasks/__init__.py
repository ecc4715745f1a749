"""Tasks: model + data + loss + metric. `build_task(model_cfg, device, seed)` is the one entry point."""

from __future__ import annotations

import torch
from omegaconf import DictConfig

from bench.tasks.base import Task

PRIMARY_METRIC = {"lenet": "test_accuracy", "distilbert": "test_accuracy", "bert_base": "f1", "charlm": "val_loss"}


def build_task(model_cfg: DictConfig, device: torch.device, seed: int) -> Task:
    if model_cfg.name == "lenet":
        from bench.tasks.lenet import lenet_task as make
    elif model_cfg.name == "distilbert":
        from bench.tasks.imdb import imdb_task as make
    elif model_cfg.name == "bert_base":
        from bench.tasks.squad import squad_task as make
    elif model_cfg.name == "charlm":
        from bench.tasks.charlm import charlm_task as make
    else:
        raise ValueError(f"unknown model {model_cfg.name!r}; valid: {', '.join(PRIMARY_METRIC)}")
    return make(model_cfg, device, seed)
