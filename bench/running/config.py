"""The config schema and its checks: a bad config fails here, before any training, naming the valid choices.

The structured schema (registered with Hydra as `base_config`) rejects unknown fields; `check()`
then validates every choice and cross-field combination. Choice fields are plain strings rather
than Enums because Hydra's override grammar parses `format.mode=true` as a boolean.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from bench import plugins
from bench.data import DATA_DIR
from bench.errors import (  # bench.running.config.ConfigError: the same class
    ConfigError,
    check_choice,
    located,
    suggestion,
)
from bench.numerics import fused
from bench.numerics.master_weights import MASTER_WEIGHTS
from bench.numerics.plan import FORMAT_DEFAULTS, FormatChoices, PrecisionConfig
from bench.numerics.precision import EVAL_PRECISIONS
from bench.numerics.scaling_methods import build as build_scaling_method
from bench.numerics.scaling_methods import check_parametrisation, scaling_schema
from bench.numerics.specs import FORMAT_SPECS
from bench.running import parallel
from bench.running.device import DEVICES, parallel_jobs
from bench.running.identity import cell_path
from bench.tasks.base import METRIC_UNITS, TaskSpec, trained_parametrisation
from bench.tasks.charlm import SHAKESPEARE_SHA256
from bench.tasks.optimizer import STATE_FORMATS

SCHEDULES = ("none", "linear", "cosine")
OPTIMIZERS = ("sgd", "adam", "adamw")
LOGGERS = ("none", "wandb")

CONF_DIR = DATA_DIR.parents[1] / "conf"  # the Hydra configs, beside the package in the checkout
OmegaConf.register_new_resolver("bench_data", lambda relative: str(DATA_DIR / relative), replace=True)
OmegaConf.register_new_resolver("bench_parallel_jobs", parallel_jobs, replace=True)  # LAUNCHER=parallel's n_jobs


@functools.lru_cache(maxsize=None)
def preset_sweeper(experiment: str) -> DictConfig | None:
    """conf/experiment/<experiment>.yaml's `hydra.sweeper` (its params, settings, table, quality target) as Hydra
    composes it for a sweep, a preset's defaults list included (nvfp4_recipe_2000 takes nvfp4_recipe's settings);
    None where no such preset exists (records of a sweep without one)."""
    if not (CONF_DIR / "experiment" / f"{experiment}.yaml").is_file():
        return None
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    def composed():
        return compose("config", overrides=[f"experiment={experiment}"], return_hydra_config=True).hydra.sweeper

    if GlobalHydra.instance().is_initialized():  # inside a Hydra app (a sweep checks its table before it starts)
        return composed()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return composed()


def _cell_resolver(*, _root_: DictConfig) -> str:
    """`cell: ${bench_cell:}`: in a Hydra job, from this job's choices and overrides (Hydra sets its
    HydraConfig before it resolves the job's directory); composed outside a job, from the config alone."""
    from hydra.core.hydra_config import HydraConfig

    hydra = _root_.hydra if "hydra" in _root_ else (HydraConfig.get() if HydraConfig.initialized() else None)
    if hydra is None:
        return cell_path(_root_)
    return cell_path(_root_, dict(hydra.runtime.choices), list(hydra.overrides.task))


OmegaConf.register_new_resolver("bench_cell", _cell_resolver, replace=True)


FormatConfig = FormatChoices.schema()  # format.*: declared once, in bench/numerics/plan.py


ScalingConfig = scaling_schema()  # scaling.*: each knob declared once, by its method (scaling_methods.py)


@dataclass
class OptimizerConfig:
    name: str = "sgd"  # sgd | adam | adamw
    lr: float = 0.01
    momentum: float = 0.0
    beta2: float = 0.999  # adam/adamw
    weight_decay: float = 0.0
    decay_matrices_only: bool = False  # weight decay on parameters of 2+ dimensions only (nanoGPT, GPT-2)
    schedule: str = "none"  # none | linear (decay to 0 over the run) | cosine (nanoGPT: warm-up, then to min_lr)
    warmup_steps: int = 0  # cosine: linear warm-up
    min_lr: float = 0.0  # cosine: the learning rate at the end of the decay
    grad_clip: Optional[float] = None  # clip the gradients' global norm (after unscaling) to this
    state_format: str = "fp32"  # the moments as stored: fp32 | bf16 | int8 | int4 | fp8 (adam/adamw; torchao's)


@dataclass
class ImageDataConfig:
    source: str = "digits"  # digits (offline) | hub
    name: str = "ylecun/mnist"  # hub dataset id
    test_fraction: float = 0.2  # digits: fixed stratified split
    val_fraction: float = 0.1  # of the training set: a fixed stratified validation split (0: none)
    augment_shift: int = 0  # random translation of each training batch by up to N pixels


@dataclass
class TextDataConfig:
    source: str = "hub"  # hub | local
    name: str = MISSING  # hub dataset id
    files: dict = field(default_factory=dict)  # local: {split: path} in the hub schema (json/jsonl/csv/parquet)
    split: list = field(default_factory=lambda: [0.7, 0.1, 0.2])  # pooled train/val/test fractions (IMDb)
    seed: int = 123  # shuffle seed of the pooled split (Raschka's)


@dataclass
class ArchConfig:
    """Size of a randomly initialised transformer (model.pretrained=false)."""

    layers: int = 2
    hidden: int = 64
    heads: int = 2
    intermediate: int = 128
    # the embedding's rows; null: the tokenizer's (model.vocab). A published checkpoint's architecture names its own
    # (bench/data/hub_architectures.yaml), at which the speed model traces a checkpoint not cached here
    vocab_size: Optional[int] = None


@dataclass
class ModelConfig:
    """The schema of a model defined outside bench/ (`/model_schema@_here_` in its yaml): what the runner reads
    of every model. Its builder's own keys go under `arch` and `data`, which take any keys (docs/extending.md)."""

    name: str = MISSING
    task: TaskSpec = MISSING
    epochs: int = 1
    batch_size: int = 32
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    data: Any = field(default_factory=lambda: {"source": "local"})
    arch: Any = field(default_factory=dict)


@dataclass
class LeNetConfig:
    name: str = "lenet"
    task: TaskSpec = MISSING
    epochs: int = 20
    batch_size: int = 32
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    data: ImageDataConfig = field(default_factory=ImageDataConfig)


@dataclass
class TransformerConfig:
    name: str = MISSING
    task: TaskSpec = MISSING
    hub_name: str = MISSING  # checkpoint id for pretrained=true
    pretrained: bool = True  # false: architecture from its config class at `arch` size, random init
    vocab: str = MISSING  # vocabulary file for the offline tokenizer (pretrained=false)
    arch: ArchConfig = field(default_factory=ArchConfig)
    max_length: int = 512
    epochs: int = 3
    batch_size: int = 12
    eval_batch_size: int = 64
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    data: TextDataConfig = field(default_factory=TextDataConfig)


@dataclass
class CharLMArchConfig:
    layers: int = 4
    heads: int = 4
    embedding: int = 128
    block_size: int = 64
    dropout: float = 0.0
    bias: bool = False  # biases in Linear and LayerNorm (nanoGPT's train.py default: none)
    norm: str = "pre"  # pre | post


@dataclass
class CharDataConfig:
    source: str = "download"  # download: `url`, once, into ~/.cache/precision-bench | local: read `path`
    path: Optional[str] = None  # the local copy (source=local)
    url: str = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
    sha256: Optional[str] = SHAKESPEARE_SHA256  # null: any text
    train_fraction: float = 0.9


@dataclass
class CharLMConfig:
    name: str = "charlm"
    task: TaskSpec = MISSING
    epochs: int = 1  # one pass of `iterations` random batches
    iterations: int = 2000
    batch_size: int = 12
    eval_batch_size: int = 256  # validation windows per forward (the whole split is evaluated)
    arch: CharLMArchConfig = field(default_factory=CharLMArchConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    data: CharDataConfig = field(default_factory=CharDataConfig)


@dataclass
class MLMArchConfig:
    family: str = "bert"  # bert | distilbert: transformers' masked-LM model of that family (bench/tasks/mlm.py)
    layers: int = 2
    hidden: int = 64
    heads: int = 2
    intermediate: int = 128
    block_size: int = 64  # characters per window (and the position embeddings' length)
    dropout: Optional[float] = None  # the hidden and attention dropout, in [0, 1); null: transformers' (0.1, BERT's)


@dataclass
class MLMConfig:
    name: str = MISSING
    task: TaskSpec = MISSING
    epochs: int = 1  # one pass of `iterations` random batches
    iterations: int = 500
    batch_size: int = 32
    eval_batch_size: int = 256  # validation windows per forward (the whole split is evaluated)
    mask_rate: float = 0.15  # BERT's: of the chosen positions 80% [MASK], 10% a random piece, 10% unchanged
    vocab: str = MISSING  # the WordPiece vocabulary file (bench/data/vocab.txt)
    tie_embeddings: bool = True  # the output head shares the word embeddings, as BERT's does
    arch: MLMArchConfig = field(default_factory=MLMArchConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    data: CharDataConfig = field(default_factory=CharDataConfig)


@dataclass
class QAConfig(TransformerConfig):
    doc_stride: int = 128
    n_best: int = 20
    max_answer_length: int = 30


@dataclass
class TrainConfig:
    epochs: int = MISSING
    max_steps: Optional[int] = None  # caps optimiser steps (smoke runs)
    loss_multiplier: float = 1.0  # on the loss before backward, divided out of the FP32 grads (stress tests)
    log_every: int = 10  # metrics.jsonl line and telemetry sample every N steps
    checkpoint_every: Optional[int] = None  # also checkpoint every N steps (always on SIGUSR2/SIGTERM)
    keep_checkpoint: bool = False  # keep the final checkpoint (weights, optimiser) after a finished run
    compile: Any = None  # torch.compile the forward and loss: null or auto (on CUDA only), true, false
    eval_precision: str = "trained"  # trained (evaluate as the cell trained: autocast, rounding sites) | fp32
    master_weights: str = "fp32"  # a mixed run's parameters: fp32 | bf16 | bf16_stochastic | bf16_kahan


@dataclass
class ParallelConfig:
    """parallel.*: one cell on several processes (bench/running/parallel.py; conf/parallel/)."""

    name: str = "none"  # none | ddp | fsdp2
    world_size: int = 1  # ranks of the cell's job
    param_dtype: str = "fp32"  # fsdp2: the type parameters are all-gathered and computed in (fp32 | bf16 | fp16)
    reduce_dtype: str = "fp32"  # fsdp2: the type gradients are reduce-scattered in
    gradient_compression: str = "none"  # ddp: the type gradient buckets are all-reduced in (none = fp32 | bf16 | fp16)
    fp8_all_gather: bool = False  # torchao's FP8 all-gather of FP8 weights: not built yet


@dataclass
class LoggerConfig:
    name: str = "none"
    project: str = "precision-bench"
    entity: Optional[str] = None
    mode: Optional[str] = None  # None: online with an API key, offline without


@dataclass
class Config:
    model: Any = MISSING  # one of the model schemas below, chosen by the model option's defaults
    format: FormatConfig = MISSING
    scaling: ScalingConfig = MISSING
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    experiment_name: str = "default"  # groups records and tables; experiment presets set it
    seed: int = 0
    threads: Optional[int] = 1  # torch intra-op CPU threads; null = torch's default (one per core)
    device: str = "auto"
    results_dir: str = "results/runs"
    cell: str = MISSING  # derived: where this cell's record goes under results_dir
    retry_failed: bool = False  # re-run cells whose record says failed or diverged (ok cells never re-run)
    fail_fast: bool = False  # re-raise a cell's exception (stops a sweep) instead of recording and going on
    plugins: list = field(default_factory=list)  # modules declaring a user's formats, models, scaling methods


def register_schema() -> None:
    store = ConfigStore.instance()
    store.store(name="base_config", node=Config)
    # Outside the `model` group: model yamls extend them (`/lenet_schema@_here_`), but they are not models.
    store.store(name="lenet_schema", node=LeNetConfig)
    store.store(name="classifier_schema", node=TransformerConfig)
    store.store(name="qa_schema", node=QAConfig)
    store.store(name="charlm_schema", node=CharLMConfig)
    store.store(name="mlm_schema", node=MLMConfig)
    store.store(name="model_schema", node=ModelConfig)


register_schema()


def unknown_keys(node: DictConfig, path: str = "") -> list[str]:
    """Keys that no schema declares, however they got in (Hydra's `+key=value` adds keys past the schema),
    each with the nearest declared key as a suggestion."""
    schema = OmegaConf.get_type(node)
    if not dataclasses.is_dataclass(schema):
        return []
    known = [f.name for f in dataclasses.fields(schema)]
    found = []
    for key in node.keys():
        if key not in known:
            found.append(f"{path}{key}{suggestion(key, known, prefix=path)}")
        elif isinstance(child := node._get_node(key), DictConfig) and not child._is_missing() and not child._is_none():
            found += unknown_keys(child, f"{path}{key}.")
    return found


def check(cfg: DictConfig) -> None:
    """Import the plug-ins, then validate keys, choices and combinations; normalise `format.mode`. Raises
    ConfigError."""
    plugins.load(cfg.get("plugins") or (), named_by="the plugins: config key")
    if unknown := unknown_keys(cfg):
        raise ConfigError(f"unknown config key{'s' * (len(unknown) > 1)}: {', '.join(unknown)}; every key is"
                          " documented in conf/README.md")
    _check_model(cfg.model)
    cfg.format.mode = str(cfg.format.mode).lower()
    method = build_scaling_method(cfg.scaling)
    method.check()  # the method's knobs (and its class, imported by _target_)
    if cfg.model.get("pretrained", False) and cfg.model.get("hub_name"):  # a unit-scaled checkpoint's own method
        check_parametrisation(trained_parametrisation(cfg.model.hub_name), method, cfg.model.hub_name)
    if cfg.format.name not in FORMAT_SPECS:  # its yaml composed (or a name set), but no module here declares it
        raise ConfigError(f"format={cfg.format.name!r} is not valid; valid: {', '.join(FORMAT_SPECS)} (a format of "
                          "your own is declared by its module: name it with plugins=[<module>], or install it with a "
                          "precision_bench.plugins entry point: docs/extending.md)")
    PrecisionConfig.from_config(cfg)  # the format's choices and their combinations with the scaling method
    parallel.check(cfg)
    check_choice(cfg.device, DEVICES, "device")
    check_choice(fused.compile_when(), fused.COMPILE_WHEN_CHOICES, fused.COMPILE_WHEN)  # the environment's
    check_choice(cfg.train.eval_precision, EVAL_PRECISIONS, "train.eval_precision")
    check_choice(cfg.train.master_weights, MASTER_WEIGHTS, "train.master_weights")
    if cfg.train.master_weights != "fp32" and str(cfg.format.mode).lower() == "true" \
            and FORMAT_SPECS[cfg.format.name].recipe is not None:  # fp32 (32-true) stores FP32 parameters
        raise ConfigError(f"train.master_weights={cfg.train.master_weights}: format {cfg.format.name} in mode true "
                          "already stores the parameters in its own type; master weights apply where they are FP32 "
                          "(the mixed formats, fp32; valid here: fp32)")
    check_choice(cfg.logger.name, LOGGERS, "logger")
    if not (isinstance(cfg.seed, int) and 0 <= cfg.seed < 2**32):  # torch.manual_seed's range
        raise ConfigError(f"seed={cfg.seed}: a seed is a whole number from 0 to 2**32 - 1 (e.g. seed=0,1,2)")
    if not (cfg.train.loss_multiplier > 0 and math.isfinite(cfg.train.loss_multiplier)):
        raise ConfigError(f"train.loss_multiplier={cfg.train.loss_multiplier} must be finite and > 0")
    check_results_dir(cfg.results_dir)
    if cfg.threads is not None and cfg.threads < 1:
        raise ConfigError(f"threads={cfg.threads} must be >= 1 (or null for torch's default, one per core)")
    if cfg.train.epochs < 1:
        raise ConfigError(f"train.epochs={cfg.train.epochs} must be >= 1")
    for key in ("batch_size", "eval_batch_size"):
        if (size := cfg.model.get(key)) is not None and size < 1:
            raise ConfigError(f"model.{key}={size} must be >= 1")
    if not (cfg.train.compile in (None, "auto") or isinstance(cfg.train.compile, bool)):
        raise ConfigError(f"train.compile={cfg.train.compile!r} is not a choice; valid: null, auto, true, false")
    if cfg.train.compile is True and cfg.format.accumulation != FORMAT_DEFAULTS["accumulation"]:
        raise ConfigError(f"train.compile=true with format.accumulation={cfg.format.accumulation}: the tensor-core "
                          "model runs its own compiled kernels in every GEMM, which a compiled step cannot trace "
                          "through; valid: train.compile=auto (eager with it) or false")
    if cfg.train.checkpoint_every is not None and cfg.train.checkpoint_every < 1:
        raise ConfigError(f"train.checkpoint_every={cfg.train.checkpoint_every} must be >= 1 (or null)")
    if cfg.train.max_steps is not None and cfg.train.max_steps < 1:
        raise ConfigError(f"train.max_steps={cfg.train.max_steps} must be >= 1 (or null for no cap)")


def check_results_dir(path: Path | str) -> None:
    """Records must be writable there: the nearest existing directory on the way must accept new files."""
    if not str(path).strip():
        raise ConfigError("results_dir= is empty; name a directory (default: results/runs)")
    path = Path(path)
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"results_dir={path}: {existing} is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"results_dir={path}: {existing} is not writable by this user")


def _check_model(model: DictConfig) -> None:
    """What every model is asked (its declaration, data source, optimiser), then its own check (`task.check`)."""

    if "task" not in model or model._get_node("task")._is_missing():
        raise ConfigError(f"model {model.get('name')!r} declares no `task` (its builder, metric and data sources): "
                          "see docs/extending.md")
    check_choice(model.data.source, list(model.task.data_sources), "model.data.source")
    check_choice(model.task.unit, METRIC_UNITS, "model.task.unit")
    check_choice(model.optimizer.name, OPTIMIZERS, "model.optimizer.name")
    check_choice(model.optimizer.schedule, SCHEDULES, "model.optimizer.schedule")
    check_choice(model.optimizer.state_format, STATE_FORMATS, "model.optimizer.state_format")
    if model.optimizer.state_format != "fp32" and model.optimizer.name not in ("adam", "adamw"):
        raise ConfigError(f"model.optimizer.state_format={model.optimizer.state_format} needs an Adam optimiser "
                          f"(model.optimizer.name=adam or adamw; this model's is {model.optimizer.name}): valid for "
                          f"{model.optimizer.name}: fp32")
    if model.optimizer.grad_clip is not None and not model.optimizer.grad_clip > 0:
        raise ConfigError(f"model.optimizer.grad_clip={model.optimizer.grad_clip} must be > 0 (or null: no clipping)")
    for key in ("_target_", "describe", *(["check"] if model.task.check else [])):
        function = located(model.task[key], f"model.task.{key}", "a model's module")
        if key == "check":
            function(model)


def task_spec(model_cfg: dict) -> dict:
    """A recorded model's declaration: the record's own, over the declaration in the model's yaml of the same name
    (conf/model/<name>.yaml) where that exists, over TaskSpec's defaults. Records made before a key was declared (every
    model's `task` before 0.2.0, `unit` before 0.3.0) read it from the shipped yaml."""
    shipped = _shipped_task_spec(model_cfg["name"])
    if "task" not in model_cfg and shipped is None:
        raise ConfigError(f"model {model_cfg['name']!r}: its record declares no task and conf/model/"
                          f"{model_cfg['name']}.yaml does not exist")
    return {**(shipped or _DEFAULT_TASK_SPEC), **model_cfg.get("task", {})}


_DEFAULT_TASK_SPEC = {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
                      for f in dataclasses.fields(TaskSpec) if f.default is not MISSING}


@functools.lru_cache(maxsize=None)
def _shipped_task_spec(name: str) -> dict | None:
    path = CONF_DIR / "model" / f"{name}.yaml"
    spec = OmegaConf.load(path).get("task") if path.is_file() else None
    if spec is None:
        return None
    return OmegaConf.to_container(OmegaConf.merge(OmegaConf.structured(TaskSpec), spec))


def declarations(cfg: DictConfig) -> dict:
    """What the record says of where its cell's format, model and scaling method were declared (`env.plugins`): the
    plug-in modules imported, and each one's declaring module, so that reading the record elsewhere can name the
    module to install."""
    from bench.numerics.specs import format_spec

    return {"modules": plugins.imported(), "format": format_spec(cfg.format.name).declared_in,
            "model": str(cfg.model.task._target_).rsplit(".", 1)[0],
            "scaling": type(build_scaling_method(cfg.scaling)).__module__}


def check_declared(records: list[dict]) -> None:
    """Before records are read by name: import the plug-ins they name (`env.plugins.modules`) and the installed ones,
    then ConfigError for the first record whose format, model or scaling method is not declared in this process,
    naming it and the module its record says declared it. Reporting never drops such a record's rows silently."""
    from bench.numerics.scaling_methods import SCALING_METHODS

    why_not: dict[str, str] = {}
    plugins.load()
    named = [(r["env"].get("plugins") or {}) for r in records]
    for module in dict.fromkeys(m for n in named for m in [*(n.get("modules") or []), n.get("format"), n.get("scaling")]
                                if m and not m.startswith("bench.")):  # the plug-ins and the declaring modules
        try:
            plugins.load([module], named_by="the records")
        except ConfigError as e:
            why_not[module] = str(e).split(": ", 1)[1].split("; a plug-in", 1)[0]

    def missing(kind: str, name: str, record: dict) -> ConfigError:
        module = (record["env"].get("plugins") or {}).get(kind)
        where = (f"its record says module {module!r} declared it"
                 + (f", which cannot be imported here ({why_not[module]})"
                    if module in why_not else ", which does not declare it here") if module else
                 "its record (made before records named their plug-ins) does not say which module declared it")
        return ConfigError(f"{record.get('_dir') or record.get('run_id', 'a record')}: {kind} {name!r} is not "
                           f"declared in this process; {where}. Put that module on PYTHONPATH (or install it), or name "
                           "it in plugins:, then run again; nothing was written")

    for record in records:
        config = record["config"]
        fmt = (record["env"].get("precision") or {}).get("format") or config["format"]["name"]
        if fmt not in FORMAT_SPECS:
            raise missing("format", fmt, record)
        scaling = config["scaling"]
        if scaling["name"] not in SCALING_METHODS:
            try:
                build_scaling_method(OmegaConf.create(scaling))
            except ConfigError:
                raise missing("scaling", scaling["name"], record) from None
        try:
            task_spec(config["model"])
        except ConfigError:
            raise missing("model", config["model"]["name"], record) from None
