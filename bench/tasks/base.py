"""What the training loop needs from a task (`Task`), and what the rest of the suite needs to know about a model
(`TaskSpec`, declared in the model's yaml under `model.task`)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch
import torch.nn.functional as F
from omegaconf import MISSING
from torch import nn

from bench.errors import ConfigError
from bench.numerics.swap import retie, tied_parameters


def built_on(device: torch.device, build: Callable[[], nn.Module]) -> nn.Module:
    """A model made from scratch by `build()`, on `device`. For the meta device (the speed model's traces) it is
    built there, where no weight is drawn: initialising BERT-large on the CPU took 3 s a trace. Elsewhere it is built
    on the CPU, where its seeded initialisation draws, then moved (on_device)."""
    if device.type == "meta":
        with torch.device("meta"):
            return build()
    return on_device(build(), device)


def on_device(model: nn.Module, device: torch.device) -> nn.Module:
    """`model.to(device)` keeping its tied parameters tied: moving to another kind of device (the meta device the
    speed model traces on) gives each module a parameter of its own, which would count a tied head twice and leave
    BERT's MLM head's bias apart from its decoder's."""
    ties = tied_parameters(model)
    model = model.to(device)
    retie(model, ties)
    return model


@dataclass
class Task:
    model: nn.Module
    train_batches: Callable[[int], Iterator]  # epoch -> batches, reshuffled per epoch, deterministic
    forward: Callable[[nn.Module, object, Callable], tuple]  # (model, batch, cast_inputs) -> (outputs, targets)
    loss: Callable[[object, object, Callable], torch.Tensor]  # (outputs, targets, cross_entropy) -> scalar loss
    evaluate: Callable[[nn.Module, Callable], dict]  # (model, cast_inputs) -> final metrics
    batch_size: int
    steps_per_epoch: int
    # (model, cast_inputs) -> validation metrics (never the test set's): the quality curve's points, after each epoch
    # or every `TaskSpec.eval_every` steps; None: the curve has only the final evaluation
    validate: Callable[[nn.Module, Callable], dict] | None = None
    cross_entropy: Callable[..., torch.Tensor] = F.cross_entropy  # unit scaling swaps in unit_scaling's
    # whether cross_entropy's backward averages its terms (torch's) or sums them (unit scaling's and u-μP's, whose
    # gradients do not shrink with the batch): what a distributed step weights by a rank's share (loss_terms)
    gradient_averages_terms: bool = True
    # batch -> how many terms its loss averages (a tensor), for a task whose shares of a batch can hold unequal numbers
    # of them (a masked LM's chosen positions): each rank's mean is weighted so the ranks' average is the batch's
    loss_terms: Callable[[object], torch.Tensor] | None = None
    source: dict | None = None  # what the model was built from (checkpoint, commit, initialised head), for the record
    lr_multipliers: dict | None = None  # parameter -> factor on the optimiser's lr (unit scaling's relative rule)

    def compute_loss(self, outputs, targets) -> torch.Tensor:
        try:
            return self.loss(outputs, targets, self.cross_entropy)
        except (RuntimeError, ValueError, IndexError) as e:
            if any(isinstance(t, torch.Tensor) and t.is_meta for t in (outputs, targets)) and "shape" not in str(e) \
                    and "size" not in str(e):
                raise  # the meta device cannot run this loss (bench/speed/trace.py falls back to the CPU)
            raise OutputMismatch(
                f"the model's forward returns outputs that do not fit the task's loss ({str(e).splitlines()[0]}): "
                f"outputs {_shape(outputs)}, targets {_shape(targets)}; the loss is cross-entropy over (batch, classes)"
                f" logits and (batch,) class indices, or (batch, classes, ...) and (batch, ...). The model is "
                f"{type(self.model).__module__}.{type(self.model).__qualname__}: check its forward, and the task's "
                "forward(model, batch, cast_inputs) -> (outputs, targets) (docs/extending.md)") from None


class OutputMismatch(ConfigError):
    """A model whose outputs do not fit its task's loss: found on the first step, before training (exit 2)."""


def _shape(value) -> str:
    return f"of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else f"of type {type(value).__name__}"


# The range of each unit (METRIC_UNITS), where a metric's values must lie.
UNIT_RANGES = {"fraction": (0.0, 1.0), "percent": (0.0, 100.0), "nats": (0.0, float("inf"))}


class MetricOutOfRange(ValueError):
    """A metric outside its declared unit's range, or none returned: the run is recorded failed, saying why."""


def check_metric_returned(metric: str, metrics: dict) -> None:
    """MetricOutOfRange where the task's evaluation returned no value of its declared metric (`task.metric`): the
    run is recorded failed, naming what it returned, rather than tabled "–" as if it had run."""
    if metric not in metrics:
        raise MetricOutOfRange(f"evaluate() returned no {metric} (model.task.metric); it returned: "
                               f"{', '.join(sorted(metrics)) or 'nothing'}")


def check_metric_unit(metric: str, value, unit: str) -> None:
    """MetricOutOfRange for a metric outside its declared unit's range (a percentage declared a fraction would be
    tabled 100 times too large)."""
    low, high = UNIT_RANGES[unit]
    if isinstance(value, (int, float)) and value == value and not low <= value <= high:
        better = [u for u, (lo, hi) in UNIT_RANGES.items() if lo <= value <= hi and u != unit]
        raise MetricOutOfRange(f"metric {metric}={value:g} is outside [{low:g}, {high:g}], the range of its declared "
                               f"unit model.task.unit={unit}"
                               + (f": declare unit: {better[0]} in the model's yaml, or return the metric in its unit"
                                  if better else ""))


# A metric's unit: fraction (in [0, 1], shown as a percentage), percent (in [0, 100]), nats (a cross-entropy, >= 0).
METRIC_UNITS = ("fraction", "percent", "nats")


@dataclass
class TaskSpec:
    """A model's declaration, `model.task` in its yaml: the one place the suite learns what a model is. The runner
    builds it from `_target_`, the config check validates `model.data.source` and calls `check`, `make prepare`
    fetches `hub_model`, tables and plots take `metric` and `describe`'s label, the dashboard charts `report`.
    Functions are named by import path, so a model in the user's own module needs no edit to bench/.

    It is not part of a run's identity (bench/running/identity.py): it says how to read a model, not what it computes.
    """

    _target_: str = MISSING  # the builder: (model config, torch.device, seed) -> Task
    metric: str = MISSING  # the primary metric in the record's `metrics`: the tables' value, the paired difference
    unit: str = "fraction"  # the metric's unit (METRIC_UNITS): how tables show it and the range its intervals keep to
    higher_is_better: bool = True
    # the metric a model reaches by guessing (LeNet's ten digits: 0.1), in its recorded units; a 32-true cell within
    # a tenth of the way from it to a perfect score has learned nothing to compare against (bench.reporting.quality
    # near_chance), and the tables say so instead of a difference; null: not declared
    chance: Optional[float] = None
    # the quality curve (time to target): the validation metric it plots (null: `metric`), and the steps between its
    # evaluations (null: after each epoch, where the task validates); both are how to read and watch a model, not
    # what it computes
    curve_metric: Optional[str] = None
    eval_every: Optional[int] = None
    report: list = field(default_factory=list)  # the metrics the dashboard charts ([]: just `metric`)
    # the module name of the model's list of repeated blocks (charlm: h; BERT: bert.encoder.layer), which
    # format.keep_high_precision's first_blocks:<n> / last_blocks:<n> count; null: the model declares none
    blocks: Optional[str] = None
    data_sources: list = field(default_factory=lambda: ["local"])  # the valid `model.data.source` values
    hub_model: Optional[str] = None  # transformers Auto class that `make prepare` loads `model.hub_name` with
    check: Optional[str] = None  # function (model config) -> None, raising bench.errors.ConfigError on a bad key
    describe: str = "bench.tasks.base.describe"  # function (model config as a dict) -> (dataset, table label)


# Hub datasets by the names the published figures use (bench/reporting/reference/published.yaml, `task`).
HUB_DATASETS = {"ylecun/mnist": "mnist", "stanfordnlp/imdb": "imdb", "rajpurkar/squad": "squad_v1.1"}


def block_of(name: str, blocks: str | None) -> str | None:
    """The repeated block a module or parameter `name` is in (`blocks`: the model's TaskSpec.blocks, their container's
    dotted path), as that block's module name (h.3 for h.3.attn.q.weight); None outside them."""
    if not blocks or not name.startswith(f"{blocks}."):
        return None
    return f"{blocks}.{name[len(blocks) + 1:].split('.', 1)[0]}"


def hub_dataset(data: dict) -> str:
    return HUB_DATASETS.get(data["name"], data["name"])


def describe(model_cfg: dict) -> tuple[str, str]:
    """(dataset, label): a hub dataset by its published name, other data by its source; `<name> (<dataset>)`."""
    data = model_cfg["data"]
    dataset = hub_dataset(data) if data.get("source") == "hub" else str(data.get("source"))
    return dataset, f"{model_cfg['name']} ({dataset})"


# What bench.tools.export_encoder marks a pretrained checkpoint's config with, each as `precision_bench_<key>`: the
# parametrisation it was trained in (a ScalingMethod's) and, under unit scaling, its post-norm branch weight.
CHECKPOINT_MARKS = ("parametrisation", "post_norm_tau")


def checkpoint_marks(config: dict) -> dict:
    """The marks (CHECKPOINT_MARKS) a checkpoint's config carries, by key; {} for any other checkpoint."""
    return {key: config[f"precision_bench_{key}"] for key in CHECKPOINT_MARKS if f"precision_bench_{key}" in config}


def trained_parametrisation(hub_name) -> str | None:
    """The parametrisation a local checkpoint directory says it was pretrained in (`checkpoint_marks`), read from its
    config.json alone; None for any other checkpoint."""
    config = Path(str(hub_name)) / "config.json"
    return checkpoint_marks(json.loads(config.read_text())).get("parametrisation") if config.is_file() else None
