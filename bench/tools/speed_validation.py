"""`make speed-validation`: the speed model (bench/speed/) against every GPU figure we have, out of sample.

    python -m bench.tools.speed_validation [--charlm-text PATH] [--no-fit]

Which figures fit the model's constants and which only score it is decided per source, in the data file
(bench/data/speed_figures.yaml, every published figure with its source and shape), before any fitting:
- fit: torchao's two tensorwise single-Linear examples (the GEMM kernel's latency and FP8's rate without fast
  accumulation), then our H100's eager DistilBERT rows (the host's costs and FP32's CUDA-core efficiency);
- validate: everything else: torchao's row-wise single-Linear table (216 shapes), its Llama3-8B steps on H100 and
  B200, R1 (Raschka's A100 ratios), R3 and NVIDIA's pre-training tables (BERT-large throughput), our H100's other
  rows (BERT-base eager, two compiled steps timed by hand, the char-LM's cells, its GEMM curve: single GEMMs per
  kernel and compiled Linears per FP8 recipe);
- stated: Transformer Engine's and FBGEMM's GEMM figures, which gave the efficiencies and kernel factors.
The fit minimises the fit rows' squared log error (Nelder-Mead), stage by stage, and writes
bench/data/speed_constants.yaml; results/bench/speed_model_validation.{csv,md} show every row, its use and its error,
and the goals on validate rows only.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import numpy as np
import pandas as pd
import torch
import yaml

from bench.data import DATA_DIR
from bench.reporting.predict_cells import SCORECARD
from bench.speed import model as speed
from bench.speed.gemm import GemmKernel
from bench.speed.model import CONSTANTS, NoNativePath, predict, recipe_on
from bench.speed.profiles import GPU, gpu
from bench.speed.trace import HUB_ARCHITECTURES, StepTrace, trace_cell, trace_step, with_op_recomputation

ROOT = Path(__file__).resolve().parents[2]
MEASURED = sorted((ROOT / "results" / "bench").glob("cuda-*.json"))
H100_CHARLM = ROOT / "results" / "tables" / "h100" / "unit_scaling_charlm" / "runs.csv"
OUT = SCORECARD.with_suffix("")
FIGURES = DATA_DIR / "speed_figures.yaml"
GOALS = {"ratio": 0.20, "step": 0.25}  # |error| goals, reported on validate rows: ratios, steps of known overhead


def sources(path: Path = FIGURES) -> dict:
    """The data file's sources by key, each with its `use` (fit | validate | stated) and what it cites."""
    return yaml.safe_load(path.read_text())["sources"]


# The benchmark's native settings (bench/tools/benchmark.py NATIVE_FORMATS) and shapes, as overrides
SETTINGS = {"fp32": ["format=fp32"], "tf32": ["format=tf32"], "16-mixed": ["format=fp16"],
            "16-true": ["format=fp16-true"], "bf16-mixed": ["format=bf16"], "bf16-true": ["format=bf16-true"],
            "fp8": ["format=fp8", "scaling=per_tensor", "format.elsewhere=fp32"],
            "fp8-rowwise": ["format=fp8", "scaling=rowwise", "format.elsewhere=fp32"],
            "fp8-bf16-elsewhere": ["format=fp8", "scaling=per_tensor"],
            "fp8-rowwise-bf16-elsewhere": ["format=fp8", "scaling=rowwise"]}


def published_vocabulary(checkpoint: str) -> int:
    """The embedding rows of a published checkpoint (its architecture, as bench/data/hub_architectures.yaml holds
    it)."""
    return yaml.safe_load(HUB_ARCHITECTURES.read_text())[checkpoint]["vocab_size"]


def encoder(model: str, layers: int, hidden: int, heads: int, intermediate: int, batch: int, seq: int,
            vocabulary: int | None = None) -> list[str]:
    """A random-init BERT-family model of this shape on full-length batches (as make bench measures them), its
    embedding of `vocabulary` rows (None: the shipped tokenizer's 303, as our own runs trained it; a published
    figure's model has its checkpoint's, `published_vocabulary`)."""
    return [f"model={model}", f"model.arch.layers={layers}", f"model.arch.hidden={hidden}",
            f"model.arch.heads={heads}", f"model.arch.intermediate={intermediate}", f"model.batch_size={batch}",
            f"model.max_length={seq}", *([f"model.arch.vocab_size={vocabulary}"] if vocabulary else [])]


SHAPES = {"distilbert": ("DistilBERT 6L×768, 12×512", encoder("distilbert_tiny", 6, 768, 12, 3072, 12, 512)),
          "bert_base": ("BERT-base 12L×768, 12×384", encoder("bert_tiny", 12, 768, 12, 3072, 12, 384))}


@dataclass
class Row:
    """One figure and the model's prediction of it; `source` is its key in the data file, which says its use."""

    source: str
    model: str
    gpu: str
    what: str  # the setting (a step) or the two settings (a ratio)
    mode: str  # eager | compiled | kernels (GPU kernel time, no host)
    measured: float  # seconds, or a ratio
    predict: Callable[[speed.Constants], float | None]
    unit: str = "s"
    use: str = ""  # fit | validate, from the data file

    def error(self, constants: speed.Constants) -> float | None:
        predicted = self.predict(constants)
        return None if predicted is None else predicted / self.measured - 1


_TRACES: dict[str, StepTrace] = {}


def _compose(overrides: list[str]):
    from hydra import compose, initialize_config_dir

    from bench.running.config import CONF_DIR

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=overrides)


def _traced(key: str, make: Callable[[], StepTrace]) -> StepTrace:
    if key not in _TRACES:
        _TRACES[key] = make()
    return _TRACES[key]


def step(overrides: list[str], target: str, compiled: bool) -> Callable[[speed.Constants], float | None]:
    """A cell's predicted step on a GPU, by the model under the constants it is given."""
    cfg = _compose(overrides)
    shape = [o for o in overrides if not o.startswith(("format", "scaling"))]
    traced = _traced(" ".join(shape), lambda: trace_cell(cfg, full_length=True))
    profile = gpu(target)
    recipe = recipe_on(cfg, traced, profile)
    if isinstance(recipe, NoNativePath):
        raise ValueError(f"{' '.join(overrides)}: {recipe}")
    return lambda constants: predict(traced, recipe, profile, compiled, constants).step_s


# the measurements whose eager DistilBERT rows fit the constants: every later run is scored, not fitted
FITTED_MEASUREMENTS = "cuda-nvidia-h100-80gb-hbm3-2026-11-22.json"


def measured_rows() -> list[Row]:
    """The H100's native rows of `make bench` (results/bench/cuda-*.json): the first run's eager DistilBERT rows fit
    the constants; everything else, later runs' (make gpu-report's) included, validates."""
    rows = []
    for path in MEASURED:
        data = json.loads(path.read_text())
        name = next(g.name for g in speed.shipped_gpus().values()
                    if data["env"]["device_name"].startswith(g.device_name))
        taken = {r["metric"]: r["value"] for r in data["rows"]}
        for model, (label, shape) in SHAPES.items():
            for setting, overrides in SETTINGS.items():
                for mode, suffix in (("eager", ""), ("compiled", ".compiled")):
                    seconds = taken.get(f"native.{model}.{setting}{suffix}.step_s")
                    if seconds is None:
                        continue
                    source = ("ours_h100_distilbert_eager" if path.name == FITTED_MEASUREMENTS
                              and model == "distilbert" and mode == "eager" else "ours_h100_other")
                    rows.append(Row(source, label, name, setting, mode, seconds,
                                    step([*shape, *overrides], name, mode == "compiled")))
        if "accounting_share.lenet.fp32" in taken:
            rows.append(Row("ours_h100_other", "LeNet-5, 32×1×32×32", name, "fp32", "eager",
                            lenet_plain_step(taken), step(["model=lenet", "format=fp32"], name, compiled=False)))
    return rows


def lenet_plain_step(taken: dict) -> float:
    """LeNet's bare eager FP32 step as make bench timed it (its accounting rows: the one-off accounting's seconds over
    its share of a default cell's training, which is the cell's steps x the median bare step)."""
    from bench.running.train import total_steps
    from bench.tasks import build_task

    cfg = _compose(["model=lenet"])
    steps = total_steps(build_task(cfg.model, torch.device("cpu"), seed=0), cfg.train)
    return taken["accounting_s.lenet.fp32"] / taken["accounting_share.lenet.fp32"] / steps


def hand_compiled_rows() -> list[Row]:
    """The two compiled GPU steps we have, timed by hand on the H100 of make bench's native rows (2026-11-22,
    `torch.compile(model)` on BERT-base's bench shape, the optimiser eager; docs/performance.md): FP8 (torchao
    tensorwise, FP32 elsewhere) 40.2 ms, bf16-mixed 21.6 ms."""
    label, shape = SHAPES["bert_base"]
    return [Row("ours_h100_hand_compiled", label, "H100", setting, "compiled", seconds,
                step([*shape, *SETTINGS[setting]], "H100", compiled=True))
            for setting, seconds in (("bf16-mixed", 21.6e-3), ("fp8", 40.2e-3))]


CHARLM_CELLS = {("32-true", "none"): ["format=fp32", "scaling=none"],
                ("32-true", "unit"): ["format=fp32", "scaling=unit"],
                ("16-mixed", "none"): ["format=fp16", "scaling=none"],
                ("16-mixed", "static"): ["format=fp16", "scaling=static"],
                ("16-mixed", "unit"): ["format=fp16", "scaling=unit"],
                ("fp8-mixed", "per_tensor"): ["format=fp8", "scaling=per_tensor", "format.elsewhere=fp32"]}


def charlm_rows(text: Path) -> list[Row]:
    """The char-LM's native cells measured on an H100 (results/tables/h100/unit_scaling_charlm, eager, made before
    0.2.0: FP8 with FP32 elsewhere): their median step over seeds."""
    runs = pd.read_csv(H100_CHARLM)
    runs = runs[runs["device"].str.startswith("NVIDIA H100") & (runs["backend"] == "native")]
    rows = []
    for (setting, scaling, label), part in runs.groupby(["setting", "scaling", "model_label"], sort=True):
        norm = "post" if "post-norm" in label else "pre"
        overrides = ["model=charlm", "model.data.source=local", f"model.data.path={text}",
                     f"model.arch.norm={norm}", *CHARLM_CELLS[(setting, scaling)]]
        rows.append(Row("ours_h100_charlm", f"charlm 4L×128 {norm}-norm, 12×64",
                        "H100", f"{setting} ({scaling})", "eager", float(part["step_median_s"].median()),
                        step(overrides, "H100", compiled=False)))
    return rows


def ratio(numerator: Callable, denominator: Callable, batches: tuple[int, int] = (1, 1)) -> Callable:
    """Predicted throughput ratio: (batch / step) of `denominator`'s setting over `numerator`'s."""
    return lambda c: (batches[1] / denominator(c)) / (batches[0] / numerator(c))


def llama3_8b() -> StepTrace:
    """Llama3-8B's training step (its config: 32 layers, 4096 wide, 14336 FFN, 32 heads, 8 KV heads, vocab 128256) on
    one 8192-token sequence, torchtitan's per-GPU batch, traced on the meta device; each layer recomputed in the
    backward as torchtitan's per-op selective activation checkpointing does (the published runs')."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from bench.tasks.base import Task

    config = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192,
                         rope_theta=500000.0, tie_word_embeddings=False, attn_implementation="sdpa")
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    ids = torch.zeros(1, 8192, dtype=torch.long, device="meta")
    task = Task(model=model, train_batches=lambda epoch: iter([ids]), evaluate=lambda *a: {}, batch_size=1,
                steps_per_epoch=1, forward=lambda m, batch, cast: (m(input_ids=batch).logits.float(), batch),
                loss=lambda logits, y, ce: ce(logits.view(-1, logits.size(-1)), y.view(-1)))
    return with_op_recomputation(trace_step(task, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True)),
                                 "model.layers")


class LayerNormLinearSigmoid(torch.nn.Module):
    """torchao's single-Linear microbenchmark (benchmarks/float8/float8_roofline.py): LayerNorm without affine, a
    bias-free Linear, a sigmoid; forward and backward."""

    def __init__(self, k: int, n: int):
        super().__init__()
        self.norm = torch.nn.LayerNorm(k, elementwise_affine=False)
        self.fc = torch.nn.Linear(k, n, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.fc(self.norm(x)))


def single_linear(m: int, k: int, n: int) -> StepTrace:
    """That microbenchmark's forward and backward at (M, K, N), traced on the meta device (its input requires a
    gradient, so all three GEMMs run; a sum stands in for its random output gradient; no optimiser step)."""
    from bench.tasks.base import Task

    with torch.device("meta"):
        model = LayerNormLinearSigmoid(k, n)
    x = torch.zeros(m, k, device="meta", requires_grad=True)
    task = Task(model=model, train_batches=lambda epoch: iter([x]), evaluate=lambda *a: {}, batch_size=m,
                steps_per_epoch=1, forward=lambda module, batch, cast: (module(batch), None),
                loss=lambda out, y, ce: out.sum())
    return trace_step(task, lambda module: torch.optim.SGD(module.parameters(), lr=0.0))


# torchao's microbenchmark runs the whole module in BF16 (`.bfloat16()`), compiled, and times the GPU's kernels
BF16_TRUE = speed.Recipe("bf16-true", "bf16", "bf16", "bf16", "all")


def kernel_seconds(trace: StepTrace, recipe: speed.Recipe, target: str) -> Callable[[speed.Constants], float]:
    """The GPU's time for the forward and backward passes, compiled: no host time, no optimiser."""
    def seconds(constants: speed.Constants) -> float:
        p = predict(trace, recipe, gpu(target), True, constants)
        return p.gemm + p.attention + p.memory + p.casts
    return seconds


def single_linear_rows(key: str, source: dict) -> list[Row]:
    """A single-Linear source's rows: FP8 (the source's torchao recipe, BF16 elsewhere) over BF16."""
    shapes = source.get("rows") or [
        [m, k, n, source["speedup"][i * len(source["grid"]) + j][c]]
        for i, m in enumerate(source["grid"]) for j, k in enumerate(source["grid"])
        for c, n in enumerate(source["grid"])]
    fp8 = speed.Recipe(f"fp8 {source['recipe']}", "fp8", "bf16", "bf16", "fp8", casts=source["recipe"])
    rows = []
    for m, k, n, speedup in shapes:
        trace = single_linear(m, k, n)
        rows.append(Row(key, f"LayerNorm→Linear→Sigmoid M,K,N = {m},{k},{n}", source["gpu"],
                        f"fp8 {source['recipe']} / bf16", "kernels", speedup,
                        ratio(kernel_seconds(trace, BF16_TRUE, source["gpu"]),
                              kernel_seconds(trace, fp8, source["gpu"])), "x"))
    return rows


# torchtitan's FSDP2 setting of the published Llama3-8B runs: BF16 parameters gathered, FP32 gradients reduce-scattered
LLAMA_FSDP2 = {"name": "fsdp2", "world_size": 8, "param_dtype": "bf16", "reduce_dtype": "fp32",
               "gradient_compression": "none"}


def llama_fsdp_step(overrides: list[str], target: str, fp8_gather: bool = False) -> Callable:
    """Llama3-8B's compiled step on one of 8 GPUs under FSDP2 (bench.speed.model.rank_step; `fp8_gather`: torchao's
    FP8 all-gather of the converted weights): constants -> the GPU's RankStep."""
    from omegaconf import OmegaConf

    trace, profile = _traced("llama3_8b", llama3_8b), gpu(target)
    recipe = recipe_on(_compose(["model=bert_tiny", *overrides]), trace, profile)  # the setting; the trace is Llama's
    fsdp = OmegaConf.create(LLAMA_FSDP2)
    return lambda constants: speed.rank_step(trace, recipe, profile, True, fsdp, "model.layers", constants, fp8_gather)


def llama_rows(key: str, source: dict) -> list[Row]:
    """Llama3-8B on 8 GPUs under FSDP2 (torchtitan's published runs, per-op SAC): each setting's step on a GPU (8,192
    tokens / its tokens/s), and its tokens/s over BF16's. torchao's tensorwise runs gathered their weights in FP8."""
    def step_s(overrides: list[str]) -> Callable:
        priced = llama_fsdp_step(overrides, source["gpu"], fp8_gather="scaling=per_tensor" in overrides)
        return lambda constants: priced(constants).seconds

    model = "Llama3-8B, 1×8192 a GPU, 8 GPUs (FSDP2)"
    bf16 = step_s(["format=bf16"])
    rows = [Row(key, model, source["gpu"], f"{' '.join(overrides)} (bf16 elsewhere) / bf16-mixed", "compiled",
                tokens / source["baseline"], ratio(bf16, step_s(overrides)), "x")
            for overrides, tokens in source["rows"]]
    return rows + [Row(key, model, source["gpu"], " ".join(overrides), "compiled", 8192 / tokens, step_s(overrides))
                   for overrides, tokens in [(["format=bf16"], source["baseline"]), *source["rows"]]]


def raschka_rows(key: str, source: dict) -> list[Row]:
    """R1: DistilBERT's FP32 training time over each setting's, on an A100, eager."""
    distil = encoder("distilbert_tiny", 6, 768, 12, 3072, 12, 512, published_vocabulary("distilbert-base-uncased"))
    name, minutes = source["baseline"]
    fp32 = step([*distil, *SETTINGS[name]], source["gpu"], compiled=False)
    return [Row(key, "DistilBERT 6L×768, 12×512", source["gpu"], f"{setting} / {name}", "eager", minutes / theirs,
                ratio(fp32, step([*distil, *SETTINGS[setting]], source["gpu"], compiled=False)), "x")
            for setting, theirs in source["rows"]]


def bert_large_rows(key: str, source: dict) -> list[Row]:
    """R3 and NVIDIA's pre-training tables: BERT-large on one GPU, eager, each step (batch / throughput), and each
    GPU and sequence length's ratio of its two settings' throughput as one row."""
    rows, pairs, vocabulary = [], {}, published_vocabulary("bert-large-uncased")
    for target, setting, batch, seq, per_s in source["rows"]:
        predicted = step([*encoder("bert_tiny", 24, 1024, 16, 4096, batch, seq, vocabulary), *SETTINGS[setting]],
                         target, compiled=False)
        rows.append(Row(key, f"BERT-large 24L×1024, {batch}×{seq}", target, setting, "eager", batch / per_s,
                        predicted))
        pairs.setdefault((target, seq), []).append((setting, batch, per_s, predicted))
    for (target, seq), ((low, b0, s0, p0), (high, b1, s1, p1)) in pairs.items():
        rows.append(Row(key, f"BERT-large 24L×1024, ×{seq}", target, f"{high} (batch {b1}) / {low} (batch {b0})",
                        "eager", s1 / s0, ratio(p0, p1, (b0, b1)), "x"))
    return rows


# gpu_gemms' GEMM kernels as the model prices them: torch._scaled_mm's FP8 kernels, tensor- or row-scaled
GEMM_KERNELS = {"bf16": GemmKernel("bf16"), "fp8_tensorwise_fast": GemmKernel("fp8", "tensor"),
                "fp8_tensorwise": GemmKernel("fp8", "tensor", fast_accum=False),
                "fp8_rowwise_fast": GemmKernel("fp8", "row"), "fp8_rowwise": GemmKernel("fp8", "row", fast_accum=False)}
LINEAR_RECIPES = {"bf16": BF16_TRUE} | {r: speed.Recipe(f"fp8 {r}", "fp8", "bf16", "bf16", "fp8", casts=r)
                                        for r in ("tensorwise", "rowwise")}  # bf16 weights, as gpu_gemms makes them
GEMM_MODE, LINEAR_MODE = "one GEMM", "one compiled Linear"  # timed alone: scored apart from the training steps
HOST_BOUND_S = 2e-3  # a compiled Linear timed from Python under this is the host's (0.6-1.5 ms at any small shape)


def gemm_seconds(m: int, k: int, n: int, kernel: GemmKernel, profile: GPU) -> Callable[[speed.Constants], float]:
    """The model's time for one M x K x N GEMM of `kernel` with a bf16 output on `profile`: its GEMM pricing
    (gemm_time at the profile's rate for the kernel), as a step's GEMM op of that shape is priced."""
    op = SimpleNamespace(gemm=(1, m, k, n))
    return lambda constants: speed._Costs(BF16_TRUE, profile, constants).gemm(op, kernel, 0.0)


def linear_seconds(m: int, k: int, n: int, recipe: speed.Recipe, profile: GPU) -> Callable[[speed.Constants], float]:
    """The model's time for one compiled Linear's forward and backward on `profile`: its three GEMMs and its recipe's
    casts, as bench.predict --gemms prices a Linear (gemm_breakdown; the GPU's time only, no host)."""
    trace = _traced(f"single linear {m} {k} {n}", lambda: single_linear(m, k, n))
    return lambda constants: sum(p["format_s"] for p in speed.gemm_breakdown(trace, recipe, BF16_TRUE, profile,
                                                                              constants))


def gemm_curve_rows(key: str, source: dict) -> list[Row]:
    """Our H100's GEMM curve (bench.tools.gpu_gemms curve, the source's `part` of its CSV): each GEMM's or compiled
    Linear's time per kernel or recipe, and each FP8 one's speed-up over bf16 at that shape (a shape timed twice: the
    median)."""
    taken = pd.read_csv(ROOT / source["csv"])
    taken = taken[taken["part"] == source["part"]].groupby(["m", "k", "n", "kernel"], sort=False)["seconds"].median()
    gemms, profile = source["part"] == "gemm", gpu(source["gpu"])
    rows = []
    for (m, k, n), by_kernel in taken.groupby(level=["m", "k", "n"], sort=False):
        by_kernel = by_kernel.droplevel(["m", "k", "n"])
        if gemms:
            label, mode = f"GEMM M,K,N = {m},{k},{n}", GEMM_MODE
            times = {kern: gemm_seconds(m, k, n, GEMM_KERNELS[kern], profile) for kern in by_kernel.index}
        else:
            host = " (host-bound)" if by_kernel.max() < HOST_BOUND_S else ""
            label, mode = f"Linear {k}→{n} on {m} tokens{host}", LINEAR_MODE
            times = {r: linear_seconds(m, k, n, LINEAR_RECIPES[r], profile) for r in by_kernel.index}
        rows += [Row(key, label, source["gpu"], kern, mode, s, times[kern]) for kern, s in by_kernel.items()]
        rows += [Row(key, label, source["gpu"], f"{kern} / bf16", mode, by_kernel["bf16"] / s,
                     ratio(times["bf16"], times[kern]), "x") for kern, s in by_kernel.items() if kern != "bf16"]
    return rows


KINDS = {"single_linear": single_linear_rows, "llama3_8b": llama_rows, "distilbert_ratio": raschka_rows,
         "bert_large": bert_large_rows, "gemm_curve": gemm_curve_rows}


def published_rows(kinds=tuple(KINDS)) -> list[Row]:
    """Every published source's rows of `kinds` (default: all), built by its kind."""
    return [row for key, source in sources().items() if source.get("kind") in kinds
            for row in KINDS[source["kind"]](key, source)]


def with_uses(rows: list[Row], declared: dict | None = None) -> list[Row]:
    """Each row's use, as the data file declares its source's; a row of a `stated` source is refused."""
    declared = declared or sources()
    for r in rows:
        r.use = declared[r.source]["use"]
        if r.use not in ("fit", "validate"):
            raise ValueError(f"{r.source}: a {r.use} source gives constants and is not scored")
    return rows


def fit(rows: list[Row]) -> speed.Constants:
    """The constants that make the fit rows' log errors smallest (Nelder-Mead from the shipped ones), source by source
    as the data file lists them (each fitting its `fits`, the earlier ones held): the GEMM kernel's constants on
    torchao's examples, then the host's on our eager DistilBERT steps (there the host's time and the GPU's entangle)."""
    from scipy.optimize import minimize

    constants = CONSTANTS
    for key, source in sources().items():
        fitting = [r for r in rows if r.source == key and r.use == "fit"]
        if not fitting:
            continue
        names = tuple(source["fits"])
        scale = [getattr(constants, name) for name in names]

        def trial(x, base=constants, names=names, scale=scale) -> speed.Constants:
            return dataclasses.replace(base, **{n: abs(v) * s for n, v, s in zip(names, x, scale)})

        def loss(x, fitting=fitting, trial=trial) -> float:
            c = trial(x)
            return sum(math.log(r.predict(c) / r.measured) ** 2 for r in fitting)

        result = minimize(loss, [1.0] * len(names), method="Nelder-Mead", options={"maxiter": 2000, "xatol": 1e-4})
        constants = trial(result.x)
    return constants


def table(rows: list[Row], constants: speed.Constants) -> pd.DataFrame:
    out = []
    for r in rows:
        predicted = r.predict(constants)
        shown = (lambda v: f"{v * 1e3:.3g} ms") if r.unit == "s" else (lambda v: f"{v:.2f}×")
        out.append({"use": r.use, "source": r.source, "model": r.model, "GPU": r.gpu, "setting": r.what,
                    "mode": r.mode, "measured or published": shown(r.measured), "predicted": shown(predicted),
                    "error": f"{predicted / r.measured - 1:+.0%}", "error_value": predicted / r.measured - 1,
                    "measured_value": r.measured, "predicted_value": predicted, "unit": r.unit})
    return pd.DataFrame(out)


def _same_side(ratios: pd.DataFrame) -> pd.Series:
    """Whether each predicted speed-up lies on the published one's side of 1.0: both gains, both losses, or both
    exactly 1 (a published 1.00 is no gain, so a predicted gain there is a miss)."""
    return np.sign(ratios["measured_value"] - 1) == np.sign(ratios["predicted_value"] - 1)


def against_goals(frame: pd.DataFrame) -> list[str]:
    """The goals, on validate rows only: every predicted speed-up on the same side of 1.0 as the published one, and
    within ±20% on 80% of them; steps within ±25% where the script's overhead is known (ours), and the rest of the
    steps (published with a script's overhead the model does not know) shown beside them, without a goal; single
    GEMMs and Linears timed alone (ours) apart from the steps, per kernel, without a goal. Where a source's speed-ups
    compare several settings over several shapes, each setting's too."""
    frame = frame.assign(**{c: "" for c in ("mode", "setting") if c not in frame})
    valid = frame[frame["use"] == "validate"]
    ratios = valid[valid["unit"] == "x"]
    side = _same_side(ratios)
    timed = valid[(valid["unit"] == "s") & valid["mode"].isin((GEMM_MODE, LINEAR_MODE))]
    steps = valid[(valid["unit"] == "s") & ~valid.index.isin(timed.index)]
    known = steps["source"].str.startswith("ours_")

    def within(part: pd.DataFrame, goal: float) -> str:
        return f"{(part['error_value'].abs() <= goal).sum()} of {len(part)} within ±{goal:.0%}" + (
            f" (median |error| {part['error_value'].abs().median():.0%})" if len(part) else "")

    lines = [f"- speed-ups (validate, {len(ratios)} rows): {int(side.sum())} of {len(ratios)} on the same side of 1.0 "
             f"as published (goal: all); {within(ratios, GOALS['ratio'])} (goal: 80%)"]
    for key, part in ratios.groupby("source", sort=False):
        same = _same_side(part).sum()
        lines.append(f"  - {key}: {same} of {len(part)} on the right side of 1.0; {within(part, GOALS['ratio'])}")
        settings = part.groupby("setting", sort=False)
        if len(settings) > 1 and (settings.size() > 1).all():
            for what, rows in settings:
                same = _same_side(rows).sum()
                lines.append(f"    - {what}: {same} of {len(rows)} on the right side of 1.0; "
                             f"{within(rows, GOALS['ratio'])}")
    lines.append(f"- steps whose script overhead is known (ours, validate): {within(steps[known], GOALS['step'])} "
                 "(goal: all)")
    lines.append(f"- steps published with a script's overhead not modelled (validate, no goal): "
                 f"{within(steps[~known], GOALS['step'])}")
    for mode, part in timed.groupby("mode", sort=False):
        lines.append(f"- {mode} timed alone, ours (validate, no goal): {within(part, GOALS['step'])}")
        lines += [f"  - {what}: median predicted / measured {(rows['error_value'] + 1).median():.2f}; "
                  f"{within(rows, GOALS['step'])}" for what, rows in part.groupby("setting", sort=False)]
    return lines


def write(frame: pd.DataFrame, constants: speed.Constants) -> None:
    shown = frame.drop(columns=["error_value", "measured_value", "predicted_value", "unit"])
    shown.to_csv(OUT.with_suffix(".csv"), index=False)
    lines = ["# The speed model against every GPU figure we have", "",
             "Written by `make speed-validation` (bench/tools/speed_validation.py); bench/speed/ is the model. The "
             "split into `fit` and `validate` is the data file's (bench/data/speed_figures.yaml), by source, decided "
             "before fitting; goals are reported on `validate` rows only.", "", "## Against the goals (validate rows)",
             "", *against_goals(frame), "", "## Sources", ""]
    for key, source in sources().items():
        lines.append(f"- `{key}` ({source['use']}): {source['cite']}")
    lines += ["", "## Constants", "", "| constant | value | source |", "|---|---|---|"]
    for field in dataclasses.fields(constants):
        value = getattr(constants, field.name)
        shown_value = f"{value * 1e6:.3g} µs" if field.name.endswith("_s") else f"{value:.3g}"
        lines.append(f"| {field.name} | {shown_value} | {speed.STATED[field.name]} |")
    lines += ["", "## Every row", "", shown.to_markdown(index=False, disable_numparse=True)]
    OUT.with_suffix(".md").write_text("\n".join(lines) + "\n")


LLAMA_FSDP = ROOT / "results" / "bench" / "llama3_8b_fsdp.md"


def llama_fsdp(source: dict) -> list[str]:
    """Llama3-8B on 8 GPUs under FSDP2 as torchtitan trains it (`llama_fsdp_step`): per GPU, the compiled step, its
    collectives and their exposed part, and tokens/s beside the published figure (scored in the validation table,
    `llama_rows`)."""
    target = gpu(source["gpu"])
    settings = [(["format=bf16"], "bf16-mixed", source["baseline"], False)]
    for overrides, tokens in source["rows"]:
        tensorwise = "scaling=per_tensor" in overrides  # torchao's tensorwise run gathered its weights in FP8
        settings.append((overrides, " ".join(overrides), None if tensorwise else tokens, False))
        if tensorwise:
            settings.append((overrides, f"{' '.join(overrides)}, FP8 all-gather", tokens, True))
    lines = [f"# Llama3-8B, 8x {target.name}, FSDP2 (predicted)", "",
             "`python -m bench.tools.speed_validation --llama-fsdp`: torchtitan's setting (BF16 parameters gathered, "
             "FP32 gradients reduce-scattered, the optimiser sharded 8 ways), each GPU's compiled step with its "
             "collectives priced over NVLink (bench.speed.model.collectives) and the part of them FSDP2's prefetch "
             "does not hide, and per-op selective activation checkpointing's recomputation "
             "(bench.speed.trace.with_op_recomputation). The same steps are validate rows of "
             "speed_model_validation.md.", "",
             f"Published: {source['cite']}", "",
             "| setting | step (ms) | collectives (ms) | exposed (ms) | tokens/s a GPU | published | off |",
             "|---|---|---|---|---|---|---|"]
    for overrides, label, published, fp8_gather in settings:
        ranked = llama_fsdp_step(overrides, source["gpu"], fp8_gather)(CONSTANTS)
        seconds, sent = ranked.seconds, ranked.collectives
        tokens = 8192 / seconds
        against = f"{published:g} | {(tokens / published - 1) * 100:+.0f}%" if published else "– | –"
        lines.append(f"| {label} | {seconds * 1e3:.0f} | {sent.seconds * 1e3:.0f} | {sent.exposed * 1e3:.1f} | "
                     f"{tokens:.0f} | {against} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.tools.speed_validation", description=__doc__.splitlines()[0])
    parser.add_argument("--charlm-text", type=Path, default=ROOT.parent / "shared" / "data" / "tinyshakespeare.txt",
                        help="Tiny Shakespeare (the char-LM rows' vocabulary); without it they are left out")
    parser.add_argument("--no-fit", action="store_true", help="validate the constants as they are")
    parser.add_argument("--llama-fsdp", action="store_true",
                        help=f"only Llama3-8B on 8 H100s under FSDP2 with its collectives, to {LLAMA_FSDP.name}")
    args = parser.parse_args(argv)
    if args.llama_fsdp:
        sources = yaml.safe_load((DATA_DIR / "speed_figures.yaml").read_text())["sources"]
        LLAMA_FSDP.write_text("\n".join(llama_fsdp(sources["torchao_llama3_h100"])) + "\n")
        print(LLAMA_FSDP.read_text())
        return 0
    rows = with_uses(measured_rows() + hand_compiled_rows() + published_rows()
                     + (charlm_rows(args.charlm_text) if args.charlm_text.is_file() else []))
    constants = CONSTANTS if args.no_fit else fit(rows)
    if not args.no_fit:
        speed.CONSTANTS_FILE.write_text(yaml.safe_dump({f.name: float(f"{getattr(constants, f.name):.4g}")
                                                        for f in dataclasses.fields(constants)}, sort_keys=False))
        constants = speed.load_constants()
    frame = table(rows, constants)
    write(frame, constants)
    print("\n".join(against_goals(frame)))
    print(f"\nwritten: {OUT.with_suffix('.md')}, {OUT.with_suffix('.csv')}; constants: {speed.CONSTANTS_FILE}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
