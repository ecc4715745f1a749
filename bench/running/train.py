"""The training loop shared by every task: forward in the run's precision, scaled backward, step or skip."""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch
from omegaconf import DictConfig
from tqdm import tqdm

from bench.numerics import fused
from bench.numerics.master_weights import MasterWeights
from bench.numerics.memory import StepMemory
from bench.numerics.precision import Precision
from bench.numerics.readings import Readings
from bench.numerics.scaling import LossScaler
from bench.running import parallel
from bench.running.checkpoint import Checkpointer
from bench.running.compile import CompiledStep, dynamo_graphs
from bench.running.device import StepTimer, end_step, synchronize
from bench.tasks.base import Task


def build_schedule(cfg: DictConfig, optimizer: torch.optim.Optimizer, total_steps: int):
    """none: constant lr; linear: decay to 0 over the run (BERT's fine-tuning recipe, no warm-up); cosine:
    nanoGPT's get_lr, lr * (step + 1) / (warmup + 1) for `warmup_steps`, then a cosine from lr to min_lr over
    the rest of the run."""
    if cfg.schedule == "linear":
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: max(0.0, 1 - step / max(1, total_steps)))
    if cfg.schedule == "cosine":
        warmup, floor = cfg.warmup_steps, cfg.min_lr / cfg.lr

        def factor(step: int) -> float:
            if step < warmup:
                return (step + 1) / (warmup + 1)
            progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
            return floor + 0.5 * (1.0 + math.cos(math.pi * progress)) * (1.0 - floor)

        return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    return None


@dataclass
class TrainOutcome:
    """What the loop measured; also the loop's position, so that a checkpoint can resume it."""

    steps: int = 0
    samples: int = 0
    train_s: float = 0.0
    step_s: list[float] = field(default_factory=list)
    final_loss: float | None = None
    diverged_at_step: int | None = None
    # the task's validation metrics, each evaluation's: {"step", "epoch", ...}, after each epoch or every eval_every
    # steps (from step 0): the quality curve
    validations: list[dict] = field(default_factory=list)
    step_memory: dict | None = None  # bytes the first step held, by category (bench/numerics/memory.py)
    step_time_method: str = "wall_clock"  # how step_s was measured (bench.running.device.StepTimer)
    compile_steps: list[int] = field(default_factory=list)  # steps during which a graph compiled (torch.compile, ours)
    compile_in_validation_s: float = 0.0  # seconds the validations inside the loop spent making fused graphs
    compile: dict | None = None  # what compiling did (bench.running.compile.CompiledStep.describe)
    collective_time: dict | None = None  # a distributed cell's profiled step (bench.running.parallel.CollectiveTime)
    epoch: int = 0  # position: the epoch in progress...
    position: int = 0  # ...and the batches of it already consumed

    def timing(self, flops_per_step: int | None = None, native: bool = False) -> dict:
        """The record's timing; achieved TFLOP/s (FLOPs of a step over its median time) only where the format
        ran natively: an emulated step's time says nothing about the format's throughput. Steps that compiled
        (torch.compile, or a fused quantiser's or emulated op's graph for a new layout: bench/numerics/fused.py) are
        left out of the median and counted apart (`compile`), with what the validations spent making fused graphs;
        `train_s` includes them and `train_s_without_compile` does not."""
        compiling = set(self.compile_steps)
        steady = [s for i, s in enumerate(self.step_s) if i not in compiling]
        median = statistics.median(steady) if steady else None
        compile_s = sum(s for i, s in enumerate(self.step_s) if i in compiling) + self.compile_in_validation_s
        return {
            "train_s": self.train_s,
            "train_s_without_compile": self.train_s - compile_s,
            "step_median_s": median,
            "samples_per_s": self.samples / self.train_s if self.train_s > 0 else None,
            "steps": self.steps,
            "step_time_method": self.step_time_method,
            "flops_per_step": flops_per_step,
            "tflop_per_s": flops_per_step / median / 1e12 if native and flops_per_step and median else None,
            "compile": {"steps": list(self.compile_steps), "seconds": compile_s,
                        "in_validation_s": self.compile_in_validation_s},
        }


def total_steps(task: Task, cfg: DictConfig) -> int:
    total = task.steps_per_epoch * cfg.epochs
    return total if cfg.max_steps is None else min(total, cfg.max_steps)


def train(task: Task, precision: Precision, scaler: LossScaler, optimizer: torch.optim.Optimizer, schedule,
          cfg: DictConfig, device: torch.device, log: Callable[[dict], None], label: str = "",
          checkpointer: Checkpointer | None = None, resume: dict | None = None,
          count_memory: bool = True, eval_every: int | None = None,
          first_step_watch: contextlib.AbstractContextManager | None = None) -> TrainOutcome:
    """Train `task.model` for cfg.epochs (at most cfg.max_steps steps); stop at a non-finite loss.

    `log` receives a metrics dict every cfg.log_every steps (telemetry is sampled on those steps) and
    the task's validation metrics after each epoch (with `eval_every`: before the first step and every eval_every
    steps instead, but at the last, which the final evaluation covers). Ordinary steps never wait for the device:
    losses, the loss scaler's inf/NaN flags and step timings stay there and are read together on log steps,
    at epoch ends, checkpoints and the end (`has_diverged`). A non-finite loss is therefore noticed at the
    next such point: the run stops there, recording the step it happened at. Timing covers the loop
    (data, forward, backward, step, per-epoch validation, as Raschka's timing does), synchronised at its
    start and end; a resumed run adds the time of its earlier segments. `resume` is the loop state a
    checkpoint restored; with a `checkpointer`, the loop saves at step boundaries. `count_memory`: count
    the first step's memory (bench/numerics/memory.py); `make bench` turns it off to time the loop's per-step
    cost alone. `first_step_watch`: a context the first step's forward and backward run in (a distributed cell's
    collective bytes; the optimiser's step stays outside it, where torchao's optimisers compile).
    """
    loop = TrainingLoop(task, precision, scaler, optimizer, schedule, cfg, device, log, checkpointer, resume,
                        count_memory, eval_every if task.validate is not None else None, first_step_watch)
    return loop.run(label)


class TrainingLoop:
    """train()'s state and its parts: one step (with the compile fallback and the first step's memory count), the
    reads of what the device holds (`has_diverged`), validation, checkpoints."""

    def __init__(self, task, precision, scaler, optimizer, schedule, cfg, device, log, checkpointer, resume,
                 count_memory, eval_every, first_step_watch=None):
        self.task, self.model, self.precision, self.scaler = task, task.model, precision, scaler
        self.optimizer, self.schedule, self.cfg, self.device, self.log = optimizer, schedule, cfg, device, log
        self.checkpointer, self.count_memory, self.eval_every = checkpointer, count_memory, eval_every
        self.first_step_watch = first_step_watch
        self.distributed = parallel.Ranks.current().distributed  # losses logged: the whole batch's, averaged
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.total = total_steps(task, cfg)
        if resume and "per_epoch" in resume:  # a checkpoint written before the curve had its every-N-steps points
            resume = {k: v for k, v in resume.items() if k != "per_epoch"} | {"validations": resume["per_epoch"]}
        self.out = TrainOutcome(**resume) if resume else TrainOutcome()
        self.step_loss = CompiledStep.for_task(cfg.get("compile"), device, task, precision, per_block=self.distributed)
        self.master = MasterWeights(cfg.get("master_weights", "fp32"), self.model, optimizer)
        self.master.start()
        self.timer = StepTimer(device)
        self.out.step_time_method = self.timer.method
        self.unread_steps: list[int] = []  # steps whose losses are still on the device, in losses_on_device
        self.losses_on_device = Readings(cfg.log_every)
        self.segment_start = time.perf_counter()

    def run(self, label: str) -> TrainOutcome:
        out, cfg = self.out, self.cfg
        self.model.train()
        progress = tqdm(total=self.total, initial=out.steps, desc=label, unit="step", leave=False, mininterval=1.0,
                        disable=None)  # a bar on terminals, none in logs
        synchronize(self.device)
        self.segment_start = time.perf_counter()
        if self.eval_every and out.steps == 0 and not out.validations:
            self.validate(0)  # the curve starts where training does (nanoGPT evaluates at iteration 0 too)
        log_every = cfg.log_every  # read once: an OmegaConf lookup costs ~40 µs, a step of a small model 3 ms
        for epoch in range(out.epoch, cfg.epochs):
            for index, batch in enumerate(self.task.train_batches(epoch)):
                if index < out.position:
                    continue  # replaying the epoch's batch stream up to where the checkpoint left it
                if out.steps >= self.total:
                    break
                sampled = out.steps % log_every == 0
                profiled = self.distributed and out.steps == parallel.CollectiveTime.PROFILED_STEP
                with parallel.CollectiveTime(self.device) if profiled else contextlib.nullcontext() as timed:
                    self.step(batch, sampled)
                if profiled:
                    out.collective_time = timed.measured
                step, out.steps = out.steps, out.steps + 1
                out.epoch, out.position = epoch, index + 1
                progress.update()
                if sampled:
                    if self.has_diverged():
                        break
                    self.log_step(step, epoch)
                    progress.set_postfix(loss=f"{out.final_loss:.4f}", refresh=False)
                if self.eval_every and out.steps % self.eval_every == 0 and out.steps < self.total:
                    if self.has_diverged():
                        break
                    self.validate(epoch)
                if self.checkpointer:
                    self.checkpointer.after_step(out.steps, self.save)
            if self.has_diverged():
                break
            if self.task.validate is not None and not self.eval_every and out.position > 0:
                self.validate(epoch)
            out.epoch, out.position = epoch + 1, 0
            if out.steps >= self.total:
                break
        self.has_diverged()
        synchronize(self.device)
        out.compile = self.step_loss.describe()
        out.train_s += time.perf_counter() - self.segment_start
        self.segment_start = time.perf_counter()  # counted: a final checkpoint adds no time
        progress.close()
        self.precision.telemetry.sampling = False
        if self.checkpointer:
            self.checkpointer.finish(self.save)
        return out

    def step(self, batch, sampled: bool) -> None:
        """One training step, left on the device: forward, scaled backward, step or skip, the schedule."""
        out, precision = self.out, self.precision
        compiled_s, graphs = fused.compile_seconds(), dynamo_graphs()
        self.timer.start()
        precision.telemetry.sampling = sampled
        counting = StepMemory(self.model, precision, self.master.mode) \
            if self.count_memory and out.step_memory is None else None
        watched = self.first_step_watch if out.steps == 0 and self.first_step_watch else contextlib.nullcontext()
        with watched:  # forward and backward, not the optimiser's step: dynamo compiles nothing under a dispatch mode
            with precision.autocast(), counting.saving() if counting else contextlib.nullcontext():
                loss = self.step_loss(self.model, batch, eager=counting is not None)  # saved-tensor hooks: eager
            loss = self.share_of_batch(loss, batch)
            compiled = self.step_loss.compiled_now  # (a step run again eagerly below still compiled first)
            self.optimizer.zero_grad(set_to_none=True)
            try:
                self.scaler.scale_loss(loss).backward()
            except Exception as e:  # only a backward that compiled on this very step falls back
                if not compiled:
                    raise
                loss = self.eager_again(batch, e)
        self.unread_steps.append(out.steps)
        self.losses_on_device.push(loss)
        precision.after_backward(self.model)
        self.master.after_backward()
        self.scaler.step(self.optimizer, self.params, check=sampled)
        precision.after_step(self.model, self.optimizer)  # idempotent: a step the scaler skipped changed nothing
        self.master.after_step()  # likewise
        if self.schedule is not None:
            self.schedule.step()
        if counting:
            out.step_memory = counting.finish(self.optimizer)
        end_step(self.device)
        self.timer.stop()
        # torch.compile, a fused graph for a new layout, or any other graph (torchao's optimiser compiles its update)
        if compiled or fused.compile_seconds() > compiled_s or dynamo_graphs() > graphs:
            out.compile_steps.append(out.steps)
        out.samples += self.task.batch_size

    def eager_again(self, batch, error: Exception) -> torch.Tensor:
        """The step's forward and backward again, eagerly, after its freshly compiled backward failed."""
        self.step_loss.fall_back(error)  # raises under train.compile=true
        self.optimizer.zero_grad(set_to_none=True)
        with self.precision.autocast():
            loss = self.share_of_batch(self.step_loss(self.model, batch), batch)
        self.scaler.scale_loss(loss).backward()
        return loss

    def share_of_batch(self, loss: torch.Tensor, batch) -> torch.Tensor:
        """A rank's loss weighted by its share of the batch's loss terms, where the task's shares can differ (its
        `loss_terms`); any other loss as it is."""
        if not (self.distributed and self.task.loss_terms):
            return loss
        return parallel.batch_weighted(loss, self.task.loss_terms(batch), self.task.gradient_averages_terms)

    def has_diverged(self) -> bool:
        """Whether a loss was non-finite, reading what the device holds since the last read (a host sync: called
        where the loop reads anyway, every log_every steps and at the end)."""
        out = self.out
        self.scaler.sync()
        out.step_s += self.timer.collect()
        if not self.unread_steps:
            return out.diverged_at_step is not None
        read = self.losses_on_device.read(parallel.averaged if self.distributed else None)
        steps, losses = list(self.unread_steps), [row[0] for row in read]
        self.unread_steps.clear()
        for step, value in zip(steps, losses):
            out.final_loss = value
            if not math.isfinite(value):
                out.diverged_at_step = step
                return True
        return False

    def log_step(self, step: int, epoch: int) -> None:
        out, scaler = self.out, self.scaler
        self.log({"step": step, "epoch": epoch, "loss": out.final_loss, "loss_scale": scaler.scale,
                  "stepped": not scaler.last_step_skipped, "skipped_steps": scaler.skipped_steps,
                  "step_s": out.step_s[-1], "quantisation": self.precision.telemetry.end_step()})

    def validate(self, epoch: int) -> None:
        """The task's validation metrics now, in the cell's evaluation precision: one point of the quality curve."""
        compiled_s = fused.compile_seconds()  # an evaluation batch's layout is new to the fused graphs
        with self.precision.evaluating(self.model, self.cfg.get("eval_precision", "trained")) as cast_inputs:
            metrics = self.task.validate(self.model, cast_inputs)
        self.out.compile_in_validation_s += fused.compile_seconds() - compiled_s
        self.out.validations.append({"step": self.out.steps, "epoch": epoch, **metrics})
        self.log({"step": self.out.steps, "epoch": epoch, **metrics})

    def save(self) -> None:
        self.has_diverged()
        state = asdict(self.out) | {"train_s": self.out.train_s + time.perf_counter() - self.segment_start,
                                    "telemetry": self.precision.telemetry.state()}
        self.checkpointer.save(self.model, self.optimizer, self.scaler, self.schedule, state)
