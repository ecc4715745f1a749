"""Run one cell (model x format x scaling x seed) and write its record.

    python -m bench.run model=lenet format=bf16 scaling=dynamic seed=1
    python -m bench.run -m format=fp32,fp16 scaling=none,dynamic      # a sweep
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import shutil
import signal
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import hydra
import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from bench.numerics.plan import PrecisionConfig
from bench.numerics.precision import Precision, PrecisionError
from bench.numerics.scaling import LossScaler
from bench.numerics.scaling_methods import ScalingMethod, transform_task
from bench.numerics.scaling_methods import build as build_scaling_method
from bench.numerics.unit import ConversionError
from bench.running import checkpoint, parallel
from bench.running import device as devices
from bench.running.checkpoint import Checkpointer, DistributedCheckpointer
from bench.running.command_line import check_command_line, check_yaml_files
from bench.running.compile import compiling
from bench.running.config import CONF_DIR, ConfigError, check, declarations
from bench.running.identity import run_id
from bench.running.learning import learning_summary
from bench.running.logger import NullLogger, open_logger
from bench.running.record import (
    IN_FLIGHT,
    LOCK_NAME,
    RETRY_HINT,
    WRITE_MARGIN_BYTES,
    MetricsLog,
    StorageError,
    cell_lock,
    logged_losses,
    previous_record,
    require_free_space,
    storage_errors,
    write_json_atomic,
)
from bench.running.train import build_schedule, total_steps, train
from bench.tasks import Task, build_task
from bench.tasks.base import check_metric_returned, check_metric_unit
from bench.tasks.optimizer import build_optimizer, traced_config

if TYPE_CHECKING:  # the speed model (and torch._dynamo under it, ~1 s) is imported by a cell that runs, not before
    from bench.speed.trace import StepTrace

log = logging.getLogger(__name__)


class DeviceError(ConfigError):
    """This machine's device cannot run the cell (no GPU, no native path for the format)."""


def preflight(cfg: DictConfig, device_checks: bool = True) -> tuple[torch.device, Precision] | None:
    """Every check that can fail before training: choices and combinations, the scaling method's rules for the
    model's layers, then (unless `device_checks` is off, as for cells that will run on other machines) what the
    device here supports."""
    check(cfg)
    check_model(cfg)
    return device_preflight(cfg) if device_checks else None


_MODELS_CHECKED: set[str] = set()  # (model, scaling) configs whose throwaway build passed check_model


def check_model(cfg: DictConfig) -> None:
    """The cell's model built on the CPU and stepped once (forward and loss, no update), once per model and scaling
    config, where a mistake could hide until training: under a scaling method that changes the model (unit scaling,
    u-μP, a user's `transform`: a layer or op it has no rule for), for a model of a user's (outputs that do not
    fit the task's loss), and for a format that names layers (format.keep_high_precision) or needs whole 16 x 16
    weight tiles, or a user's method that scales each rounding site (the precision is then applied to the built
    model). It refuses the cell here (ConfigError), before any cell trains. The shipped models under the other
    methods are not built (their first step is checked by every test run). A model that cannot be built here (a
    checkpoint not cached) is left to its run, which records why."""
    method = build_scaling_method(cfg.scaling)
    transforms = type(method).transform is not ScalingMethod.transform
    # the precision applied to the built model: where the format names layers, or a user's method scales each site
    prepares = PrecisionConfig.from_config(cfg).by_layer or (
        method.site_scales and not type(method).__module__.startswith("bench."))
    if not transforms and not prepares and str(cfg.model.task._target_).startswith("bench."):
        return
    key = json.dumps([OmegaConf.to_container(cfg.model, resolve=True),
                      OmegaConf.to_container(cfg.scaling, resolve=True),
                      OmegaConf.to_container(cfg.format, resolve=True) if prepares else None],
                     sort_keys=True, default=str)
    if key in _MODELS_CHECKED:
        return
    with torch.random.fork_rng(devices=[]):
        try:
            task = build_task(cfg.model, torch.device("cpu"), cfg.seed)
        except ConfigError:
            raise
        except Exception as e:  # noqa: BLE001 - the run itself builds it again, and records what failed
            log.info("%s: not checked before training, the model could not be built here (%s)", cfg.cell, e)
            return
        try:
            transform_task(method, task, cfg.model.get("pretrained", False), cfg.model.optimizer.name)
        except ConversionError:
            pass  # a pretrained conversion that changed the function: measured, so recorded by the run
        with torch.no_grad():
            task.compute_loss(*task.forward(task.model, next(iter(task.train_batches(0))), lambda x: x))
        if prepares:  # PrecisionError names the layer, or the method whose site scaler cannot scale
            Precision.from_config(cfg, torch.device("cpu")).prepare(task.model, cfg.model.task.get("blocks"))
    _MODELS_CHECKED.add(key)


def device_preflight(cfg: DictConfig) -> tuple[torch.device, Precision]:
    """The device this machine offers for the cell, and the precision decided on it; DeviceError if it cannot."""
    try:
        device = devices.select_device(cfg.device)
        return device, build_precision(cfg, device)
    except (ValueError, PrecisionError) as e:
        raise DeviceError(str(e)) from None


build_precision = Precision.from_config  # the cell's precision on a device


def build_scaler(cfg: DictConfig, precision: Precision) -> LossScaler:
    """The cell's loss scaler, as its scaling method runs it."""
    return precision.method.loss_scaler(cfg.train.loss_multiplier, cfg.model.optimizer.grad_clip, cfg.train.log_every)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


@dataclass
class Cell:
    """Everything one cell trains with, built from its config."""

    task: Task
    scaler: LossScaler
    optimizer: torch.optim.Optimizer
    schedule: object
    unit_conversion: dict | None
    trace: StepTrace  # one training step, op by op (bench/speed/trace.py): its FLOPs, the speed model's input
    trace_s: float  # what tracing it cost
    compiled_blocks: list = field(default_factory=list)  # a distributed cell's blocks compiled one by one


def build_cell(cfg: DictConfig, precision: Precision) -> Cell:
    """Set threads, seed, build the task, unit-scale it if asked, trace its step, apply the precision, build
    optimiser, schedule, scaler."""
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    seed_everything(cfg.seed)
    task = build_task(cfg.model, precision.device, cfg.seed)
    method = precision.method
    conversion = transform_task(method, task, cfg.model.get("pretrained", False), cfg.model.optimizer.name)

    def optimizer_over(model: torch.nn.Module, traced: bool = False) -> torch.optim.Optimizer:
        """The cell's optimiser, over `model` (the task's, or the traced copy of it: the same parameters by name;
        traced, with FP32 states: `traced_config`)."""
        factors = task.lr_multipliers and {mine: task.lr_multipliers.get(theirs, 1.0) for mine, theirs in
                                           zip(model.parameters(), task.model.parameters())}
        chosen = traced_config(cfg.model.optimizer) if traced else cfg.model.optimizer
        return build_optimizer(chosen, model.parameters(), factors, method.parameter_groups)

    from bench.speed.trace import stores, trace_task  # (torch._dynamo's import seconds, outside the trace's time)

    started = time.perf_counter()
    trace = trace_task(task, lambda model: optimizer_over(model, traced=True))
    stores(trace, cfg)
    trace_s = time.perf_counter() - started
    task.model = precision.prepare(task.model, cfg.model.task.get("blocks"))
    compiled_blocks = []
    if (ranks := parallel.Ranks.current()).distributed:  # a distributed cell's rank: the optimiser takes the shards
        wrapped = parallel.wrap(task.model, cfg, precision.device,
                                compile_blocks=compiling(cfg.train.get("compile"), precision))
        task.model, compiled_blocks = wrapped.model, wrapped.compiled_blocks
        if task.lr_multipliers:  # unit scaling's, keyed by parameter: the wrapped model's (FSDP2's are new ones)
            task.lr_multipliers = {wrapped.replaced[p]: factor for p, factor in task.lr_multipliers.items()}
        task.train_batches = _sharded(task.train_batches, ranks)
    optimizer = optimizer_over(task.model)
    schedule = build_schedule(cfg.model.optimizer, optimizer, total_steps(task, cfg.train))
    return Cell(task, build_scaler(cfg, precision), optimizer, schedule, conversion, trace, trace_s, compiled_blocks)


def _sharded(batches: Callable, ranks: parallel.Ranks) -> Callable:
    """The task's batch stream, each batch cut to this rank's share (bench.running.parallel.shard)."""
    return lambda epoch: (parallel.shard(batch, ranks) for batch in batches(epoch))


def converted_flop_share(trace: StepTrace, conversion: dict | None) -> float | None:
    """How much of a training step's GEMM work torchao's filter put in FP8 (the record's fp8_modules)."""
    if not conversion or "converted" not in conversion:
        return None
    converted = set(conversion["converted"])
    total = trace.flops("forward") + trace.flops("backward")
    share = sum(o.flops for o in trace.ops if o.module in converted and o.phase != "optimizer")
    return share / total if total else None


def kept_flop_share(trace: StepTrace, kept: list[str]) -> float | None:
    """The share of a training step's Linear GEMM FLOPs (forward and backward) in the layers format.keep_high_precision
    kept out of the format."""
    linear = [o for o in trace.ops if o.module in trace.linears and o.phase != "optimizer"]
    total = sum(o.flops for o in linear)
    return sum(o.flops for o in linear if o.module in kept) / total if total else None


def finished_record(cfg: DictConfig, config: dict | None = None) -> dict | None:
    """The record that makes this cell done (so it is skipped), or None when it must run.

    ok records are final; failed and diverged ones count as done unless retry_failed=true. A corrupt
    record is reported and the cell re-runs. A record of a *different* configuration at the same place
    is refused rather than overwritten.
    """
    config = config or OmegaConf.to_container(cfg, resolve=True)
    run_dir = Path(cfg.results_dir) / cfg.cell
    record, problem = previous_record(run_dir)
    if problem:
        log.warning("%s; the cell runs again", problem)
    if record is None:
        return None
    recorded, wanted = run_id(record["config"]), run_id(config)  # recomputed: the rules may know more than the record
    if recorded != wanted:
        raise ConfigError(f"{run_dir} holds a record of a different configuration (run_id {recorded}, "
                          f"this one {wanted}): use another experiment_name or results_dir, or delete it")
    if changed := _redefined_elements(record):
        raise ConfigError(f"{run_dir} holds a record made with element format {changed}, defined differently now: "
                          "a changed format takes a name of its own (or use another results_dir)")
    if record["status"] == "ok" or not cfg.retry_failed:
        return record
    return None


def _redefined_elements(record: dict) -> str | None:
    """The first element format whose definition (its bits, range and codes) differs from the record's: a user's
    format redefined under its name is not its records' format. None where all agree or the record predates them."""
    from bench.numerics.formats import FORMATS

    for name, then in ((record.get("env") or {}).get("precision") or {}).get("element_definitions", {}).items():
        if name in FORMATS and (now := FORMATS[name].definition()) != then:
            return f"{name} ({', '.join(f'{k} {then[k]} then, {now[k]} now' for k in now if now[k] != then.get(k))})"
    return None


def run_cell(cfg: DictConfig) -> dict:
    """Train and evaluate one cell; write `<results_dir>/<cell>/result.json`; return the record.

    Raises ConfigError (before anything is written) for a bad config. A cell with a finished record is
    skipped (its record is returned with "skipped": true), and so is a cell another process is training
    now (status "in_flight"). Any other failure is recorded as status=failed with the error and the
    traceback tail.
    """
    check(cfg)
    config = OmegaConf.to_container(cfg, resolve=True)
    if (done := finished_record(cfg, config)) is not None:
        return _skip_recorded(cfg, done)
    try:
        device, precision = device_preflight(cfg)
    except DeviceError as e:
        if not os.environ.get("SLURM_JOB_ID"):
            raise  # here, before anything starts: exit 2
        # on a compute node the device is decided where the cell runs; a node that cannot run it is a result
        return _record_failure(cfg, config, f"DeviceError: {e}", "failed on this node")
    device = devices.cell_device(device)  # on CUDA: the GPU this process has to itself
    if parallel.wanted(cfg) and parallel.slurm_tasks() > 1:  # each SLURM task a rank (tasks_per_node)
        return _as_slurm_task(cfg, config)
    with cell_lock(Path(cfg.results_dir) / cfg.cell) as mine:
        if not mine:
            log.warning("%s: skipped, another process is training it now", cfg.cell)
            return {"status": IN_FLIGHT, "skipped": True}
        if (done := finished_record(cfg, config)) is not None:  # finished while this process was starting
            return _skip_recorded(cfg, done)
        if parallel.wanted(cfg):  # a job of parallel.world_size ranks, each training its share; rank 0 records
            return _launched(cfg, config)
        with precision.fp32_flags():  # torch's TF32 flags as the cell asks, while it runs; as they were after
            return _train_cell(cfg, config, device, precision)


def _launched(cfg: DictConfig, config: dict) -> dict:
    """A distributed cell as a job of ranks this process launches: rank 0's record, or, where a rank failed (the cell
    failed; the sweep goes on), rank 0's record of its failure, else one of the launcher's saying which rank."""
    result = Path(cfg.results_dir) / cfg.cell / "result.json"
    before = result.stat().st_mtime_ns if result.exists() else None  # a failed one, run again
    try:
        record = parallel.launch(cfg, config, _train_cell)
    except parallel.JobFailed as e:
        if not result.exists() or result.stat().st_mtime_ns == before:  # a rank lost before rank 0 could record
            return _record_failure(cfg, config, f"JobFailed: {e}", "its job failed")
        record = previous_record(result.parent)[0]
        if e.first_rank != 0:  # the cause was another rank's (rank 0 then lost its peer): said first
            record["reason"] = f"JobFailed: {e} (rank 0 then: {record['reason']})"
            write_json_atomic(result, record)
        log.error("%s: its job failed: %s", cfg.cell, e)
        return record
    _log_outcome(cfg, record)  # here too: the ranks' own logging is not this process's
    return record


def _as_slurm_task(cfg: DictConfig, config: dict) -> dict:
    """A distributed cell's rank as this SLURM task (submitit started one process per task): its record, written by
    rank 0; a failed one where the job's tasks are not the cell's world size."""
    if (tasks := parallel.slurm_tasks()) != cfg.parallel.world_size:
        return _record_failure(cfg, config, f"ConfigError: parallel.world_size={cfg.parallel.world_size} in a SLURM "
                               f"job of {tasks} tasks; valid: {tasks} (BENCH_SLURM_TASKS)", "not run")
    record = parallel.as_slurm_task(cfg, config, _train_cell)
    if os.environ["RANK"] == "0":  # the task that wrote the record (the others' are not written)
        _log_outcome(cfg, record)
    return record


def _skip_recorded(cfg: DictConfig, record: dict) -> dict:
    log.info("%s: skipped, already recorded as %s%s", cfg.cell, record["status"],
             "" if record["status"] == "ok" else f" ({RETRY_HINT})")
    return record | {"skipped": True}


def _record_failure(cfg: DictConfig, config: dict, reason: str, what: str) -> dict:
    """A failed record written by this process, where no training process wrote one (a node that cannot run the
    cell; a distributed cell's job that lost a rank)."""
    record = {"status": "failed", "reason": reason, "run_id": run_id(config), "config": config,
              "env": devices.describe(torch.device("cpu")) | {"precision": {}}, "metrics": {}, "timing": {},
              "memory": {}, "numerics": {}}
    write_json_atomic(Path(cfg.results_dir) / cfg.cell / "result.json", record)
    log.error("%s: %s: %s", cfg.cell, what, reason)
    return record


def _train_cell(cfg: DictConfig, config: dict, device: torch.device, precision: Precision) -> dict:
    """run_cell's work once the cell is this process's to train: the record starts `failed` and says what the
    cell got to (a failure keeps what was measured before it); an interruption writes none, so that the next launch
    resumes from the checkpoint."""
    run_dir = Path(cfg.results_dir) / cfg.cell
    identity = run_id(config)
    memory = devices.PeakMemory(device)
    conditions = devices.TimingConditions(device)
    ranks = parallel.Ranks.current()  # a distributed cell's ranks train alike; rank 0 writes
    every, keep = cfg.train.checkpoint_every, cfg.train.keep_checkpoint
    checkpointer = DistributedCheckpointer(run_dir, identity, every, keep, parallel.any_world_size(config)) \
        if ranks.distributed else Checkpointer(run_dir, identity, every, keep)
    collectives = parallel.CollectiveBytes() if ranks.distributed else None
    scaler = build_scaler(cfg, precision)  # replaced by the cell's; here so that a failed build records its state
    record = {"status": "failed", "reason": None, "run_id": identity, "config": config,
              "env": devices.describe(device) | {"precision": precision.describe(), "plugins": declarations(cfg)},
              "metrics": {}, "timing": {}, "memory": {"peak_bytes": None, "measures": memory.measures}, "numerics": {}}
    logger, metrics_log = NullLogger(), None
    try:
        memory.reset()
        cell = build_cell(cfg, precision)
        scaler = cell.scaler
        _record_cell(record, cell, precision)
        checkpoint_bytes = checkpointer.bytes_needed(cell.task.model, cell.optimizer) if checkpointer else 0
        require_free_space(run_dir, checkpoint_bytes + WRITE_MARGIN_BYTES,
                           "this cell (its checkpoints, estimated from its model and optimiser, and "
                           f"{WRITE_MARGIN_BYTES // 2**20} MiB for its record and logs)")
        with checkpointer or contextlib.nullcontext():
            resume = checkpointer.restore(cell.task.model, cell.optimizer, scaler, cell.schedule) \
                if checkpointer else None
            record["resumed_from"] = checkpointer.resumed_from if checkpointer else None
            record["discarded_checkpoints"] = checkpointer.discarded if checkpointer else []
            if resume:
                precision.telemetry.load_state(resume.pop("telemetry"))
                log.info("%s: resuming from its checkpoint at step %d", cfg.cell, resume["steps"])
            log_row = lambda row: None  # noqa: E731 - a rank other than 0 writes nothing
            if ranks.writes:
                metrics_log = MetricsLog(run_dir / "metrics.jsonl", resume["steps"] if resume else None)
                # W&B groups by what ran (setting, native/emulated), not by what was asked (backend: auto)
                tags = [cfg.format.name, cfg.format.mode, precision.backend, cfg.scaling.name]  # as prepare() decided
                logger = open_logger(cfg, run_dir, config | {"precision": record["env"]["precision"]}, tags, identity)
                log_row = _row_sinks(cfg, run_dir, record["env"], resume, metrics_log, logger,
                                     total_steps(cell.task, cfg.train))
            conditions.start()
            outcome = train(cell.task, precision, scaler, cell.optimizer, cell.schedule, cfg.train, device, log_row,
                            label=cfg.cell, checkpointer=checkpointer, resume=resume,
                            eval_every=cfg.model.task.get("eval_every"), first_step_watch=collectives)
            timing_conditions = conditions.finish()
            with precision.evaluating(cell.task.model, cfg.train.eval_precision) as cast_inputs:
                metrics = cell.task.evaluate(cell.task.model, cast_inputs)  # inside: pre-empted here, resumes here
            check_metric_returned(cfg.model.task.metric, metrics)
            metrics["evaluated_in"] = precision.evaluated_in(cfg.train.eval_precision)
            check_metric_unit(cfg.model.task.metric, metrics.get(cfg.model.task.metric), cfg.model.task.unit)
        record["memory"] |= {"peak_bytes": memory.peak_bytes(), "step": outcome.step_memory}
        if ranks.distributed:  # every rank takes part in the gather of the peaks
            record["parallel"] = parallel.describe(cfg, parallel.gathered(record["memory"]["peak_bytes"]),
                                                   collectives.bytes, cell.compiled_blocks,
                                                   outcome.collective_time)
        _record_outcome(record, cfg, cell, outcome, metrics, timing_conditions, precision.native)
    except ConfigError:
        raise  # a setup problem found while building the cell (e.g. a checkpoint that does not fit): no record
    except StorageError:
        logger.finish(None)  # no record (the disk cannot take one): the next launch resumes from the last checkpoint
        raise
    except Exception as e:  # recorded, then reported by the caller
        if isinstance(e, ConversionError):
            record["numerics"]["unit_conversion"] = e.measured
        record["reason"] = f"{type(e).__name__}: {e}"
        record["traceback"] = traceback.format_exc()[-4000:]
    except BaseException:
        # Interrupted (Ctrl-C, pre-emption, exit): no record, so that the next launch resumes from the checkpoint.
        logger.finish(None)
        raise
    finally:
        if metrics_log is not None:
            metrics_log.close()
    record["numerics"] |= scaler.state() | {"quantisation": precision.telemetry.summary()}
    # what bench.running.learning's rule reads of this run (the sweep judges it against its siblings when they end)
    record["numerics"]["learning"] = learning_summary(logged_losses(run_dir), record["timing"].get("steps"))
    record["env"]["finished_at"] = devices.utc_now()
    if not ranks.writes:
        return record
    write_json_atomic(run_dir / "result.json", record)
    if record["status"] != "failed" and checkpointer:  # a failed cell keeps its checkpoint: retry_failed resumes it
        checkpointer.remove()
    logger.finish(record)
    _log_outcome(cfg, record)
    return record


def _log_outcome(cfg: DictConfig, record: dict) -> None:
    """A sweep's cell's outcome in the log, each on its line: status, scalar metrics (the curve is in the record), and
    where the record is. A single run prints its one line instead (`main`), which the log would say again."""
    if not _in_multirun():
        return
    log.info("%s: %s %s; record: %s", cfg.cell, record["status"], record["reason"] or {
        k: v for k, v in record["metrics"].items() if not isinstance(v, (list, dict))},
        Path(cfg.results_dir) / cfg.cell / "result.json")


def _record_cell(record: dict, cell: Cell, precision: Precision) -> None:
    """What building the cell decided: the precision as prepare() applied it, the model's source, its conversion."""
    record["env"]["precision"] = precision.describe()  # now with what prepare() did to the model
    if (share := converted_flop_share(cell.trace, precision.conversion)) is not None:
        record["env"]["precision"]["fp8_modules"]["converted_flop_share"] = share
    if kept := (precision.conversion or {}).get("kept_by_request"):
        record["env"]["precision"]["keep_high_precision"]["gemm_flop_share"] = kept_flop_share(cell.trace, kept)
    if cell.task.source is not None:
        record["model_source"] = cell.task.source
    if cell.unit_conversion is not None:
        record["numerics"]["unit_conversion"] = cell.unit_conversion


def _row_sinks(cfg: DictConfig, run_dir: Path, env: dict, resume: dict | None, metrics_log: MetricsLog, logger,
               total: int) -> Callable[[dict], None]:
    """Where the loop's rows go: metrics.jsonl, the logger (W&B) and run.log's progress line."""
    progress = ProgressLine(run_dir / "run.log", total)
    progress.note(f"start on {env['hostname']} (pid {env['pid']}"
                  + (f", SLURM job {env['slurm_job']}" if env["slurm_job"] else "") + "), "
                  + (f"resuming at step {resume['steps']}" if resume else "from step 0"))

    def log_row(row: dict) -> None:
        metrics_log(row)
        logger.log(row)
        progress(row)

    return log_row


def _record_outcome(record: dict, cfg: DictConfig, cell: Cell, outcome, metrics: dict, timing_conditions: dict,
                    native: bool) -> None:
    """What training measured: the metrics and their curve, the timing and the predictions beside it, the status."""
    record["metrics"] = {**metrics, "final_train_loss": outcome.final_loss,
                         "curve": quality_curve(cfg.model.task, outcome, metrics)}
    if outcome.validations and not cfg.model.task.get("eval_every"):
        record["metrics"]["per_epoch"] = outcome.validations
    flops = cell.trace.flops("forward") + cell.trace.flops("backward")
    record["timing"] = outcome.timing(flops, native) | {
        "conditions": timing_conditions, "trace_s": cell.trace_s,
        "traced_on": cell.trace.traced_on + (f" ({cell.trace.note})" if cell.trace.note else "")}
    from bench.speed.model import fingerprint, predictions

    record["predicted"] = predictions(cfg, cell.trace)  # each GPU profile's step time (bench/speed/model.py)
    record["predicted_by"] = fingerprint()  # which speed model: a later one recomputes rather than reuse these
    record["env"]["compile"] = outcome.compile
    record["numerics"]["diverged_at_step"] = outcome.diverged_at_step
    if outcome.diverged_at_step is None:
        record["status"] = "ok"
    else:
        record["status"] = "diverged"
        record["reason"] = f"non-finite loss ({outcome.final_loss}) at step {outcome.diverged_at_step}"


def quality_curve(spec: DictConfig, outcome, final: dict) -> dict:
    """The record's `metrics.curve`: the task's validation metric (`task.curve_metric`, default its primary metric)
    at each evaluation, and at the end from the final evaluation, as [step, value] pairs (what time to target reads)."""
    metric = spec.get("curve_metric") or spec.metric
    points = {row["step"]: row[metric] for row in outcome.validations if metric in row}
    if metric in final:
        points[outcome.steps] = final[metric]
    return {"metric": metric, "points": [[step, value] for step, value in sorted(points.items())]}


class ProgressLine:
    """One line per log step in the cell's run.log (step, loss, loss scale, steps/s, ETA), with or without a
    terminal; the console keeps tqdm's bar."""

    def __init__(self, path: Path, total: int):
        self.path, self.total, self.last = path, total, None

    def _append(self, line: str) -> None:
        with storage_errors(self.path), open(self.path, "a") as f:
            f.write(line)

    def note(self, text: str) -> None:
        self._append(f"[{time.strftime('%Y-%m-%d %H:%M:%S')}] {text}\n")

    def __call__(self, row: dict) -> None:
        if "loss" not in row:
            return
        now = time.perf_counter()
        rate = None
        if self.last is not None and row["step"] > self.last[0]:
            rate = (row["step"] - self.last[0]) / (now - self.last[1])
        self.last = (row["step"], now)
        eta = f"{(self.total - row['step']) / rate:.0f} s" if rate else "?"
        self._append(f"[progress] step {row['step']}/{self.total} loss {row['loss']:.4g} scale {row['loss_scale']:g} "
                     f"{f'{rate:.1f}' if rate else '?'} steps/s ETA {eta}\n")


def main() -> None:
    """`python -m bench.run [overrides]`: the command line checked (exit 2 naming the valid choices), then Hydra."""
    try:
        check_command_line(sys.argv[1:])
        cfg = check_yaml_files(sys.argv[1:])
        if cfg is not None and not {"-m", "--multirun"} & set(sys.argv[1:]):
            # one cell: every check before Hydra makes its directory (a sweep's are the sweeper's); on a SLURM node
            # the device's verdict is the cell's record (run_cell), not an exit
            preflight(cfg, device_checks=not os.environ.get("SLURM_JOB_ID"))
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        sys.exit(2)
    run_cells()


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
def run_cells(cfg: DictConfig) -> dict:
    """One cell (Hydra calls it once per cell of a sweep): its record, or exit 2 for bad input."""
    in_worker = _in_parallel_sweep()
    if in_worker:  # a pre-emption signal between this worker's cells stops its later ones, not the worker
        checkpoint.keep_signals_between_cells()
        if checkpoint.kept_signal() is not None:
            return INTERRUPTED
    try:
        record = run_cell(cfg)
    except (KeyboardInterrupt, SystemExit) as e:
        # a worker's cell stopped by SIGTERM or SIGUSR2 (a whole process group's) ends in SystemExit; elsewhere
        # that passes as it always has
        if isinstance(e, SystemExit) and not (in_worker and e.code in checkpoint.STOPPED_EXIT_CODES):
            raise
        print(f"interrupted: {cfg.cell} (its checkpoint is saved at the last step boundary); run the same command "
              "again to resume it", file=sys.stderr)
        if in_worker:  # the worker's task ends as any other, so that joblib lets the other workers' cells save
            checkpoint.keep_signal(signal.SIGINT)
            return INTERRUPTED
        sys.exit(130)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        _remove_setup_leftovers(Path(cfg.results_dir), cfg.cell)
        sys.exit(2)
    except StorageError as e:
        print(f"storage error: {cfg.cell}: {e}. Nothing recorded; run the same command again once there is space "
              "(or with another results_dir=)", file=sys.stderr)
        _remove_setup_leftovers(Path(cfg.results_dir), cfg.cell)
        if cfg.fail_fast or not _in_multirun():
            sys.exit(1)
        return {"status": "failed", "skipped": False, "recorded": False}  # the sweep goes on, and counts it
    if record["status"] == "failed" and (cfg.fail_fast or not _in_multirun()):
        # SystemExit passes through Hydra's launcher, so with fail_fast a sweep stops here
        print(record.get("traceback", "") if cfg.fail_fast else "", f"run failed: {record['reason']}"
              + (f" (recorded before; {RETRY_HINT})" if record.get("skipped") else ""), file=sys.stderr)
        sys.exit(1)
    if not _in_multirun():  # a single run says where its record went, and its verdict in one line
        print(f"{cfg.cell}: {_verdict(record)}; record: {Path(cfg.results_dir) / cfg.cell / 'result.json'}")
    return {"status": record["status"], "skipped": record.get("skipped", False)}


def _verdict(record: dict) -> str:
    """A record in one line: its status (and reason), then its scalar metrics."""
    metrics = ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                        for k, v in record["metrics"].items() if not isinstance(v, (list, dict)))
    said = record["status"] + (f" ({record['reason']})" if record.get("reason") else "")
    return said + (" (recorded before)" if record.get("skipped") else "") + (f": {metrics}" if metrics else "")


SWEEP_NOTE = "multirun.yaml"  # what Hydra writes into a sweep's results_dir before its first cell
SETUP_FILES = {".hydra", "run.log", LOCK_NAME}  # what Hydra and the lock leave in a cell directory before training


def _remove_setup_leftovers(results_dir: Path, cell: str) -> None:
    """After a config error, remove the cell's directory if it holds nothing but set-up files, and its parents up
    to results_dir while they are empty: bad input leaves no empty run directories (and never touches a record).
    A sweep stopped so leaves no `multirun.yaml` (Hydra's note of the sweep) where it wrote nothing else."""
    run_dir = results_dir / cell
    if run_dir.is_dir() and {p.name for p in run_dir.iterdir()} <= SETUP_FILES:
        shutil.rmtree(run_dir)
        for parent in run_dir.parents:
            if parent == results_dir or not parent.is_relative_to(results_dir) or any(parent.iterdir()):
                break
            parent.rmdir()
    if _in_multirun() and results_dir.is_dir() and [p.name for p in results_dir.iterdir()] == [SWEEP_NOTE]:
        (results_dir / SWEEP_NOTE).unlink()


# What a parallel sweep's worker returns for a cell it stopped, or did not start, after a pre-emption signal: its
# sweep then ends without a summary (hydra_plugins/bench_sweeper: "interrupted: ...", exit 128 + the signal)
INTERRUPTED = {"status": "interrupted", "skipped": False, "recorded": False}


def _in_parallel_sweep() -> bool:
    """Whether this process is a worker of a parallel sweep (hydra/launcher=parallel: joblib's processes)."""
    from hydra.core.hydra_config import HydraConfig

    return _in_multirun() and "joblib" in str(HydraConfig.get().launcher.get("_target_", ""))


def _in_multirun() -> bool:
    from hydra.core.hydra_config import HydraConfig

    return HydraConfig.initialized() and HydraConfig.get().mode.name == "MULTIRUN"
