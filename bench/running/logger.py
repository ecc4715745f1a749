"""Loggers beside the local record. The local record is the source of truth: a logger that fails
(W&B unreachable, not installed) warns and turns itself off, it never fails a run."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from omegaconf import DictConfig

log = logging.getLogger(__name__)


class NullLogger:
    def log(self, row: dict) -> None:
        pass

    def finish(self, record: dict | None) -> None:
        pass


class WandbLogger:
    """One W&B run per cell: id = the run's identity hash, group = experiment_name, job_type = model,
    tags = format / mode / backend / scaling, name = the cell path; resumed when the cell resumes."""

    def __init__(self, cfg: DictConfig, run_dir: Path, config: dict, tags: list[str], identity: str):
        import wandb

        self._wandb = wandb
        mode = cfg.logger.mode or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
        self.run = wandb.init(
            project=cfg.logger.project, entity=cfg.logger.entity, mode=mode, dir=str(run_dir),
            group=cfg.experiment_name, job_type=cfg.model.name, tags=tags, name=cfg.cell.replace("/", ":"),
            id=identity, resume="allow", config=config, reinit="finish_previous",
        )

    def log(self, row: dict) -> None:
        self.run.log(row, step=row["step"])

    def finish(self, record: dict | None) -> None:
        try:
            if record is not None:
                self.run.summary.update(record)
        finally:
            self.run.finish(exit_code=1 if record is None or record["status"] == "failed" else 0)


class _SafeLogger:
    """Wraps a logger so that its errors are logged once and then ignored."""

    def __init__(self, inner):
        self.inner = inner

    def _call(self, method: str, arg) -> None:
        if self.inner is None:
            return
        try:
            getattr(self.inner, method)(arg)
        except Exception as e:  # a logger must never fail the run
            log.warning("logger %s failed (%s); continuing with the local record only", type(self.inner).__name__, e)
            self.inner = None

    def log(self, row: dict) -> None:
        self._call("log", row)

    def finish(self, record: dict | None) -> None:
        self._call("finish", record)


def open_logger(cfg: DictConfig, run_dir: Path, config: dict, tags: list[str], identity: str):
    if cfg.logger.name == "none":
        return NullLogger()
    try:
        return _SafeLogger(WandbLogger(cfg, run_dir, config, tags, identity))
    except Exception as e:
        log.warning("W&B could not start (%s); continuing with the local record only", e)
        return NullLogger()
