"""The speed model: a training step's time on a GPU, predicted from the cell's own traced step (bench/speed/trace.py),
compiled and eager. A prediction says it is one, and results/bench/speed_model_validation.md how far off it has been
out of sample.

Each op of the trace is priced by its kind:
- a matrix product by its shape, operand type and kernel (bench/speed/gemm.py: tiles, waves over the SMs, split-K,
  the type's large-GEMM efficiency from the GPU profile, the kernel's factor: FP8 without fast accumulation, the
  row-scaled FP8 kernel); a convolution at the type's large-GEMM rate;
- attention (SDPA, fused) at the profile's attention efficiency;
- memory-bound ops at MEMORY_EFFICIENCY of the bandwidth, no kernel shorter than KERNEL_FLOOR_S.
What the cell's setting changes, on the path the runner would take on that GPU (`Recipe`, decided by the runner's
own rules on a simulated device of the GPU's compute capability): the GEMM operands' type and kernel (a converted
Linear's FP8 or MXFP8, the rest in the autocast dtype or FP32), the bytes of every other op (BF16/FP16 outside the
GEMMs, or FP32), the optimiser's (FP32 master weights, or a whole-model 16-bit cast), and what the recipe adds:
autocast's weight casts, and an FP8 or MX recipe's amaxes and casts, counted as torchao's float8 roofline
(benchmarks/float8/float8_roofline.py) counts them, kernel by kernel.

- compiled: the memory-bound ops between two GEMMs (or attention ops) of the forward or the backward pass run as
  one fused kernel, as inductor fuses them: it reads the tensors made outside it and writes the ones used outside
  it; and every kernel costs COMPILED_LAUNCH_S on the host.
- eager: every op its own kernel, each costing DISPATCH_S on the host (a PyTorch dispatch and launch), and each
  FP8 Linear's tensor-subclass dispatch FLOAT8_LINEAR_S more (torchao's Float8Linear in eager mode).

The step is the sum of the GPU's time and the host's. GPU profiles are data (bench/speed/profiles.py). Where the
runner would emulate the format on that GPU, there is no prediction: "no native path on <GPU>" and why.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from bench.data import DATA_DIR
from bench.errors import ConfigError
from bench.numerics import hardware
from bench.numerics.blocks import MX_BLOCK
from bench.speed.gemm import PEAK, RATE, GemmKernel, gemm_time, rate
from bench.speed.profiles import GPU, shipped_gpus
from bench.speed.trace import StepTrace, TracedOp
from bench.tasks.base import block_of


@dataclass(frozen=True)
class Constants:
    """What the model assumes beyond the datasheets, each with where it comes from (docs/performance.md)."""

    gemm_efficiency: float  # of the FP32 (CUDA-core) peak an FP32 GEMM or attention kernel reaches
    memory_efficiency: float  # of the bandwidth a memory-bound kernel reaches
    kernel_floor_s: float  # the shortest a kernel takes on the GPU
    gemm_latency_s: float  # a GEMM kernel's time beyond its waves: launch, pipeline fill, epilogue
    fp8_no_fast_accum: float  # an FP8 GEMM promoting its partial sums to FP32 (cuBLAS without fast accumulation)
    fp8_rowwise: float  # torch._scaled_mm's row-scaled FP8 kernel (CUTLASS, fast accumulation)
    dispatch_s: float  # eager: host time per op (PyTorch's dispatch and the launch)
    autocast_dispatch_s: float  # eager: more host time per op under autocast (its dispatch key, its casting)
    float8_linear_s: float  # eager: host time per FP8 Linear per step (torchao's tensor-subclass dispatch)
    compiled_launch_s: float  # compiled: host time per kernel of the compiled graph


# The constants' values live in bench/data/speed_constants.yaml, which `make speed-validation`
# (bench/tools/speed_validation.py) writes with those it fits; every row it does not fit on validates them
# (results/bench/speed_model_validation.md). Where each comes from:
STATED = {
    "gemm_efficiency": "fitted on the eager fit rows (DistilBERT's H100 FP32 step is GEMM-bound on CUDA cores)",
    "memory_efficiency": "stated: elementwise kernels reach ~80% of HBM bandwidth (torchao assumes 0.92 for its "
                         "triton kernels on its H100; eager PyTorch's are slower)",
    "kernel_floor_s": "stated: torchao's roofline, a one-element triton kernel measured on an H100",
    "gemm_latency_s": "fitted on torchao's two tensorwise single-Linear examples (H100), the only GEMM fit rows",
    "fp8_no_fast_accum": "stated: 0.785, from Transformer Engine's published FP8 GEMM speed-up over BF16 on H200 "
                         "(1.69x, delayed scaling): its forward GEMM accumulates fast (2x BF16 at FP8's 0.78), its two "
                         "backward GEMMs promote to FP32, so 3 / (0.5 + 2 / (2 x f)) = 1.69 gives f = 0.785",
    "fp8_rowwise": "stated: 0.96, FBGEMM's published H100 benchmark (pytorch/FBGEMM#2546, 8192³: the row-scaled "
                   "FP8 GEMM at 1,125.5 TFLOP/s, BF16 at 585.2: 1.92x, not 2x); the row-wise single-Linear table "
                   "(216 shapes) validates it",
    "dispatch_s": "fitted on the eager fit rows (DistilBERT's 16-bit steps on the H100 are partly launch-bound)",
    "autocast_dispatch_s": "fitted on the eager fit rows (DistilBERT's 16-bit mixed ones)",
    "float8_linear_s": "fitted on the eager fit rows (DistilBERT's FP8 ones: eager torchao Float8Linear)",
    "compiled_launch_s": "stated (assumed): a compiled graph's wrapper launching one inductor kernel (a BERT-base "
                         "step's ~1,100 kernels: 5.5 ms if they were not hidden behind the GPU's work)",
}
CONSTANTS_FILE = DATA_DIR / "speed_constants.yaml"


def load_constants(path: Path = CONSTANTS_FILE) -> Constants:
    return Constants(**{k: float(v) for k, v in yaml.safe_load(path.read_text()).items()})


CONSTANTS = load_constants()

ELEMENT_BYTES = {"fp32": 4.0, "tf32": 4.0, "bf16": 2.0, "fp16": 2.0, "fp8": 1.0,
                 "mxfp8": 1.0 + 1.0 / MX_BLOCK,  # an E8M0 scale per 32 elements
                 "nvfp4": 0.5 + 1.0 / 16, "mxfp4": 0.5 + 1.0 / MX_BLOCK, "mxfp6": 0.75 + 1.0 / MX_BLOCK}
DTYPE_ELEMENTS = {torch.float16: "fp16", torch.bfloat16: "bf16"}


def missing_rates(target: GPU, elements) -> list[str]:
    """The types among `elements` the profile gives no dense peak or (tensor cores) no large-GEMM efficiency for."""
    missing = set()
    for element in elements:
        key = RATE[element]
        if PEAK.get(key, key) not in target.tflops or (key != "fp32" and key not in target.gemm_efficiency):
            missing.add(key)
    return sorted(missing)


@dataclass(frozen=True)
class Recipe:
    """How a setting runs on a GPU, natively: the element types of each class of op, and what the recipe adds."""

    setting: str  # the tables' name (bf16-mixed, fp8-mixed, ...)
    linear: str  # element type of a converted Linear's GEMM operands (its rate too)
    elsewhere: str  # element type of every other op's tensors (and of unconverted GEMMs)
    stored: str  # element type of parameters, gradients and optimiser state
    converts: str  # which Linears take `linear`: all | fp8 (dims multiples of 16) | mx (of 32)
    casts: str | None = None  # the FP8/MX recipe whose amaxes and casts are added: tensorwise | rowwise | ... | nvfp4
    autocast: bool = False  # autocast casts each Linear's FP32 weight to `elsewhere` once a step
    kept: tuple[str, ...] = ()  # Linears format.keep_high_precision keeps out of the format
    rht: bool = False  # nvfp4: the weight-gradient operands' random Hadamard transform (its amax and cast passes)
    weight_tiles: bool = False  # nvfp4: 16 x 16 weight tiles, one cast serving both GEMMs
    note: str = ""  # how the path is taken, where the runner itself does not take it


@dataclass(frozen=True)
class NoNativePath:
    """A setting the runner would emulate on the GPU: no prediction, and why."""

    gpu: str
    why: str

    def __str__(self) -> str:
        return f"no native path on {self.gpu}: {self.why}"


def recipe_on(cfg, trace: StepTrace, target: GPU) -> Recipe | NoNativePath:
    """The path the runner would take for cell `cfg` on `target` (`_runner_path`), where the GPU's profile has the
    rates it needs."""
    recipe = _runner_path(cfg, trace, target)
    missing = missing_rates(target, (recipe.linear, recipe.elsewhere)) if isinstance(recipe, Recipe) else []
    if missing:
        return NoNativePath(target.name, f"its profile has no {' or '.join(missing)} rate")
    return recipe


def _runner_path(cfg, trace: StepTrace, target: GPU) -> Recipe | NoNativePath:
    """The path the runner would take for cell `cfg` on `target`: its own decision under format.backend=auto (a
    cell emulated on a CPU is predicted as its format runs where the GPU has it), with torchao installed (as `make
    setup` installs it where there is a GPU), on a simulated device of that compute capability; and, for torchao's
    recipes, whether the model has a Linear it converts."""
    from omegaconf import OmegaConf

    from bench.numerics.plan import PrecisionConfig, kept_layers, plan
    from bench.numerics.scaling_methods import build

    cfg = OmegaConf.merge(cfg, {"format": {"backend": "auto"}})
    with hardware.simulated("cuda", (), target.compute_capability, torchao=True) as device:
        try:
            decided = plan(PrecisionConfig.from_config(cfg), build(cfg.scaling), device)
        except ConfigError as e:  # format.backend=native where the GPU has no native path
            return NoNativePath(target.name, str(e))
    kept = tuple(kept_layers(list(trace.linears), decided.config.keep_high_precision, cfg.model.task.get("blocks"))
                 ) if decided.spec.gemm_only else ()
    if not decided.native and decided.spec.block == "nvfp4":
        return _nvfp4_path(decided, target, kept)
    if not decided.native:
        return NoNativePath(target.name, decided.why)
    spec, setting = decided.spec, decided.setting
    if not spec.gemm_only and spec.torch_dtype is None:  # FP32, or TF32 where the flags say so
        element = "tf32" if decided.flags["cuda_matmul"] == "tf32" else "fp32"
        return Recipe(setting, element, element, "fp32", "all")
    if not spec.gemm_only:  # 16-bit: autocast (mixed) or the whole model cast (true)
        element = DTYPE_ELEMENTS[spec.torch_dtype]
        true = decided.mode == "true"
        return Recipe(setting, element, element, element if true else "fp32", "all", autocast=not true)
    mx = spec.block == "mx"
    elsewhere = "bf16" if decided.elsewhere == "bf16" else "fp32"
    recipe = Recipe(setting, "mxfp8" if mx else "fp8", elsewhere, "fp32", "mx" if mx else "fp8",
                    casts="mxfp8" if mx else decided.torchao_recipe, autocast=elsewhere == "bf16", kept=kept)
    if not any(_converted(recipe, trace, name) for name in trace.linears):
        return NoNativePath(target.name, f"torchao converts no Linear of this model (a plain nn.Linear whose in and "
                                         f"out features are multiples of {MX_BLOCK if mx else 16}; a unit-scaled one "
                                         "is not)")
    return recipe


NVFP4_NOTE = ("predicted as Transformer Engine's NVFP4BlockScaling would run it (BF16 elsewhere); the runner "
              "emulates NVFP4 on every device, so no measurement can check this prediction yet")


def _nvfp4_path(decided, target: GPU, kept: tuple[str, ...]) -> Recipe | NoNativePath:
    """NVFP4 and NVIDIA's recipe on a GPU with FP4 tensor cores (compute capability >= 10.0), as Transformer Engine's
    NVFP4BlockScaling runs it: every Linear whose dims are multiples of 16 in NVFP4 (but those kept), BF16 elsewhere.
    The runner has no such path (it emulates): the prediction says so (`note`)."""
    if target.compute_capability < (10, 0):
        return NoNativePath(target.name, f"NVFP4 GEMMs need compute capability >= 10.0 (this GPU: "
                                         f"{'.'.join(map(str, target.compute_capability))}); {decided.why}")
    c = decided.config
    return Recipe(decided.setting, "nvfp4", "bf16", "fp32", "nvfp4", casts="nvfp4", autocast=True, kept=kept,
                  rht=c.rht, weight_tiles=c.weight_blocks == "16x16", note=NVFP4_NOTE)


def _converted(recipe: Recipe, trace: StepTrace, module: str) -> bool:
    """Whether the recipe runs this Linear's GEMMs in its format (torchao's filters, bench/numerics/native.py;
    Transformer Engine's for NVFP4: dims multiples of 16), unless format.keep_high_precision keeps it out."""
    if module not in trace.linears or trace.module_types.get(module) != "Linear" or module in recipe.kept:
        return False
    if recipe.converts == "all":
        return True
    _, k, n = trace.linears[module]
    block = MX_BLOCK if recipe.converts == "mx" else 16
    return k % block == 0 and n % block == 0


@dataclass(frozen=True)
class Prediction:
    """Predicted seconds of one step, by part; `step_s` their sum."""

    gemm: float
    attention: float
    memory: float
    optimizer: float
    casts: float
    launches: float  # host time: dispatches and launches (eager), the compiled graph's launches (compiled)
    kernels: int

    @property
    def step_s(self) -> float:
        return self.gemm + self.attention + self.memory + self.optimizer + self.casts + self.launches

    def as_dict(self) -> dict:
        return {"step_s": self.step_s, "gemm_s": self.gemm, "attention_s": self.attention,
                "memory_s": self.memory, "optimizer_s": self.optimizer, "casts_s": self.casts,
                "launches_s": self.launches, "kernels": self.kernels}


class _Costs:
    """The time of one op, kernel or byte count on one GPU under one recipe."""

    def __init__(self, recipe: Recipe, target: GPU, constants: Constants):
        self.recipe, self.gpu, self.c = recipe, target, constants

    def rate(self, element: str, kernel: GemmKernel | None = None) -> float:
        if missing_rates(self.gpu, [element]):
            raise ConfigError(f"{self.gpu.name}'s profile has no {RATE[element]} rate for {self.recipe.setting}")
        return rate(self.gpu, element, {"fp8_no_fast_accum": self.c.fp8_no_fast_accum,
                                        "fp8_rowwise": self.c.fp8_rowwise}, kernel, self.c.gemm_efficiency)

    def bandwidth(self) -> float:
        return self.gpu.tb_s * 1e12 * self.c.memory_efficiency

    def memory(self, moved: float) -> float:
        return moved / self.bandwidth()

    def gemm(self, op, kernel: GemmKernel, moved: float) -> float:
        """A matrix product by its shape (bench/speed/gemm.py); a convolution (no shape traced) at the large-GEMM
        rate, or its bytes, whichever is longer."""
        if op.gemm is None:
            return max(op.flops / self.rate(kernel.element, kernel), self.memory(moved), self.c.kernel_floor_s)
        return gemm_time(*op.gemm, kernel, self.gpu, flops_per_s=self.rate(kernel.element, kernel),
                         bytes_per_s=self.bandwidth(), operand_bytes=ELEMENT_BYTES[kernel.element],
                         output_bytes=ELEMENT_BYTES[self.recipe.elsewhere], latency_s=self.c.gemm_latency_s).seconds

    def attention(self, flops: float, moved: float) -> float:
        """A fused attention kernel at the profile's attention efficiency of the 16-bit peak (FP32: CUDA cores)."""
        key = RATE[self.recipe.elsewhere]
        flops_per_s = self.rate("fp32") if key in ("fp32", "tf32") else \
            self.gpu.tflops[key] * 1e12 * self.gpu.attention_efficiency
        return max(flops / flops_per_s, self.memory(moved), self.c.kernel_floor_s)

    def streaming(self, moved: float) -> float:
        return max(self.memory(moved), self.c.kernel_floor_s)


def gemm_kernel(recipe: Recipe, trace: StepTrace, op) -> GemmKernel:
    """The kernel a GEMM op runs under `recipe`: a converted Linear's in the recipe's format (torchao's FP8 recipes
    accumulate fast in the forward GEMM only, its row-wise ones there with the row-scaled kernel; backward, cuBLAS's
    tensorwise kernel without fast accumulation, torchao applying the row scales after it; rowwise_with_gw_hp's
    weight gradient stays high precision), any other GEMM in the type outside the format."""
    converted = op.module_type == "Linear" and _converted(recipe, trace, op.module)
    if not converted or (recipe.casts == "rowwise_with_gw_hp" and op.role == "grad_weight"):
        return GemmKernel(recipe.elsewhere)
    if recipe.linear != "fp8":
        return GemmKernel(recipe.linear, "block")
    scales = "row" if recipe.casts.startswith("rowwise") else "tensor"  # torchao's row-wise recipes, or tensorwise
    return GemmKernel("fp8", scales, fast_accum=op.role == "output")


def _cast_traffic(recipe: Recipe, trace: StepTrace, fused: bool) -> list[float]:
    """Bytes of each kernel an FP8 or MX recipe adds to the step, Linear by Linear (`_linear_casts`)."""
    if recipe.casts is None and not recipe.autocast:
        return []
    return [moved for name in trace.linears for moved in _linear_casts(recipe, trace, name, fused)]


def _linear_casts(recipe: Recipe, trace: StepTrace, name: str, fused: bool) -> list[float]:
    """Bytes of each kernel an FP8 or MX recipe adds for one converted Linear (tokens M, in K, out N), as torchao's
    roofline counts them, each kernel at least KERNEL_FLOOR_S: per operand (input M x K, weight K x N, output
    gradient M x N) an amax pass (tensorwise; a compiled step fuses the activations' and gradients' first stage into
    the op before, leaving a kernel that moves next to nothing) and casts reading the high-precision
    tensor and writing the low-precision one, once per layout the GEMMs need; rowwise writes a transposed
    high-precision copy too, and scales its backward GEMMs' outputs in a pass of their own. Autocast's own weight
    casts (FP32 to the autocast type) are added for each Linear it casts."""
    elsewhere, low, master = ELEMENT_BYTES[recipe.elsewhere], ELEMENT_BYTES[recipe.linear], ELEMENT_BYTES[recipe.stored]
    m, k, n = trace.linears[name]
    kernels = []
    converted = _converted(recipe, trace, name) and recipe.casts is not None
    if recipe.autocast and not converted:  # autocast casts the master weight once a step, and the input (made by
        kernels += [k * n * (master + elsewhere), m * k * (4 + elsewhere)]  # an FP32 op: a norm) for the GEMM
    if not converted:
        return kernels
    for role, elements in (("input", m * k), ("weight", k * n), ("grad_output", m * n)):
        high = master if role == "weight" else elsewhere  # torchao casts the master weight
        read = 0 if (fused and role != "weight") else high  # the first read of an activation or gradient
        if recipe.casts == "tensorwise":  # amax in two stages (the second reduces the first's partial maxima:
            # a kernel of its own), then one cast writing both layouts (the weight: one each)
            kernels += [read * elements, 0] + ([(high + low) * elements] * 2 if role == "weight" else
                                               [(high + 2 * low) * elements])
        elif recipe.casts == "rowwise":  # cast row-wise (writing a transposed copy), then cast the copy
            kernels += [(high + low) * elements, 2 * high * elements, (high + low) * elements] \
                if role == "weight" else [(read + low + high) * elements, (high + low) * elements]
        elif recipe.casts == "rowwise_with_gw_hp":  # the weight-gradient GEMM's operands stay high precision
            kernels += [(high + low) * elements] * 2 if role == "weight" else [(read + low) * elements]
        elif recipe.casts == "nvfp4":  # Transformer Engine: an amax pass, then the casts (see _nvfp4_casts)
            kernels += _nvfp4_casts(recipe, role, elements, read, high, low)
        else:  # mxfp8: each layout its own blocked cast
            kernels += [((high if role == "weight" else read) + low) * elements, (high + low) * elements]
    if recipe.casts == "rowwise":
        # the backward GEMMs' row scales, applied after cuBLAS's tensorwise kernel (torchao's float8_ops): the
        # weight gradient's in a pass of its own (a graph output), the input gradient's fused into its consumer
        # when compiled
        kernels += [2 * elsewhere * k * n] + ([] if fused else [2 * elsewhere * m * k])
    return kernels


def _nvfp4_casts(recipe: Recipe, role: str, elements: int, read: float, high: float, low: float) -> list[float]:
    """The bytes of each kernel NVFP4 adds for one operand, as Transformer Engine quantises it: an amax pass, then
    - the weight: 1 x 16 blocks, one cast per layout (rows for the forward GEMM, columns for the input gradient's);
      16 x 16 tiles, one cast writing both layouts (the tiles are the same either way: quantised once);
    - an activation or output gradient: one cast writing both layouts; with the RHT, the column-wise copy (the
      weight-gradient GEMM's) is transformed first, its own amax pass and its own cast reading the tensor again."""
    if role == "weight":
        return [read * elements] + ([(high + 2 * low) * elements] if recipe.weight_tiles else
                                    [(high + low) * elements] * 2)
    if recipe.rht:
        return [read * elements, (high + low) * elements, high * elements, (high + low) * elements]
    return [read * elements, (high + 2 * low) * elements]


def predict(trace: StepTrace, recipe: Recipe, target: GPU, compiled: bool,
            constants: Constants = CONSTANTS, shards: int = 1) -> Prediction:
    """The step's predicted time on `target` under `recipe`, compiled or eager (see the module docstring).

    Kernels run on the GPU while the host goes on to launch the next ones: an op takes the longer of its GPU time and
    the host's time to dispatch it, so a large GEMM hides the host's work and a step of small ops is the host's.
    The parts: each class of op's GPU time, and `launches`, the host time no GPU work hid. `shards`: GPUs the
    optimiser's state and step are sharded over (FSDP, ZeRO): each runs 1/shards of it (communication not counted)."""
    costs = _Costs(recipe, target, constants)
    elsewhere, stored = ELEMENT_BYTES[recipe.elsewhere], ELEMENT_BYTES[recipe.stored]
    host = constants.compiled_launch_s if compiled else constants.dispatch_s + (
        constants.autocast_dispatch_s if recipe.autocast else 0.0)
    fp8 = {name for name in trace.linears if recipe.casts and _converted(recipe, trace, name)}
    optimizer_bytes = _optimizer_bytes_per_element(trace, stored)
    parts = {"gemm": 0.0, "attention": 0.0, "memory": 0.0, "optimizer": 0.0, "casts": 0.0}
    state = {"step": 0.0, "kernels": 0}

    def run(part: str, gpu_s: float, host_s: float, kernels: int) -> None:
        parts[part] += gpu_s
        state["step"] += max(gpu_s, host_s)
        state["kernels"] += kernels

    for op in trace.ops:
        if op.kind == "view":  # a dispatch and no kernel: eager only (a compiled graph has none)
            state["step"] += 0.0 if compiled else host
        elif op.phase == "optimizer":
            run("optimizer", costs.streaming(optimizer_bytes * (sum(op.reads) + sum(op.writes)) / shards), host,
                op.kernels)
        elif op.kind == "gemm":
            kernel = gemm_kernel(recipe, trace, op)
            operands = sorted(op.reads, reverse=True)[:2]
            moved = ELEMENT_BYTES[kernel.element] * sum(operands) + elsewhere * (sum(op.reads) - sum(operands)
                                                                                  + sum(op.writes))
            # torchao's Float8Linear dispatches its tensor subclass in eager mode
            # (Transformer Engine's NVFP4: unmodelled)
            subclass = constants.float8_linear_s / 3 if (op.module in fp8 and not compiled
                                                         and recipe.casts != "nvfp4") else 0.0
            run("gemm", costs.gemm(op, kernel, moved), host + subclass, op.kernels)
        elif op.kind == "attention":
            moved = elsewhere * (sum(op.reads) + sum(op.writes))
            run("attention", costs.attention(op.flops, moved), host, op.kernels)
        elif not compiled:
            run("memory", costs.streaming(elsewhere * (sum(op.reads) + sum(op.writes))), host, op.kernels)
    if compiled:
        for moved in _fused_groups(trace):
            run("memory", costs.streaming(elsewhere * moved), host, 1)
    for moved in _cast_traffic(recipe, trace, fused=compiled):
        run("casts", costs.streaming(moved), host, 1)
    launches = state["step"] - sum(parts.values())
    return Prediction(parts["gemm"], parts["attention"], parts["memory"], parts["optimizer"], parts["casts"],
                      launches, state["kernels"])


def gemm_breakdown(trace: StepTrace, recipe: Recipe, reference: Recipe, target: GPU,
                   constants: Constants = CONSTANTS) -> list[dict]:
    """"Does the format pay for my layers?": per Linear of the step, its three GEMMs (forward, input gradient,
    weight gradient) and the casts the format adds, compiled, each priced on the GPU under the cell's `recipe` and
    under `reference` (BF16): the shape (M x K x N of the GEMM as it runs), the kernel, and both times."""
    ours, theirs = _Costs(recipe, target, constants), _Costs(reference, target, constants)
    rows = []
    for name in trace.linears:
        for op in (o for o in trace.ops if o.kind == "gemm" and o.module == name and o.role and o.gemm):
            kernel = gemm_kernel(recipe, trace, op)
            rows.append({"linear": name, "part": op.role, "shape": "×".join(map(str, op.gemm[1:])),
                         "kernel": kernel.element + ("" if kernel.fast_accum else " (no fast accumulation)"),
                         "reference_s": theirs.gemm(op, gemm_kernel(reference, trace, op), 0.0),
                         "format_s": ours.gemm(op, kernel, 0.0)})
        casts = [_linear_casts(r, trace, name, fused=True) if r.casts or r.autocast else []
                 for r in (recipe, reference)]
        rows.append({"linear": name, "part": "casts", "shape": "", "kernel": f"{len(casts[0])} kernels",
                     "format_s": sum(ours.streaming(moved) for moved in casts[0]),
                     "reference_s": sum(theirs.streaming(moved) for moved in casts[1])})
    return rows


def _fused_groups(trace: StepTrace) -> list[int]:
    """Elements each fused kernel of a compiled step moves: per phase (forward, backward), each maximal run of
    memory-bound ops between two GEMM or attention ops is one kernel, reading the tensors made outside it and
    writing the ones used outside it (or by nothing: the step's outputs)."""
    ops = [o for o in trace.ops if o.kind != "view" and o.phase != "optimizer"]
    consumers: dict[int, set[int]] = {}
    sizes: dict[int, int] = {}
    for i, op in enumerate(ops):
        for t, n in zip(op.inputs, op.reads):
            consumers.setdefault(t, set()).add(i)
            sizes[t] = max(sizes.get(t, 0), n)
        for t, n in zip(op.outputs, op.writes):
            sizes[t] = max(sizes.get(t, 0), n)
    groups, current, phase = [], [], None
    for i, op in enumerate(ops):
        if op.kind != "memory" or op.phase != phase:
            if current:
                groups.append(current)
            current = [i] if op.kind == "memory" else []
            phase = op.phase
        else:
            current.append(i)
    if current:
        groups.append(current)
    moved = []
    for group in groups:
        members = set(group)
        made = {t for i in group for t in ops[i].outputs}
        reads = {t for i in group for t in ops[i].inputs if t not in made}
        writes = {t for t in made if not consumers.get(t) or consumers[t] - members}
        moved.append(sum(sizes[t] for t in reads | writes))
    return moved


@functools.cache
def fingerprint() -> str:
    """Which speed model made a prediction: a hash of its code (bench/speed/*.py), its constants and the shipped
    profiles. A record's own predictions are reused only while this is unchanged (bench/reporting/recorded_predictions).
    Read once a process: the tables ask it for every record."""
    from bench.speed.profiles import GPUS_DIR

    files = sorted(Path(__file__).parent.glob("*.py")) + [CONSTANTS_FILE] + sorted(GPUS_DIR.glob("*.yaml"))
    return hashlib.sha256(b"".join(f.read_bytes() for f in files)).hexdigest()[:16]


def predictions(cfg, trace: StepTrace, gpus: list[GPU] | None = None,
                constants: Constants = CONSTANTS) -> dict[str, dict]:
    """A record's `predicted`: per GPU (default: every shipped profile), the compiled and eager step time and its
    parts, or why the runner would have no native path there (the record's `predicted_by` names the model:
    `fingerprint`)."""
    out = {}
    for target in gpus or shipped_gpus().values():
        recipe = recipe_on(cfg, trace, target)
        if isinstance(recipe, NoNativePath):
            out[target.name] = {"no_native_path": recipe.why}
            continue
        out[target.name] = {mode: predict(trace, recipe, target, mode == "compiled", constants).as_dict()
                            for mode in ("compiled", "eager")} | ({"note": recipe.note} if recipe.note else {})
    return out


def storage_recipe(cfg) -> Recipe:
    """For memory only: a setting that no GPU runs natively, its tensors at the widths its format stores them in, as
    the record's memory model counts an emulated run (bench/numerics/memory.py): a GEMM-only format's operands in the
    format (block scales included) and every other tensor as format.elsewhere says; another format's tensors in it
    (mixed: FP32 parameters, gradients and state; true: everything). No step time is predicted from it."""
    from bench.numerics.specs import format_spec

    spec, mode = format_spec(cfg.format.name), cfg.format.get("mode", "mixed")
    setting, element = spec.setting(mode), spec.recipe.inputs
    if spec.gemm_only:
        linear = {"mx": f"mx{element.split('_')[0]}", "nvfp4": "nvfp4"}.get(spec.block, element)  # mx + fp6: mxfp6
        elsewhere = "bf16" if cfg.format.get("elsewhere") == "bf16" else "fp32"
        return Recipe(setting, linear, elsewhere, "fp32", "all", casts="storage", autocast=elsewhere == "bf16")
    return Recipe(setting, element, element, element if mode == "true" else "fp32", "all", autocast=mode != "true")


def _element_bytes(name: str) -> float:
    """Bytes per element of a recipe's type: ELEMENT_BYTES', or a registered element format's storage (a user's own,
    in a storage-only recipe)."""
    from bench.numerics.formats import FORMATS

    return ELEMENT_BYTES[name] if name in ELEMENT_BYTES else FORMATS[name].storage_bytes


def _stored_bytes(trace: StepTrace, stored: float) -> tuple[float, float, float]:
    """Bytes per element of what the cell stores beyond its traced (FP32) step: (a weight or its gradient: two under
    BF16 master weights; a moment: STATE_BYTES of its state format, the scales included; the Kahan compensation per
    parameter: two, or none)."""
    from bench.tasks.optimizer import STATE_BYTES

    weight = ELEMENT_BYTES["bf16"] if trace.master_weights != "fp32" else stored
    moment = stored if trace.state_format == "fp32" else STATE_BYTES[trace.state_format]
    return weight, moment, ELEMENT_BYTES["bf16"] if trace.master_weights == "bf16_kahan" else 0.0


def _optimizer_bytes_per_element(trace: StepTrace, stored: float) -> float:
    """The optimiser step's bytes per element it reads or writes, as the cell stores its moments and weights: the
    traced step (FP32) reads each weight and gradient and writes each weight (3 per parameter) and reads and writes
    its moments (the rest) at `_stored_bytes`, and a Kahan compensation adds a read and a write. The quantisation's
    arithmetic and torchao's one launch per tensor are not priced (streaming bounds them on a GPU)."""
    if trace.state_format == "fp32" and trace.master_weights == "fp32":
        return stored
    traffic = sum(sum(o.reads) + sum(o.writes) for o in trace.ops if o.phase == "optimizer" and o.kind != "view")
    weights, moments = 3 * trace.parameters, max(0, traffic - 3 * trace.parameters)
    weight, moment, compensation = _stored_bytes(trace, stored)
    moved = weights * weight + moments * moment + 2 * trace.parameters * compensation
    return moved / traffic if traffic else stored


FILLS = ("zeros", "ones", "empty", "full")  # aten ops that make a tensor without reading one: an optimiser's new state


# aten ops (as the trace records them, after decomposition) that CUDA autocast runs in FP32 whatever their inputs'
# type (torch.amp's "CUDA ops that can autocast to float32": layer_norm, softmax, log_softmax, cross_entropy's
# parts, the losses, reductions and transcendental functions); a GEMM or attention gives the lower-precision type,
# and any other op the wider of its floating-point inputs' (type promotion; BatchNorm its input's)
AUTOCAST_FP32_OPS = frozenset({
    "native_layer_norm", "native_group_norm", "_softmax", "_log_softmax", "nll_loss_forward", "nll_loss2d_forward",
    "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "binary_cross_entropy_with_logits", "kl_div", "exp",
    "expm1", "log", "log1p", "log2", "log10", "pow", "rsqrt", "reciprocal", "sum", "prod", "cumsum", "cumprod",
    "norm", "linalg_vector_norm", "logsumexp", "softplus", "acos", "asin", "cosh", "sinh", "tan", "erfinv", "cdist",
    "dist", "renorm"})
KEEPS_INPUT_TYPE = ("native_batch_norm", "_native_batch_norm_legit", "empty_like", "zeros_like", "ones_like",
                    "full_like", "rand_like", "randn_like", "new_")  # BatchNorm takes mixed types; a *_like copies


def _autocast_saves(trace: StepTrace, lower: float) -> Callable[[TracedOp, int, int], tuple[float, tuple]]:
    """What a backward op's read of a tensor holds under CUDA autocast: its bytes per element, and which copy it is
    (one saved tensor per copy). The trace is of FP32 values; under autocast a GEMM's or attention's output is
    `lower` (2 bytes) where LayerNorm's, softmax's or a sum with an FP32 tensor (the residual stream beside FP32
    embeddings) stays FP32: followed through the forward pass op by op. A GEMM or attention saves its operands as it
    took them, in `lower`: an FP32 one as autocast's cast, made anew for each GEMM (autocast caches the weights'
    casts alone); an FP32 op (LayerNorm) a lower-precision input as its FP32 cast; any other op the tensor in its own
    type. Attention's log-sum-exp is FP32."""
    fp32 = set(trace.held)  # a mixed recipe's parameters (and float buffers) are FP32
    cast_up: set[int] = set()  # lower-precision tensors an FP32 op took (and saved) as an FP32 copy
    attention_extras: set[int] = set()
    for op in trace.ops:
        if op.phase != "forward" or op.kind == "view":
            continue
        name = op.op.split(".")[1]
        floats = [t for t, size in zip(op.inputs, op.sizes) if size == 4]
        if op.kind in ("gemm", "attention"):
            wide = False
            attention_extras.update(op.outputs[1:] if op.kind == "attention" else ())
        elif name in AUTOCAST_FP32_OPS:
            wide = True
            cast_up.update(t for t in floats if t not in fp32)
        elif name.startswith(KEEPS_INPUT_TYPE) or name.endswith("_"):  # an in-place op keeps its tensor's type
            wide = bool(floats) and floats[0] in fp32
        else:
            wide = not floats or any(t in fp32 for t in floats)  # a fill (no input) makes FP32
        fp32.update(t for t, size in zip(op.outputs, op.sizes[len(op.inputs):]) if wide and size == 4)
    fp32.update(attention_extras)

    def held_as(op: TracedOp, t: int, size: int) -> tuple[float, tuple]:
        if size != 4:  # integers and masks, as they are
            return size, (t,)
        if op.kind == "gemm" or op.kind == "attention" and t not in attention_extras:
            return lower, (t, "cast", op.module) if t in fp32 else (t,)
        if t in fp32:
            return 4.0, (t,)
        return (4.0, (t, "cast")) if t in cast_up else (lower, (t,))

    return held_as


def step_memory(trace: StepTrace, recipe: Recipe, shards: int = 1) -> dict:
    """The bytes one training step holds, as the trace accounts for them under `recipe` (bench.predict's memory,
    where no step is run: bench/numerics/memory.py counts a real first step for a record): parameters, their
    gradients and the optimiser's state at the stored type (the state: what the optimiser step reads besides the
    parameters and gradients, each tensor once however often it is read), and the activations saved for the
    backward pass (every tensor the forward pass makes and the backward pass reads) at the type outside the GEMMs, a
    converted GEMM's own operands in its format; the optimiser's moments and the parameters as the cell stores them
    (`StepTrace.state_format`, `master_weights`): a moment in the state format where torchao keeps it so, judged on
    its shard of 1/`shards` (FSDP2's; `held_in_state_format`), else as the parameters are stored."""
    from bench.tasks.optimizer import STATE_CODE_BOOK_BYTES, held_in_state_format

    parameters = trace.parameters
    stored, elsewhere = _element_bytes(recipe.stored), _element_bytes(recipe.elsewhere)
    made_in_backward = {t for op in trace.ops if op.phase == "backward" and op.kind != "view" for t in op.outputs}
    # the optimiser's state: what its step reads besides the parameters and gradients, each tensor once, but the
    # temporaries it computes (a state tensor is made before the step, or by a fill inside the first one)
    stepping = [op for op in trace.ops if op.phase == "optimizer" and op.kind != "view"]
    computed = {t for op in stepping if not op.op.split(".")[1].startswith(FILLS) for t in op.outputs}
    state: dict[int, int] = {}
    for op in stepping:
        for t, n in zip(op.inputs, op.reads):
            if t not in trace.held and t not in made_in_backward and t not in computed:
                state[t] = max(state.get(t, 0), n)
    held_as = _autocast_saves(trace, elsewhere) if recipe.autocast else \
        lambda op, t, size: (elsewhere if size == 4 else size, (t,))
    masks = {t for op in trace.ops if op.phase == "forward" and op.op.startswith("aten.bernoulli") for t in op.outputs}
    saved: dict[tuple, float] = {}
    for op in trace.ops:
        if op.phase != "backward":
            continue
        for t, n, size in zip(op.inputs, op.reads, op.sizes):
            if t not in trace.held and t not in made_in_backward:  # made before the backward pass: saved for it
                # a dropout mask, drawn here in the model's type, a GPU's dropout kernel keeps as booleans
                width, copy = (1.0, (t,)) if t in masks else held_as(op, t, size)
                saved[copy] = max(saved.get(copy, 0.0), n * width)
    # autocast's 16-bit copy of each GEMM's weight (an FP8 recipe's FP8 one) is saved for the backward pass too
    copies = sum(n * (_element_bytes(recipe.linear) if recipe.casts and _converted(recipe, trace, name) else elsewhere)
                 for name, n in trace.gemm_weights.items()) if recipe.autocast or recipe.casts else 0
    weight, moment, compensation = _stored_bytes(trace, stored)
    code_book = STATE_CODE_BOOK_BYTES.get(trace.state_format, 0)
    moments = sum(n * moment + code_book if held_in_state_format(n // shards, trace.state_format) else n * stored
                  for n in state.values()) if trace.state_format != "fp32" else sum(state.values()) * moment
    breakdown = {"parameters": parameters * weight, "gradients": parameters * weight,
                 "optimizer_state": moments + parameters * compensation,
                 "weight_copies": copies, "activations": sum(saved.values())}
    return {k: int(v) for k, v in breakdown.items()} | {"total": int(sum(breakdown.values()))}


# DDP's default gradient bucket cap (torch.nn.parallel.DistributedDataParallel's bucket_cap_mb): a compression hook
# holds one bucket's 16-bit copy at a time
DDP_BUCKET_BYTES = 25 * 2**20
DDP_FIRST_BUCKET_BYTES = 2**20  # its first bucket's (torch.distributed._DEFAULT_FIRST_BUCKET_BYTES)


def ddp_last_bucket(gradient_bytes: float) -> float:
    """The bytes of DDP's last gradient bucket: buckets fill in reverse order of the parameters, the first of
    DDP_FIRST_BUCKET_BYTES, the rest of DDP_BUCKET_BYTES, and the last (the first layers', ready when the backward
    pass ends) holds what is left."""
    rest = gradient_bytes - DDP_FIRST_BUCKET_BYTES
    if rest <= 0:
        return gradient_bytes
    return rest % DDP_BUCKET_BYTES or DDP_BUCKET_BYTES


def all_reduced_in(parallel) -> str:
    """The type DDP all-reduces its gradient buckets in: FP32, or `gradient_compression`'s 16-bit type."""
    return "fp32" if parallel.gradient_compression == "none" else parallel.gradient_compression


def state_shards(parallel) -> int:
    """The ranks a cell's parameters, gradients and optimiser state are split over: FSDP2's world size, else 1."""
    return parallel.world_size if parallel is not None and parallel.name == "fsdp2" else 1


def fp8_gathered(trace: StepTrace, recipe: Recipe, wanted: bool) -> frozenset:
    """The Linear weights a cell all-gathers in FP8 where it `wanted` to (`parallel.fp8_all_gather`: torchao's FP8
    all-gather of the weights its recipe converts); none otherwise."""
    if not wanted:
        return frozenset()
    return frozenset(n for n in trace.linears if recipe.casts and _converted(recipe, trace, n))


def rank_memory(memory: dict, trace: StepTrace, parallel, blocks: str | None,
                fp8_gather: frozenset = frozenset()) -> dict:
    """One rank's step under the cell's data-parallel wrapper (`parallel`: the config section; bench/running/
    parallel.py), from the breakdown (`step_memory`) of a step of the rank's share of the batch (`trace`):
    - its activations and weight copies are the share's, under FSDP2 with a 16-bit param_dtype (FSDP2 casts the
      inputs and computes in it) at that type's width;
    - ddp: every rank holds the whole model, its gradients and the optimiser's state, and DDP's gradient buckets (a
      copy of every gradient; with a compression hook, one bucket's 16-bit copy besides);
    - fsdp2: every rank holds 1/world_size of the parameters, gradients and optimiser state (its shards), and in
      `communication_buffers` the parameters it all-gathers in param_dtype, those in `fp8_gather` at a byte (the
      largest block's twice, the one computing and the one prefetched, and those outside the blocks, which the root
      gathers for the whole step) and one block's unsharded gradients in reduce_dtype before they are
      reduce-scattered.
    A block is a module under `blocks` (the model's TaskSpec.blocks); its parameters are counted from its GEMM
    weights (a block's biases and norms are left with the root's)."""
    world = parallel.world_size  # the parameters' holders: FSDP2 shards them
    largest = max(_block_weights(trace, blocks).values(), default=0)
    block_bytes, root_bytes = _gathered_bytes(trace, blocks, parallel.param_dtype, fp8_gather)
    width = _element_bytes(parallel.param_dtype) / ELEMENT_BYTES["fp32"] if parallel.name == "fsdp2" else 1.0
    out = {"activations": memory["activations"] * width, "weight_copies": memory["weight_copies"]}
    if parallel.name == "ddp":
        gradients = memory["gradients"]
        hook = min(DDP_BUCKET_BYTES, gradients) / 2 if parallel.gradient_compression != "none" else 0
        out |= {k: memory[k] for k in ("parameters", "gradients", "optimizer_state")}
        out["communication_buffers"] = gradients + hook
    else:  # fsdp2
        out |= {k: memory[k] / world for k in ("parameters", "gradients", "optimizer_state")}
        out["communication_buffers"] = (2 * max(block_bytes.values(), default=0) + root_bytes
                                        + largest * _element_bytes(parallel.reduce_dtype))
    return {k: int(v) for k, v in out.items()} | {"total": int(sum(out.values()))}


def _gathered_bytes(trace: StepTrace, blocks: str | None, param_dtype: str,
                    fp8_gather: frozenset) -> tuple[dict[str, float], float]:
    """What one FSDP2 all-gather of each block brings, by block name, and of the root (the parameters outside the
    blocks, a block's biases and norms among them: `_block_weights`), in bytes: every parameter in `param_dtype`, the
    GEMM weights in `fp8_gather` at a byte."""
    width = _element_bytes(param_dtype)
    per_block: dict[str, float] = {}
    root = (trace.parameters - sum(trace.gemm_weights.values())) * width  # biases, norms, embeddings
    for name, elements in trace.gemm_weights.items():
        gathered = elements * (1 if name in fp8_gather else width)
        if (block := block_of(name, blocks)) is None:
            root += gathered
        else:
            per_block[block] = per_block.get(block, 0) + gathered
    return per_block, root


def _block_weights(trace: StepTrace, blocks: str | None) -> dict[str, int]:
    """Each repeated block's GEMM weight elements (`blocks`: the model's TaskSpec.blocks), by block name: what FSDP2
    gathers per block (bench/running/parallel.py wraps each block)."""
    per_block: dict[str, int] = {}
    for name, elements in trace.gemm_weights.items():
        if (block := block_of(name, blocks)) is not None:
            per_block[block] = per_block.get(block, 0) + elements
    return per_block


NODE_GPUS = 8  # GPUs one NVLink domain joins (a DGX or HGX node): a job of more crosses the network


@dataclass(frozen=True)
class Collectives:
    """A distributed step's collectives on one rank: the bytes each kind receives (what a ring moves per rank), their
    seconds at the interconnect's bus bandwidth, and the part of them the step's compute does not hide."""

    received: dict
    seconds: float
    exposed: float
    over: str  # nvlink | network


def collectives(trace: StepTrace, parallel, target: GPU, compute_s: float, blocks: str | None,
                fp8_gather: frozenset = frozenset()) -> Collectives | None:
    """One rank's collectives in a step of `parallel.world_size` ranks (trace: a rank's step), as ring algorithms move
    them (nccl-tests' bus bandwidth: a rank receives (n-1)/n of an all-gather's or reduce-scatter's whole, twice that
    of an all-reduce's), over NVLink within a node of NODE_GPUS and the network beyond:
    - ddp: every gradient all-reduced in fp32 (or `gradient_compression`'s type), overlapped with the backward pass
      bucket by bucket: the last bucket (`ddp_last_bucket`), ready only when the backward pass ends, is exposed,
      and whatever else the step's compute cannot cover;
    - fsdp2: the parameters all-gathered in param_dtype, a block's twice (forward, and backward after resharding),
      the root's once (FSDP2 keeps the root module's gathered from its forward through its backward; a block's
      biases and norms are counted with the root's), the Linear weights in `fp8_gather` (torchao's FP8 all-gather)
      at one byte; the gradients reduce-scattered in reduce_dtype.
      FSDP2 prefetches the next block's gather under the current block's compute, so the first block's gather (in
      the same types) is exposed, and whatever the compute cannot cover.
    Each collective is priced by its bytes at the bandwidth alone, no per-call latency (a small model's many small
    collectives are priced low), and no measured step has validated these figures (docs/distributed.md).
    None on one rank, or on a profile without the interconnect's figures."""
    n = parallel.world_size
    bandwidth = target.nvlink_gb_s if n <= NODE_GPUS else target.network_gb_s
    if n == 1 or bandwidth is None:
        return None
    share = (n - 1) / n
    if parallel.name == "ddp":
        gradient_bytes = trace.parameters * _element_bytes(all_reduced_in(parallel))
        received, first = {"all_reduce": 2 * share * gradient_bytes}, 2 * share * ddp_last_bucket(gradient_bytes)
    else:
        per_block, root = _gathered_bytes(trace, blocks, parallel.param_dtype, fp8_gather)
        received = {"all_gather": share * (2 * sum(per_block.values()) + root),  # a block's twice, the root's once
                    "reduce_scatter": share * trace.parameters * _element_bytes(parallel.reduce_dtype)}
        first = share * max(per_block.values(), default=0)  # the first block's gather, FP8 weights at a byte
    seconds = sum(received.values()) / (bandwidth * 1e9)
    exposed = max(first / (bandwidth * 1e9), seconds - compute_s)
    return Collectives(received, seconds, exposed, "nvlink" if n <= NODE_GPUS else "network")


@dataclass(frozen=True)
class RankStep:
    """One rank's predicted step (`step`) and its collectives (None where they are not priced); `seconds`: the step
    and the part of the collectives its compute does not hide."""

    step: Prediction
    collectives: Collectives | None

    @property
    def seconds(self) -> float:
        return self.step.step_s + (self.collectives.exposed if self.collectives else 0.0)


def rank_step(trace: StepTrace, recipe: Recipe, target: GPU, compiled: bool, parallel, blocks: str | None,
              constants: Constants = CONSTANTS, fp8_gather: bool = False) -> RankStep:
    """One rank's step of a distributed cell (`trace`: its share of the batch), FSDP2's optimiser sharded over the
    ranks, and its collectives (`collectives`). `fp8_gather`: the converted Linear weights all-gathered in FP8
    (torchao's FP8 all-gather)."""
    step = predict(trace, recipe, target, compiled, constants, shards=state_shards(parallel))
    gathered = fp8_gathered(trace, recipe, fp8_gather)
    return RankStep(step, collectives(trace, parallel, target, step.gemm + step.attention + step.memory, blocks,
                                      gathered))
