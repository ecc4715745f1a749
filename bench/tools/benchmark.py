"""`make bench`: is the harness free, is the emulation cheap, are native formats as fast as promised?

    python -m bench.tools.benchmark [--out results/bench] [--quick] [--only harness,native,...]
                                    [--native-formats fp32,bf16-mixed,...] [--as-cpu avx2|avx512-no-bf16]

Writes results/bench/<device>-<date>.json (<device>: `machine_name`, on a CPU with its vector capability, and with
--as-cpu the CPU it stood for: bench/tools/cpu_proxy.py):
{"device", "env", "rows": [{"metric", "value", "unit", "target"}]}
and prints the rows as a table. Every timing is the median of repeats after a warm-up, alternating the
things compared, in one process, the fused quantisers' graphs made in the warm-up (`PRECISION_BENCH_FUSED_COMPILE=
at-once`: a long run's steady state; a run makes a layout's graph once its eager calls have paid for it,
bench/numerics/fused.py):
- harness_ratio.<model>.<format>: steps/s of bench's training loop / a bare hand-written loop over the
  same model, batches and format (telemetry and the one-off first-step memory count off in both, each measured on
  its own below, but for our loop's step 0, a log step as in every run, whose telemetry is in our time: 0.6-0.9 ms
  of a 30-step LeNet FP8 round hot, 1.4 ms before e96cf77 compiled a sampled step's passes), the median over 15
  alternating rounds of half as many steps, with .min and .max, .cpu_time (the same ratio in process CPU time,
  blind to time the machine gave to others), the median's 95% bootstrap interval (.median_low, .median_high) and
  .rounds_needed (rounds whose interval would be 0.02 wide, enough to tell 0.95 from 0.97, at the spread these
  rounds had). Target >= 0.97.
- host_syncs_per_100_steps.<model>.<format>+<scaling>, on CUDA: calls in our loop that wait for the GPU
  (torch.cuda.set_sync_debug_mode), ordinary steps only but for step 0 (a log step) and the end, apart from those
  made inside the transformers model (.in_model), which a bare loop makes too. Target: ~0.
- emulation_ratio.<model>.<format>: step time of an emulated format / fp32, same loop and model; the formats
  include FP8 rowwise/block scaling, the block formats (bench/numerics/blocks.py) and NVIDIA's whole NVFP4 recipe
  (format=nvfp4_recipe, BERT-tiny only). Targets on CPU: <= 1.25 for fp8, <= 1.75 for mxfp8, <= 2 for nvfp4_recipe
  (`--emulated nvfp4_recipe,...` measures only those settings): the median of the rounds' ratios (alternating
  rounds), those with a target with .median_low and .median_high, the median's 95% bootstrap interval.
  telemetry_ratio.<model>.fp8: fp8 with telemetry on every step / off, the same median with its interval (target
  <= 1.5). bf16_ratio.<model>: format=bf16 as the machine runs it (native BF16 autocast on a CPU with BF16 units) /
  fp32, in the same rounds, with its interval and no target: the FP8 and MX recipes run BF16 autocast outside their
  GEMMs (format.elsewhere=bf16), the floor their ratios stand on (LeNet's 1.20-1.21 on an AMD EPYC with avx512_bf16,
  where FP8 with nothing rounded measured as much and FP8's target is 1.25; docs/performance.md).
- accumulation_ratio.bert_tiny.fp8+H100: BERT-tiny's FP8 (per-tensor) step with every GEMM accumulated as H100's
  tensor cores do (format.accumulation=H100, bench/numerics/tensor_cores.py) / accumulated exactly; a fifth of the
  steps, 3 rounds. Target on CPU: <= 4.
- compile_speedup.<model>.<format>: step time of our loop eager / compiled (train.compile=true, inductor), for
  fp32, bf16 and emulated fp8, the medians of 3 alternating runs (steps that compiled left out, as records do);
  compile_step_ms, and compile_s: the first compile's time (the steps that compiled, whole).
- peer_ratio.bert_tiny.<peer>: step time of unit-scaling's simulate_fp8 and of torchao float8 training
  with emulate=True / ours (fp8, same bare loop). Target > 1 (ours faster). On the small BERT, where every
  matmul is an nn.Linear for all three (torchao converts Linear layers only).
- native rows, on a CUDA device only: per model and format at the papers' batch sizes, step time,
  samples/s, tokens/s, peak memory, MFU against the device's dense peak for the dtype (6 x parameters x
  tokens FLOPs per step), speed-up vs fp32 (TF32 off) and vs tf32.
- predicted.<gpu>.<model>.<setting>.<mode>: the speed model's step time (or published ratio) and its error against
  every GPU figure we have (bench/tools/speed_validation.py's rows; `make speed-validation` fits and writes them).
- accounting_share.lenet.<format>: what a run's one-off accounting costs (the memory breakdown of its first
  step, bench/numerics/memory.py) as a share of a default LeNet cell's training time (its steps x a plain step's
  median time). Target <= 0.05.
- trace_share.lenet.<format>: what tracing its step costs a cell (bench/speed/trace.py, the speed model's input and
  its FLOPs) as the same share. Target <= 0.02.
- aggregate_s.10k: reading, summarising and tabulating 10,000 synthetic records. Target <= 5 s.
- quantise_ns.<format>: nanoseconds per value of bench.numerics.formats.quantise on 2^20 float32 values (and
  `bf16_stochastic`: quantise_stochastic to BF16, its draws included, as train.master_weights=bf16_stochastic rounds
  each weight every step), and of the block quantisers (MX, NVFP4 by torchao's rule and, stochastically from 8
  bits, by Transformer Engine's, FP8 rowwise and tiles) on the same values as a 1024 x 1024 matrix (fused where
  that pays: bench/numerics/fused.py).
  quantise_of_clone.<format>.{eager,fused}: each one's throughput as a fraction of x.clone()'s (the memory floor:
  one read, one write; on a CPU each call, clone's too, after twice the largest cache's bytes are written,
  quantise_of_clone.evicted_mb) on 4096 x 4096, eager and fused (MXFP8, NVFP4 and FP8's 1 x 128 tiles also with
  their blocks along dim 0, `<format>_dim0`, as a weight-gradient GEMM's operands are), and on a CUDA machine
  quantise_of_clone_cuda.* on 8192 x 8192: the median over alternating rounds of each round's ratio, the fused path's
  with its 95% bootstrap interval (.median_low, .median_high). Target for the fused path: >= 0.7.
  quantise_of_clone.reference.{two_reads,block_amax_16}: what the quantisers' rows are read against, compiled as
  they are, with intervals and no target: x over its amax (x read twice, written once: a quantiser that reads x
  again after an amax spanning rows) and NVFP4's 16-value block amaxes alone.
  quantise_call_us.<format>.<elements>.{eager,fused}: one call on 32 to 16,384 values, which fixes from what size
  the fused path is taken. No target.
- optimizer_ratio.<state_format>: one AdamW step over the char-LM's matrices with its moments in BF16, int8, int4
  or FP8 (model.optimizer.state_format, torchao's optimisers) over the same step with FP32 moments, after a warm-up
  that compiles torchao's per-tensor steps; optimizer_step_ms.fp32 the FP32 step itself. No target.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime as dt
import json
import math
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import datasets
import numpy as np
import torch
from hydra import compose, initialize_config_dir
from tabulate import tabulate

from bench.numerics import fused
from bench.numerics.blocks import (
    NVFP4_BLOCK,
    mx_quantise,
    nvfp4_quantise,
    nvfp4_tensor_scale,
    rowwise_quantise,
    te_nvfp4_quantise,
    tile2d_quantise,
    tile_quantise,
)
from bench.numerics.formats import quantise, quantise_stochastic, quantise_value
from bench.numerics.memory import StepMemory
from bench.running import device as devices
from bench.running.compile import CompiledStep
from bench.running.config import CONF_DIR
from bench.running.run import build_cell, preflight
from bench.running.train import total_steps, train
from bench.speed.profiles import shipped_gpus
from bench.speed.trace import trace_task
from bench.tasks.optimizer import build_optimizer
from bench.tasks.text import full_length_batch
from bench.tools import cpu_proxy

NO_TELEMETRY = 10**9  # train.log_every that never samples within a measurement


def cell_config(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=["results_dir=/tmp/bench-unused", *overrides])


def make_cell(*overrides: str):
    cfg = cell_config(*overrides)
    _, precision = preflight(cfg)
    return cfg, precision, build_cell(cfg, precision)


def batches(cell, steps: int) -> list:
    """The same `steps` batches for every loop compared (cycling epochs as needed)."""
    out, epoch = [], 0
    while len(out) < steps:
        out += list(cell.task.train_batches(epoch))
        epoch += 1
    return out[:steps]


def bare_loop(model, task, precision, optimizer, data, forward_and_loss=None) -> None:
    """What a user would write by hand: forward, loss, backward, step (the forward and loss by
    `forward_and_loss(model, batch)` where given: a CompiledStep)."""
    for batch in data:
        with precision.autocast():
            if forward_and_loss is None:
                outputs, targets = task.forward(model, batch, precision.inputs)
                loss = task.compute_loss(outputs, targets)
            else:
                loss = forward_and_loss(model, batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()


def our_loop(cfg, precision, cell, data):
    """bench's training loop over `data`, set up here so that the timed call is the loop alone."""
    task = copy.copy(cell.task)
    task.train_batches = lambda epoch: iter(data)
    task.steps_per_epoch = len(data)
    task.validate = None  # the quality curve's evaluations are not the loop's to time (a bare loop has none)
    train_cfg = copy.deepcopy(cfg.train)
    train_cfg.epochs, train_cfg.max_steps = 1, len(data)
    return lambda: train(task, precision, cell.scaler, cell.optimizer, None, train_cfg, precision.device,
                         lambda row: None, count_memory=False)  # a one-off per run: accounting_rows times it


def timed(fn, device, clocks=(time.perf_counter,)) -> list[float]:
    """Seconds `fn` took by each clock (wall clock by default), the device waited for at both ends."""
    devices.synchronize(device)
    start = [clock() for clock in clocks]
    fn()
    devices.synchronize(device)
    return [clock() - s for clock, s in zip(clocks, start)]


def alternate_all(fns: dict, device, repeats: int, clocks=(time.perf_counter,),
                  before: Callable[[], object] | None = None) -> list[dict[str, list[float]]]:
    """Per clock, {name: seconds in each round}: `repeats` rounds running the functions in turn, after one
    warm-up round; `before`, untimed, ahead of each timed call."""
    for fn in fns.values():
        fn()
    times = [{name: [] for name in fns} for _ in clocks]
    for _ in range(repeats):
        for name, fn in fns.items():
            if before is not None:
                before()
            for by_clock, seconds in zip(times, timed(fn, device, clocks)):
                by_clock[name].append(seconds)
    return times


def alternate(fns: dict, device, repeats: int) -> dict[str, float]:
    """Median wall-clock seconds of each function over `alternate_all`'s rounds."""
    return {name: statistics.median(t) for name, t in alternate_all(fns, device, repeats)[0].items()}


def machine_name(device: torch.device, env: dict) -> str:
    """The JSON's name before its date: the device's type and name, and on a CPU its vector capability, in which two
    machines of one name differ (2-core AMD EPYCs here have come with AVX2 alone and with AVX-512 and BF16 units, and
    the emulation's rows with them)."""
    words = [device.type, env["device_name"], *([env["cpu_capability"]] if device.type == "cpu" else [])]
    if proxy := env.get("cpu_proxy"):  # this machine's own capability, then what it stood for
        words[2:] = [proxy["on"], "as", proxy["as"]]
    return re.sub(r"[^A-Za-z0-9]+", "-", "-".join(words)).strip("-").lower()


def row(metric: str, value, unit: str, target: str | None = None) -> dict:
    return {"metric": metric, "value": value, "unit": unit, "target": target}


MODELS = {"lenet": ["model=lenet"], "bert_tiny": ["model=bert_tiny"]}


HARNESS_ROUNDS = 15  # shorter, more alternating rounds: a burst of noise on a shared machine hits a few pairs
HARNESS_RESOLUTION = 0.02  # the ratios the goal must tell apart: 0.95 from 0.97


def median_interval(ratios: list[float], confidence: float = 0.95) -> tuple[float, float]:
    """The median's bootstrap interval over the rounds (scipy's percentile bootstrap, seeded: the same rounds give
    the same interval)."""
    from scipy.stats import bootstrap

    found = bootstrap((np.asarray(ratios),), np.median, confidence_level=confidence, n_resamples=2000,
                      method="percentile", random_state=0).confidence_interval
    return float(found.low), float(found.high)


def per_round(times: dict[str, list[float]], numerator: str, denominator: str) -> list[float]:
    """Each round's ratio of two things timed side by side in it (`alternate_all`'s rounds): a burst on a shared
    machine hits both sides of a round, where a ratio of the two sides' medians would pair unlike rounds."""
    return [n / d for n, d in zip(times[numerator], times[denominator]) if d > 0]


def median_rows(metric: str, ratios: list[float], unit: str, target: str | None = None,
                interval: bool = False) -> list[dict]:
    """The rounds' median ratio; with a target, which it is judged on, or asked for (`interval`), also its median's
    95% bootstrap interval (.median_low, .median_high; none from one round). Runs of one commit have moved these rows
    by up to 13%."""
    rows = [row(metric, statistics.median(ratios), unit, target)]
    if (target is not None or interval) and len(ratios) > 1:
        low, high = median_interval(ratios)
        rows += [row(f"{metric}.median_low", low, "the median's 95% bootstrap interval over the rounds, low end"),
                 row(f"{metric}.median_high", high, "the median's 95% bootstrap interval over the rounds, high end")]
    return rows


def rounds_to_resolve(ratios: list[float], difference: float = HARNESS_RESOLUTION, confidence: float = 0.95) -> int:
    """Rounds whose median's interval is `difference` wide, given these rounds' spread: the median of n rounds has a
    standard error of about sqrt(pi / 2) sigma / sqrt(n) (rounds near normal), so its interval is 2 z that wide."""
    from scipy.stats import norm

    z = norm.ppf(0.5 + confidence / 2)
    return math.ceil((2 * z * math.sqrt(math.pi / 2) * statistics.stdev(ratios) / difference) ** 2)


def harness_rows(steps: int, repeats: int) -> list[dict]:
    """Per round, bare time / our time over the same batches; the median of the rounds is the figure, their
    min and max its spread. Rounds are half as long as the other measurements' and more, alternating ours and
    bare, so that drift and bursts on the machine hit both or only a few pairs (not shorter: our loop's step 0
    is a log step, whose telemetry telemetry_ratio measures). Also the ratio of process CPU time, taken in
    the same rounds, which leaves out time the machine gave to others (a VM's steal): where the two disagree,
    the machine took time away; where they agree, any spread is work done more slowly (shared caches)."""
    rows = []
    rounds, chunk = max(repeats, HARNESS_ROUNDS), max(1, steps // 2)
    for model, model_args in MODELS.items():
        for fmt in ("fp32", "fp8"):
            cfg, precision, ours = make_cell(*model_args, f"format={fmt}", f"train.log_every={NO_TELEMETRY}")
            _, _, bare = make_cell(*model_args, f"format={fmt}")
            data = batches(ours, chunk)
            fns = {"ours": our_loop(cfg, precision, ours, data),
                   "bare": lambda: bare_loop(bare.task.model, bare.task, precision, bare.optimizer, data)}
            wall, cpu = alternate_all(fns, precision.device, rounds, clocks=(time.perf_counter, time.process_time))
            name = f"harness_ratio.{model}.{fmt}"
            ratios = per_round(wall, "bare", "ours")
            rows += median_rows(name, ratios, f"ours/bare steps per s, median of {rounds} rounds of {chunk} steps",
                                ">= 0.97")
            rows += [row(f"{name}.rounds_needed", rounds_to_resolve(ratios),
                         f"rounds for an interval {HARNESS_RESOLUTION} wide (0.95 told from 0.97) at this spread"),
                     row(f"{name}.min", min(ratios), "ours/bare, slowest round"),
                     row(f"{name}.max", max(ratios), "ours/bare, fastest round"),
                     row(f"{name}.cpu_time", statistics.median(per_round(cpu, "bare", "ours")),
                         "ours/bare, process CPU time, median")]
    return rows


def host_sync_rows(steps: int) -> list[dict]:
    """CUDA only: synchronising calls per 100 steps of our loop, counted by torch's sync debug mode (which
    warns on every call that waits for the GPU). The loop reads the device on log steps only; with log_every
    beyond the run, the count is that of the ordinary steps plus step 0's reads (a log step) and the end's.
    Syncs made inside the transformers model (warned from its files) are the model's own, counted apart."""
    import warnings

    rows = []
    for model, model_args in MODELS.items():
        for fmt, scaling in (("fp32", "none"), ("fp16", "dynamic")):
            cfg, precision, cell = make_cell(*model_args, f"format={fmt}", f"scaling={scaling}",
                                             f"train.log_every={NO_TELEMETRY}")
            loop = our_loop(cfg, precision, cell, batches(cell, steps))
            loop()
            torch.cuda.synchronize()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    loop()
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            syncs = [w for w in caught if "synchroniz" in str(w.message)]
            in_model = sum("/transformers/" in w.filename for w in syncs)  # e.g. BERT's SDPA mask check
            name = f"host_syncs_per_100_steps.{model}.{fmt}+{scaling}"
            rows += [row(name, 100 * (len(syncs) - in_model) / steps,
                         "calls in the harness that wait for the GPU (incl. the end-of-loop read)", "~0"),
                     row(f"{name}.in_model", 100 * in_model / steps, "the model library's own (a bare loop's too)")]
    return rows


def accounting_rows(repeats: int) -> list[dict]:
    rows = []
    for fmt in ("fp32", "fp8"):
        cfg, precision, cell = make_cell("model=lenet", f"format={fmt}")
        task, model, optimizer = cell.task, cell.task.model, cell.optimizer
        batch = next(iter(task.train_batches(0)))

        def step(counted: bool):
            counting = StepMemory(model, precision) if counted else None
            with precision.autocast(), counting.saving() if counting else contextlib.nullcontext():
                outputs, targets = task.forward(model, batch, precision.inputs)
                loss = task.compute_loss(outputs, targets)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if counting:
                counting.finish(optimizer)

        t = alternate({"counted": lambda: step(True), "plain": lambda: step(False),
                       "trace": lambda: trace_task(task,
                                                   lambda m: build_optimizer(cfg.model.optimizer, m.parameters()))},
                      precision.device, 4 * repeats)
        once, training = max(0.0, t["counted"] - t["plain"]), total_steps(task, cfg.train) * t["plain"]
        rows.append(row(f"accounting_s.lenet.{fmt}", once, "s per run (the first step's memory breakdown)"))
        rows.append(row(f"accounting_share.lenet.{fmt}", once / training, "of a default LeNet cell's training time",
                        "<= 0.05"))
        rows.append(row(f"trace_s.lenet.{fmt}", t["trace"], "s per run (tracing its step on the meta device)"))
        rows.append(row(f"trace_share.lenet.{fmt}", t["trace"] / training, "of a default LeNet cell's training time",
                        "<= 0.02"))
    return rows


# the FP8 emulation without the recipe's BF16 outside its GEMMs (bf16_ratio's autocast, whose own cost on a CPU is not
# the emulation's): fp8's ratio over it is what that BF16 adds; with its interval, as the targets' rows
FP8_ALONE = "fp8+fp32_elsewhere"
EMULATED = {"tf32": ["format=tf32"], "fp16": ["format=fp16"], "bf16": ["format=bf16", "format.backend=emulated"],
            "fp8": ["format=fp8"], FP8_ALONE: ["format=fp8", "format.elsewhere=fp32"],
            "fp8+per_tensor": ["format=fp8", "scaling=per_tensor"],
            "fp8+per_tensor+stochastic": ["format=fp8", "scaling=per_tensor", "format.rounding=stochastic"],
            "fp8+rowwise": ["format=fp8", "scaling=rowwise", "format.backend=emulated"],
            "fp8+block": ["format=fp8", "scaling=block"], "mxfp8": ["format=mxfp8"],
            "mxfp8+torchao_recipe": ["format=mxfp8", "format.gradients=fp8_e4m3", "format.scale_mode=rceil",
                                     "format.backend=emulated"],
            "mxfp6": ["format=mxfp6"], "mxfp4": ["format=mxfp4"], "nvfp4": ["format=nvfp4"],
            "nvfp4+stochastic": ["format=nvfp4", "format.rounding=stochastic"],
            "nvfp4_recipe": ["format=nvfp4_recipe"]}
# NVIDIA's whole NVFP4 recipe keeps the last 3 Linear layers in BF16: LeNet has only 3, so it runs on BERT-tiny only
EMULATED_ON = {"nvfp4_recipe": ("bert_tiny",)}
EMULATION_TARGETS = {"fp8": "<= 1.25", "mxfp8": "<= 1.75", "nvfp4_recipe": "<= 2"}  # on CPU (#56's, raised)
BF16_AS_RUN = "bf16 as run"  # format=bf16 on the machine's default backend: the emulated recipes' floor, beside them


def emulation_rows(steps: int, repeats: int, only: list[str] | None = None) -> list[dict]:
    """Per model, each emulated setting's step time over FP32's (alternating rounds); `only`: those settings."""
    rows = []
    for model, model_args in MODELS.items():
        emulated = {name: args for name, args in EMULATED.items()
                    if model in EMULATED_ON.get(name, (model,)) and (only is None or name in only)}
        telemetry = {"fp8+telemetry": ["format=fp8"]} if "fp8" in emulated else {}  # measured beside fp8's row
        variants = {"fp32": ["format=fp32"], BF16_AS_RUN: ["format=bf16"], **emulated, **telemetry}
        loops, device, bf16_native = {}, None, False
        for name, args in variants.items():
            log_every = 1 if name == "fp8+telemetry" else NO_TELEMETRY
            cfg, precision, cell = make_cell(*model_args, *args, f"train.log_every={log_every}")
            data = batches(cell, steps)
            loops[name] = our_loop(cfg, precision, cell, data)
            device = precision.device
            if name == BF16_AS_RUN:
                bf16_native = precision.plan.native
        wall, = alternate_all(loops, device, repeats)
        rows += median_rows(f"bf16_ratio.{model}", per_round(wall, BF16_AS_RUN, "fp32"),
                            f"x fp32 step time, median of the rounds: format=bf16 as this machine runs it "
                            f"({'native' if bf16_native else 'emulated'}), the autocast that the FP8 and MX recipes "
                            "run outside their GEMMs (format.elsewhere=bf16) with nothing rounded; no target",
                            interval=True)
        for name in (*emulated, *telemetry):
            rows += median_rows(f"emulation_ratio.{model}.{name}", per_round(wall, name, "fp32"),
                                "x fp32 step time, median of the rounds",
                                EMULATION_TARGETS.get(name) if device.type == "cpu" else None,
                                interval=name == FP8_ALONE)
        if telemetry:
            rows += median_rows(f"telemetry_ratio.{model}.fp8", per_round(wall, "fp8+telemetry", "fp8"),
                                "x fp8 step time, median of the rounds", "<= 1.5")
    return rows


ACCUMULATED = {"fp8+per_tensor": ["format=fp8", "scaling=per_tensor"],
               "fp8+per_tensor+H100": ["format=fp8", "scaling=per_tensor", "format.accumulation=H100"]}
ACCUMULATION_TARGET = "<= 4"  # #52's, on CPU


def accumulation_rows(steps: int, repeats: int) -> list[dict]:
    """BERT-tiny's FP8 step with every GEMM accumulated as H100's tensor cores do (format.accumulation=H100:
    compiled integer kernels) over the same step accumulated exactly, alternating rounds after a warm-up that
    compiles each GEMM shape (2.4 minutes on a 2-core AMD EPYC with an empty inductor cache; LeNet's convolutions
    have more shapes: 3.6 minutes)."""
    loops, device = {}, None
    for name, args in ACCUMULATED.items():
        cfg, precision, cell = make_cell(*MODELS["bert_tiny"], *args, f"train.log_every={NO_TELEMETRY}")
        loops[name], device = our_loop(cfg, precision, cell, batches(cell, steps)), precision.device
    t = alternate(loops, device, repeats)
    return [row("accumulation_ratio.bert_tiny.fp8+H100", t["fp8+per_tensor+H100"] / t["fp8+per_tensor"],
                "x exactly accumulated fp8 step time", ACCUMULATION_TARGET if device.type == "cpu" else None)]


COMPILED_FORMATS = {"fp32": ["format=fp32"], "bf16": ["format=bf16"], "fp8": ["format=fp8"]}


def compile_rows(steps: int, repeats: int, models: dict[str, list[str]] = MODELS) -> list[dict]:
    """Per model and format, our loop compiled (train.compile=true) and eager: the median step time of each (steps
    that compiled left out, as records do) over `repeats` alternating runs, and the first compile's seconds."""
    rows = []
    for model, model_args in models.items():
        for fmt, args in COMPILED_FORMATS.items():
            medians, compile_s = {"eager": [], "compiled": []}, None
            for _ in range(repeats):
                for mode in medians:
                    cfg, precision, cell = make_cell(*model_args, *args, f"train.log_every={NO_TELEMETRY}",
                                                     f"train.compile={mode == 'compiled'}")
                    outcome = our_loop(cfg, precision, cell, batches(cell, steps))()
                    timing = outcome.timing()
                    medians[mode].append(timing["step_median_s"])
                    if mode == "compiled" and compile_s is None:
                        compile_s = timing["compile"]["seconds"]
            eager, compiled = statistics.median(medians["eager"]), statistics.median(medians["compiled"])
            rows += [row(f"compile_speedup.{model}.{fmt}", eager / compiled, "eager / compiled step time (median)"),
                     row(f"compile_step_ms.{model}.{fmt}", compiled * 1e3, "ms per compiled step (median)"),
                     row(f"compile_s.{model}.{fmt}", compile_s, "s, the first compile (steps that compiled)")]
    return rows


def peer_rows(steps: int, repeats: int) -> list[dict]:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from unit_scaling.transforms import simulate_fp8

    _, precision, ours = make_cell("model=bert_tiny", "format=fp8")
    _, fp32, base = make_cell("model=bert_tiny", "format=fp32")
    data = batches(ours, steps)
    peers = {"unit_scaling_simulate_fp8": simulate_fp8(copy.deepcopy(base.task.model)),
             "torchao_float8_emulate": convert_to_float8_training(copy.deepcopy(base.task.model),
                                                                  config=Float8LinearConfig(emulate=True))}
    loops = {"ours": lambda: bare_loop(ours.task.model, ours.task, precision, ours.optimizer, data)}
    for name, model in peers.items():
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        loops[name] = lambda model=model, optimizer=optimizer: bare_loop(model, base.task, fp32, optimizer, data)
    t = alternate(loops, precision.device, repeats)
    return [row(f"peer_ratio.bert_tiny.{name}", t[name] / t["ours"], "peer/ours step time", "> 1") for name in peers]


# Dense peak TFLOP/s per dtype, from the vendors' datasheets (SXM parts).
NATIVE_FORMATS = {"fp32": ["format=fp32"], "tf32": ["format=tf32"], "16-mixed": ["format=fp16"],
                  "16-true": ["format=fp16-true"], "bf16-mixed": ["format=bf16"], "bf16-true": ["format=bf16-true"],
                  # FP32 outside the FP8 GEMMs, as fp8-mixed was before 0.2.0 (the H100 rows of 2026-11-22)
                  "fp8": ["format=fp8", "scaling=per_tensor", "format.elsewhere=fp32"],
                  "fp8-rowwise": ["format=fp8", "scaling=rowwise", "format.elsewhere=fp32"],
                  # the recipe torchao and Transformer Engine train with (fp8's default since 0.2.0): BF16 autocast
                  # outside the FP8 GEMMs
                  "fp8-bf16-elsewhere": ["format=fp8", "scaling=per_tensor", "format.elsewhere=bf16"],
                  "fp8-rowwise-bf16-elsewhere": ["format=fp8", "scaling=rowwise", "format.elsewhere=bf16"]}
PAPER_SHAPES = {"distilbert": (["model=distilbert_tiny", "model.arch.layers=6", "model.arch.hidden=768",
                                "model.arch.heads=12", "model.arch.intermediate=3072", "model.batch_size=12"], 512),
                "bert_base": (["model=bert_tiny", "model.arch.layers=12", "model.arch.hidden=768",
                               "model.arch.heads=12", "model.arch.intermediate=3072", "model.batch_size=12"], 384)}


def native_rows(steps: int, repeats: int, shapes: dict = PAPER_SHAPES, formats: dict = NATIVE_FORMATS,
                compiled: bool = True, cells: set[tuple[str, str]] | None = None) -> Iterator[dict]:
    """Native formats at the papers' shapes (random init, synthetic token batches of full length), eager and,
    with `compiled`, with the forward and loss compiled (rows `.compiled.*`; speed-ups compiled over compiled).
    `cells`, (model, format) pairs, limits which run (a GPU lent for minutes cannot compile every pair).
    Yields each format's rows as soon as they are measured (a run stopped at a time limit keeps them), and a
    model's speed-ups after its last format."""
    for model, (args, seq_len) in shapes.items():
        step_s = {}
        for name, fmt_args in formats.items():
            if cells is not None and (model, name) not in cells:
                continue
            cfg, precision, cell = make_cell(*args, *fmt_args, f"model.max_length={seq_len}", "format.backend=native",
                                             "device=auto")
            template = next(iter(cell.task.train_batches(0)))
            batch = full_length_batch(template, cfg.model.batch_size, seq_len, cell.task.model.config.vocab_size)
            data = [batch] * steps
            memory = devices.PeakMemory(precision.device)
            memory.reset()
            seconds = alternate({name: lambda: bare_loop(cell.task.model, cell.task, precision, cell.optimizer, data)},
                                precision.device, repeats)[name] / steps
            step_s[name] = seconds
            if compiled:  # the same loop with the forward and loss compiled (its warm-up round compiles)
                forward = CompiledStep.for_task(True, precision.device, cell.task, precision)
                step_s[f"{name}.compiled"] = alternate(
                    {name: lambda: bare_loop(cell.task.model, cell.task, precision, cell.optimizer, data, forward)},
                    precision.device, repeats)[name] / steps
                yield row(f"native.{model}.{name}.compiled.step_s", step_s[f"{name}.compiled"], "s", None)
            params = sum(p.numel() for p in cell.task.model.parameters())
            tokens = cfg.model.batch_size * seq_len
            dtype = {"16-mixed": "fp16", "16-true": "fp16", "bf16-mixed": "bf16", "bf16-true": "bf16"}.get(
                name, "fp8" if name.startswith("fp8") else name)
            peak = next((g.tflops[dtype] for g in shipped_gpus().values()
                         if devices.describe(precision.device)["device_name"].startswith(g.device_name)
                         and dtype in g.tflops), None)
            yield from [row(f"native.{model}.{name}.step_s", seconds, "s", None),
                     row(f"native.{model}.{name}.samples_per_s", cfg.model.batch_size / seconds, "samples/s", None),
                     row(f"native.{model}.{name}.tokens_per_s", tokens / seconds, "tokens/s", None),
                     row(f"native.{model}.{name}.peak_memory", memory.peak_bytes(), "bytes", None),
                     row(f"native.{model}.{name}.mfu", 6 * params * tokens / seconds / (peak * 1e12) if peak else None,
                         f"of {peak} TFLOP/s" if peak else "unknown peak", None)]
        for name, seconds in step_s.items():
            suffix = ".compiled" if name.endswith(".compiled") else ""
            for baseline in ("fp32", "tf32", "bf16-mixed"):
                if baseline + suffix in step_s:
                    yield row(f"native.{model}.{name}.speedup_vs_{baseline}{suffix}",
                              step_s[baseline + suffix] / seconds, "x", None)


def speed_model_rows(quick: bool = False) -> list[dict]:
    """The speed model (bench/speed/model.py) against every GPU step measured here and the published ratios
    (bench/tools/speed_validation.py's rows, its constants as they are): predicted, measured, error. `quick`: the
    hand-compiled rows alone (3 s of the 30-45 the others take to trace; `make speed-validation` scores them all)."""
    from bench.tools import speed_validation

    rows = []
    validation = speed_validation.hand_compiled_rows()
    if not quick:  # the rows measured here, and the published ones speed-validation reads (single linears aside)
        validation = speed_validation.measured_rows() + validation \
            + speed_validation.published_rows(set(speed_validation.KINDS) - {"single_linear"})
    for r in validation:
        predicted = r.predict(speed_validation.CONSTANTS)
        name = f"predicted.{r.gpu}.{r.model.split(',')[0].replace(' ', '_')}.{r.what.replace(' ', '_')}.{r.mode}"
        rows += [row(f"{name}.{'step_s' if r.unit == 's' else 'ratio'}", predicted, r.unit, None),
                 row(f"{name}.error", predicted / r.measured - 1, f"predicted / {r.source} - 1", None)]
    return rows


def aggregate_rows(n: int = 10_000) -> list[dict]:
    from bench.reporting.aggregate import load_directory, summarise, to_frame
    from bench.reporting.tables import write_all
    from bench.running.record import write_json_atomic

    _, precision, _ = make_cell("train.max_steps=1")
    template = {"status": "ok", "reason": None, "run_id": "x",
                "config": {"experiment_name": "bench", "seed": 0,
                           "model": {"name": "lenet", "data": {"source": "digits"}},
                           "format": {"name": "fp32", "mode": "true"}, "scaling": {"name": "none"}},
                "env": {"device_name": "cpu", "precision": precision.describe()},
                "metrics": {"test_accuracy": 0.9}, "timing": {"train_s": 1.0, "steps": 10},
                "memory": {"peak_bytes": 1}, "numerics": {"skipped_steps": 0, "final_loss_scale": 1.0}}
    settings = ["32-true", "tf32", "16-mixed", "16-true", "bf16-mixed", "bf16-true", "fp8-mixed"]
    scalings = ["none", "static", "dynamic", "per_tensor", "unit"]
    root = Path(tempfile.mkdtemp(prefix="bench-agg-"))
    try:
        for i in range(n):
            record = copy.deepcopy(template)
            record["config"]["seed"] = i // (len(settings) * len(scalings))
            record["config"]["scaling"]["name"] = scalings[i % len(scalings)]
            record["env"]["precision"]["setting"] = settings[(i // len(scalings)) % len(settings)]
            record["metrics"]["test_accuracy"] = 0.9 + (i % 7) / 100
            write_json_atomic(root / f"r{i}" / "result.json", record)
        start = time.perf_counter()
        runs = to_frame(load_directory(root)[0])
        write_all(runs, summarise(runs), root / "tables")
        seconds = time.perf_counter() - start
    finally:
        shutil.rmtree(root)
    return [row("aggregate_s.10k", seconds, "s", "<= 5")]


BLOCK_QUANTISERS = {  # on a (1024, 1024) tensor, blocked along its rows
    "mxfp8_e4m3": lambda x: mx_quantise(x, "fp8_e4m3"), "mxfp6_e2m3": lambda x: mx_quantise(x, "fp6_e2m3"),
    "mxfp4_e2m1": lambda x: mx_quantise(x, "fp4_e2m1"), "nvfp4": lambda x: nvfp4_quantise(x, nvfp4_tensor_scale(x)),
    "nvfp4_stochastic": lambda x: nvfp4_quantise(x, nvfp4_tensor_scale(x), rounding="stochastic"),
    # Transformer Engine's rule, 8 random bits: a gradient under the NVFP4 recipe as `experiment=nvfp4_recipe` runs it
    "nvfp4_te_stochastic": lambda x: te_nvfp4_quantise(x, rounding="stochastic", sr_bits=8),
    "fp8_rowwise": rowwise_quantise, "fp8_1x128": tile_quantise, "fp8_128x128": tile2d_quantise}
ELEMENT_FORMATS = ("tf32", "fp16", "bf16", "fp8_e4m3", "fp8_e5m2")
ELEMENT_QUANTISERS = {**{fmt: lambda x, fmt=fmt: quantise(x, fmt) for fmt in ELEMENT_FORMATS},
                      "bf16_stochastic": lambda x: quantise_stochastic(x, "bf16")}
# quantise_of_clone: each quantiser and its arguments after x (None: the tensor's NVFP4 scale), eager and fused;
# blocks along dim -1, and (`_dim0`) along dim 0, as a weight-gradient GEMM's operands are blocked
FUSED_QUANTISERS = {**{fmt: (quantise_value, (fmt,)) for fmt in ELEMENT_FORMATS},
                    "mxfp8_e4m3": (mx_quantise, ("fp8_e4m3",)), "mxfp6_e2m3": (mx_quantise, ("fp6_e2m3",)),
                    "mxfp4_e2m1": (mx_quantise, ("fp4_e2m1",)), "nvfp4": (nvfp4_quantise, (None,)),
                    "fp8_rowwise": (rowwise_quantise, ()), "fp8_1x128": (tile_quantise, ()),
                    "fp8_128x128": (tile2d_quantise, ()), "mxfp8_e4m3_dim0": (mx_quantise, ("fp8_e4m3", "floor", 0)),
                    "nvfp4_dim0": (nvfp4_quantise, (None, 0)), "fp8_1x128_dim0": (tile_quantise, (0,))}
OF_CLONE_TARGET = ">= 0.7"  # a fused quantiser's throughput as a fraction of x.clone()'s (one read, one write)


@fused.fused(fused.ARITHMETIC_FROM)
def two_reads(x: torch.Tensor) -> torch.Tensor:
    """x over its amax: x read twice from memory and written once, the least a quantiser does that must know an amax
    spanning rows before it writes a value (a wide tile's, or a block's whose per-block step runs as a loop of its
    own, as NVFP4's does). Compiled as a quantiser is, so that its fraction of clone's throughput is that of a
    quantiser at memory speed with a second read: 2/3 if a read costs what a write does."""
    return x * (1.0 / x.abs().amax())


@fused.fused(fused.ARITHMETIC_FROM)
def block_amax_16(x: torch.Tensor) -> torch.Tensor:
    """The amax of each 16 values along x's rows alone (NVFP4's blocks): x read once, a 16th of it written, and a
    block's 16 values reduced across a vector's lanes in inductor's CPU code, a cost the element loop does not pay."""
    return x.unflatten(-1, (-1, NVFP4_BLOCK)).abs().amax(-1)


# quantise_of_clone.reference.<name>: no target; what the quantisers' rows are read against (docs/performance.md)
OF_CLONE_REFERENCES = {"two_reads": (two_reads, "x / amax(x), x read twice and written once"),
                       "block_amax_16": (block_amax_16, "16-value blocks' amaxes, x read once")}
OF_CLONE_ROUNDS = 15  # a ratio per round: 3 rounds' medians moved by up to 0.4 run to run (a shared 2-core VM)


def quantise_rows(quick: bool = False) -> list[dict]:
    """quantise_ns: `quantise` on 2^20 values and the block quantisers on the same values as a 1024 x 1024 matrix, as
    a cell calls them (fused where that pays, bench/numerics/fused.py); then, but with `quick` (each fused path
    compiles), `of_clone_rows`."""
    x = torch.randn(2**20) * 100
    rows = []
    for name, quantiser in ELEMENT_QUANTISERS.items():
        seconds = alternate({name: lambda q=quantiser: q(x)}, torch.device("cpu"), 5)[name]
        rows.append(row(f"quantise_ns.{name}", seconds / x.numel() * 1e9, "ns/value", None))
    matrix = x.reshape(1024, 1024)
    for name, quantiser in BLOCK_QUANTISERS.items():
        seconds = alternate({name: lambda q=quantiser: q(matrix)}, torch.device("cpu"), 5)[name]
        rows.append(row(f"quantise_ns.{name}", seconds / x.numel() * 1e9, "ns/value", None))
    if quick:
        return rows
    cuda = [torch.device("cuda")] if torch.cuda.is_available() else []
    return rows + call_rows() + [r for device in (torch.device("cpu"), *cuda) for r in of_clone_rows(device)]


CALL_SIZES = (32, 1024, 16384)  # elements: a bias or LeNet's first kernel, a small weight, a small activation
CALL_QUANTISERS = {"fp8_e4m3": (quantise_value, ("fp8_e4m3",)), "fp8_e5m2": (quantise_value, ("fp8_e5m2",)),
                   "mxfp8_e4m3": (mx_quantise.values, ("fp8_e4m3",)), "nvfp4": (nvfp4_quantise.values, (None,))}


def call_rows() -> list[dict]:
    """quantise_call_us.<format>.<elements>.{eager,fused}: one call's median microseconds on a small FP32 tensor
    (32 columns) with the eager reference and with the fused path, which fixes from what size a quantiser is
    compiled (fused.ARITHMETIC_FROM, fused.CAST_FROM; docs/performance.md). No target."""
    rows = []
    for elements in CALL_SIZES:
        x = torch.randn(elements // 32, 32, generator=torch.Generator().manual_seed(0))
        for name, (quantiser, extra) in CALL_QUANTISERS.items():
            args = tuple(nvfp4_tensor_scale(x) if a is None else a for a in extra)
            calls = {"eager": lambda q=quantiser, a=args: q.eager(x, *a),
                     "fused": lambda q=quantiser, a=args: q.fused(x, *a)}
            for path, seconds in alternate(calls, torch.device("cpu"), 200).items():
                rows.append(row(f"quantise_call_us.{name}.{elements}.{path}", seconds * 1e6, "us a call (median)"))
    return rows


# glibc's mallopt parameters: large allocations from the heap, and freed ones kept there (mallopt(3))
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
GLIBC_MMAP_THRESHOLD_MAX = 32 << 20  # where glibc's own threshold stops growing on a 64-bit machine
GLIBC_TRIM_THRESHOLD = 128 << 10


@contextlib.contextmanager
def large_allocations_kept():
    """Inside it, glibc keeps a freed 64 MB tensor's pages for the next one: by default it maps every allocation
    over 32 MB afresh and the kernel faults each page in on its first write, time that clone and a quantiser pay
    alike and that lifted their ratio toward 1 in some runs and not others (docs/performance.md, "The 4096 x 4096
    rows swing"). For the process's main thread, as `make bench` runs (another thread's glibc arena maps anything
    over 64 MB whatever the thresholds); without glibc (another C library), nothing changes: the minor-fault row says
    which it was."""
    import ctypes

    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        yield
        return
    mallopt(M_MMAP_THRESHOLD, 1 << 30)
    mallopt(M_TRIM_THRESHOLD, 1 << 30)
    try:
        yield
    finally:
        mallopt(M_TRIM_THRESHOLD, GLIBC_TRIM_THRESHOLD)
        mallopt(M_MMAP_THRESHOLD, GLIBC_MMAP_THRESHOLD_MAX)


CPU_CACHES = Path("/sys/devices/system/cpu/cpu0/cache")  # Linux's description of the first CPU's caches
CACHE_UNKNOWN_BYTES = 1 << 30  # written where no cache size can be read: more than any last-level cache here


def largest_cache_bytes(caches: Path = CPU_CACHES) -> int | None:
    """The largest cache the first CPU sits behind (its last level; sysfs's `size`, as "491520K"), None where sysfs
    does not say (another OS)."""
    sizes = []
    for index in caches.glob("index*"):
        try:
            size = (index / "size").read_text().strip()
        except OSError:
            continue
        if match := re.fullmatch(r"(\d+)([KMG]?)", size):
            sizes.append(int(match[1]) << {"": 0, "K": 10, "M": 20, "G": 30}[match[2]])
    return max(sizes, default=None)


def cache_evictor(largest_cache: int | None) -> tuple[Callable[[], object], int]:
    """A call that writes twice the largest cache's bytes (a buffer made once), pushing out whatever a timed call
    before it left there, and how many bytes it writes."""
    evicting = 2 * largest_cache if largest_cache else CACHE_UNKNOWN_BYTES
    buffer = torch.ones(evicting // 4)  # its pages mapped now, not inside the first timed round
    return (lambda: buffer.fill_(1.0)), evicting


def of_clone_rows(device: torch.device, side: int | None = None) -> list[dict]:
    """quantise_of_clone (on CUDA: quantise_of_clone_cuda): each quantiser's eager and fused throughput as a fraction
    of clone's, on FP32 values past every cache: 4096 x 4096 on the CPU, 8192 x 8192 on a GPU (an H100's 4096 x 4096
    clone takes 45 µs, near a launch's cost). A block quantiser's `fused` row is its values alone, what a training
    step asks for (`quantiser.values`: one tensor written, as clone writes one); `fused_blocked` the whole Blocked
    (elements and per-block fields too, what telemetry's sampled steps ask for). On the CPU, each timed call after
    writing twice the largest cache's bytes (`cache_evictor`: a 2-core VM here has sat behind a 480 MB L3, which
    holds 4096 x 4096 values and clone's copy, so that without it clone ran at the cache's speed, not the memory's:
    docs/performance.md), with glibc kept from mapping each result afresh (`large_allocations_kept`): the memory's
    speed, not the page faults', and rows saying how many faults a call took and how many bytes were written
    before each."""
    side = side or (4096 if device.type == "cpu" else 8192)
    x = (torch.randn(side, side, generator=torch.Generator().manual_seed(0)) * 100).to(device)
    prefix = "quantise_of_clone" if device.type == "cpu" else f"quantise_of_clone_{device.type}"
    if device.type != "cpu":
        return _of_clone_rows(x, prefix)[0]
    import resource

    evict, evicting = cache_evictor(largest_cache_bytes())
    with large_allocations_kept():
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        rows, calls = _of_clone_rows(x, prefix, evict)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    return rows + [row(f"{prefix}.minor_faults_per_call", faults / calls, f"page faults a call, each writing "
                       f"{x.numel() * 4 >> 20} MB: {x.numel() * 4 >> 12} if its pages were mapped afresh"),
                   row(f"{prefix}.evicted_mb", evicting >> 20, "MB written before each timed call (twice the "
                       f"largest cache's; {CACHE_UNKNOWN_BYTES >> 20} where none could be read)")]


def _of_clone_rows(x: torch.Tensor, prefix: str, before: Callable[[], object] | None = None
                   ) -> tuple[list[dict], int]:
    """`of_clone_rows`' rows on x, and how many calls made them (`before`: ahead of each timed call)."""
    device, made = x.device, 0
    rows = []
    for name, (quantiser, extra) in FUSED_QUANTISERS.items():
        args = tuple(nvfp4_tensor_scale(x) if a is None else a for a in extra)
        values = getattr(quantiser, "values", quantiser)  # a block quantiser's values alone; an element's result
        calls = {"clone": x.clone, "eager": lambda q=quantiser, a=args: q.eager(x, *a),
                 "fused": lambda q=values, a=args: q.fused(x, *a)}
        if values is not quantiser:
            calls["fused_blocked"] = lambda q=quantiser, a=args: q.fused(x, *a)
        wall, = alternate_all(calls, device, OF_CLONE_ROUNDS, before=before)
        made += len(calls) * (OF_CLONE_ROUNDS + 1)  # a warm-up round first
        rows += median_rows(f"{prefix}.{name}.eager", per_round(wall, "clone", "eager"), "x clone's throughput")
        rows += median_rows(f"{prefix}.{name}.fused", per_round(wall, "clone", "fused"), "x clone's throughput",
                            OF_CLONE_TARGET)
        if "fused_blocked" in wall:
            rows += median_rows(f"{prefix}.{name}.fused_blocked", per_round(wall, "clone", "fused_blocked"),
                                "x clone's throughput (the whole Blocked)")
    calls = {"clone": x.clone, **{name: lambda r=reference: r.fused(x)
                                  for name, (reference, _) in OF_CLONE_REFERENCES.items()}}
    wall, = alternate_all(calls, device, OF_CLONE_ROUNDS, before=before)
    made += len(calls) * (OF_CLONE_ROUNDS + 1)
    for name, (_, what) in OF_CLONE_REFERENCES.items():
        rows += median_rows(f"{prefix}.reference.{name}", per_round(wall, "clone", name),
                            f"x clone's throughput ({what}), no target", interval=True)
    return rows, made


def optimizer_rows(repeats: int) -> list[dict]:
    """optimizer_ratio.<state_format>: one AdamW step over the char-LM's matrices (4 blocks x 128, 3.1 M values) with
    its moments in each state format (model.optimizer.state_format), over the same step with FP32 moments, after
    a warm-up that compiles torchao's per-tensor steps."""
    from omegaconf import OmegaConf

    from bench.tasks.optimizer import STATE_FORMATS

    generator = torch.Generator().manual_seed(0)
    shapes = [(128, 128)] * 16 + [(128, 512)] * 8 + [(512, 128)] * 8  # attention's 4 and the MLP's 2, per block
    steps = {}
    for state_format in STATE_FORMATS:
        params = [torch.nn.Parameter(torch.randn(*shape, generator=generator) * 0.02) for shape in shapes]
        for p in params:
            p.grad = torch.randn(p.shape, generator=generator) * 1e-3
        cfg = OmegaConf.create({"name": "adamw", "lr": 1e-3, "beta2": 0.99, "weight_decay": 0.1, "momentum": 0.0,
                                "decay_matrices_only": True, "state_format": state_format})
        optimizer = build_optimizer(cfg, params)
        optimizer.step()  # the warm-up: states made, torchao's steps compiled
        steps[state_format] = optimizer.step
    seconds = alternate(steps, torch.device("cpu"), repeats)
    return [row(f"optimizer_ratio.{fmt}", seconds[fmt] / seconds["fp32"], "x FP32 AdamW's step (median)")
            for fmt in STATE_FORMATS if fmt != "fp32"] + [row("optimizer_step_ms.fp32", seconds["fp32"] * 1e3, "ms")]


SECTIONS = ("harness", "emulation", "accumulation", "compile", "peers", "accounting", "host_syncs", "native",
            "speed_model", "aggregate", "quantise", "optimizer")
CUDA_ONLY = ("host_syncs", "native")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.tools.benchmark", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("results/bench"))
    parser.add_argument("--quick", action="store_true", help="few steps and repeats, LeNet's compiled loop alone, and "
                                                             "the speed model on its hand-compiled rows alone (a smoke "
                                                             "test of the benchmark)")
    parser.add_argument("--steps", type=int, help="steps per timed loop (default 100; native rows 10)")
    parser.add_argument("--repeats", type=int, help="alternating rounds per figure (default 7)")
    parser.add_argument("--native-formats", default=",".join(NATIVE_FORMATS),
                        help=f"comma-separated formats of the native rows (default all: {','.join(NATIVE_FORMATS)})")
    parser.add_argument("--native-cells", help=f"comma-separated model:format pairs of the native rows, instead of "
                                               f"every format on every model (models: {', '.join(PAPER_SHAPES)})")
    parser.add_argument("--emulated", help=f"comma-separated settings of the emulation rows (default all: "
                                           f"{','.join(EMULATED)})")
    parser.add_argument("--as-cpu", choices=list(cpu_proxy.PROXIES),
                        help="measure this CPU as a proxy for one with less (bench/tools/cpu_proxy.py): "
                             + "; ".join(f"{name}: {proxy.stands_for}" for name, proxy in cpu_proxy.PROXIES.items()))
    parser.add_argument("--only", default=",".join(SECTIONS),
                        help=f"comma-separated sections to measure (default all: {','.join(SECTIONS)}; "
                             f"{' and '.join(CUDA_ONLY)} on CUDA only)")
    args = parser.parse_args(argv)
    sections = args.only.split(",")
    if unknown := [name for name in sections if name not in SECTIONS]:
        parser.error(f"unknown section(s) {', '.join(unknown)}; valid: {', '.join(SECTIONS)}")
    native = args.native_formats.split(",")
    if unknown := [name for name in native if name not in NATIVE_FORMATS]:
        parser.error(f"unknown native format(s) {', '.join(unknown)}; valid: {', '.join(NATIVE_FORMATS)}")
    cells = {tuple(pair.split(":", 1)) for pair in args.native_cells.split(",")} if args.native_cells else None
    if unknown := [":".join(c) for c in cells or () if c[0] not in PAPER_SHAPES or c[1] not in NATIVE_FORMATS]:
        parser.error(f"unknown native cell(s) {', '.join(unknown)}; models: {', '.join(PAPER_SHAPES)}; "
                     f"formats: {', '.join(NATIVE_FORMATS)}")
    if args.as_cpu and (why := cpu_proxy.check(args.as_cpu)):
        parser.error(why)
    if args.as_cpu and os.environ.get(cpu_proxy.ACTIVE) != args.as_cpu:
        cpu_proxy.reexecute_as(args.as_cpu, sys.argv[1:] if argv is None else argv)
    proxy = cpu_proxy.apply(args.as_cpu) if args.as_cpu else None
    datasets.disable_progress_bars()
    # every row measures a long run's steady state: each fused graph made on its layout's first call (the warm-up)
    os.environ[fused.COMPILE_WHEN] = fused.AT_ONCE
    steps, repeats = (5, 1) if args.quick else (100, 7)
    steps, repeats = args.steps or steps, args.repeats or repeats
    device = devices.select_device("auto")
    emulated = args.emulated.split(",") if args.emulated else None
    if unknown := [name for name in emulated or [] if name not in EMULATED]:
        parser.error(f"unknown emulated setting(s) {', '.join(unknown)}; valid: {', '.join(EMULATED)}")
    measure = {"harness": lambda: harness_rows(steps, repeats),
               "emulation": lambda: emulation_rows(steps, repeats, emulated),
               "accumulation": lambda: accumulation_rows(max(1, steps // 5), min(repeats, 3)),
               "compile": lambda: compile_rows(steps, min(repeats, 3),
                                               {"lenet": MODELS["lenet"]} if args.quick else MODELS),
               "peers": lambda: peer_rows(steps, repeats), "accounting": lambda: accounting_rows(repeats),
               "host_syncs": lambda: host_sync_rows(steps),
               "native": lambda: native_rows(steps=args.steps or (10 if not args.quick else 2), repeats=repeats,
                                             formats={name: NATIVE_FORMATS[name] for name in native},
                                             cells=cells),
               "speed_model": lambda: speed_model_rows(quick=args.quick),
               "aggregate": lambda: aggregate_rows(200 if args.quick else 10_000),
               "quantise": lambda: quantise_rows(quick=args.quick),
               "optimizer": lambda: optimizer_rows(min(repeats, 5))}
    env = devices.describe(device) | ({"cpu_proxy": proxy} if proxy else {})
    name = machine_name(device, env)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{name}-{dt.date.today().isoformat()}.json"
    rows = []

    def save():  # after every row, so that a run stopped at a time limit keeps what it measured
        path.write_text(json.dumps({"device": name, "env": env, "rows": rows}, indent=2) + "\n")

    save()
    threads = torch.get_num_threads()
    for section in sections:  # in the order asked: a run stopped at a time limit has measured the first ones
        if section in CUDA_ONLY and device.type != "cuda":
            continue
        # each section from torch's threads at the start, whatever ran before it: a cell built sets them to its own
        # (`threads: 1`), and quantise rows measured after the emulation rows read fused NVFP4 at 3.2x clone's speed
        torch.set_num_threads(threads)
        start = time.perf_counter()
        for measured in measure[section]():
            rows.append(measured)
            save()
        print(f"{section}: {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    print(tabulate([[r["metric"], f"{r['value']:.4g}" if isinstance(r["value"], float) else r["value"], r["unit"],
                     r["target"] or ""] for r in rows], headers=["metric", "value", "unit", "target"]))
    print(f"\nwritten to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
