"""Precision policy carried out: a cell's plan (plan.py: native or emulated, and why) applied to its model. The
format itself is declared in specs.py, the scaling method in scaling_methods.py; the emulated operands this policy
places live in emulation.py, the native (torchao) configuration in native.py.

Emulation rounds exactly where a native kernel would, at every nn.Linear and nn.Conv2d:
- tf32: activations and weights entering the op, and the gradient entering its backward, keep
  10 mantissa bits (tensor cores read TF32); outputs stay FP32.
- fp16 / bf16 (autocast-style "mixed"): the same, and the op's output, its bias and the gradients
  it returns are rounded too, because a 16-bit kernel writes 16-bit results. FP32 master weights.
- fp8: activations and weights enter as E4M3, gradients enter the backward as E5M2, outputs and
  returned gradients stay in higher precision (FP8 GEMMs accumulate and write in it): BF16 under
  format.elsewhere=bf16 (the default since 0.2.0, as torchao, Transformer Engine and DeepSeek-V3 train), else FP32.
  `rounding=stochastic` rounds those gradients stochastically (seeded; the same overflow policy).
- mxfp8 / mxfp6 / mxfp4 / nvfp4 (block formats, bench/numerics/blocks.py): each Linear's GEMMs take block-scaled
  operands, blocked along the dimension each GEMM reduces, as torchao's MX linear does: forward, activations and
  weights along in_features; grad_input, the output gradient and the weight along out_features; grad_weight, the
  output gradient and the activations along the tokens. Forward operands use the recipe's `inputs` element
  format, gradient operands its `grads` (MX training: E4M3 forward, E5M2 gradients for MXFP8). The block scales
  follow `scale_mode`; `rounding=stochastic` rounds the gradient operands stochastically (NVIDIA's NVFP4
  recipe). x and W are kept in FP32 for the backward pass and re-blocked there. Conv2d stays in FP32 (torchao
  converts Linear layers only) and is listed in the record.
- fp8 with scaling=rowwise or block: the same GEMM-operand layout, E4M3 for every operand, one power-of-two scale
  per row (torchao's rowwise recipe, bit-exact against it) or per 1 x 128 tile, 128 x 128 for weights (Transformer
  Engine's Float8BlockScaling). rowwise_with_gw_hp: torchao's recipe of that name, rowwise with the weight
  tensorwise in the input-gradient GEMM and the weight-gradient GEMM in high precision (bit-exact against it).
- "true" mode (fp16/bf16 whole-model cast) additionally keeps parameters, their gradients and the
  optimiser state rounded to the format after every step; elementwise ops between matmuls still
  compute in FP32 (documented in docs/formats.md: an approximation of 16-true, not bit-faithful there).
Ops other than Linear/Conv2d (norms, softmax, embeddings, loss) compute in FP32, or, for FP8 and the block formats
with format.elsewhere=bf16, under BF16 autocast (which keeps norms, softmax and the loss in FP32).
"""

from __future__ import annotations

import contextlib
from dataclasses import replace
from typing import Callable

import torch
from torch import nn

from bench.numerics.autocast import EmulatedGemms
from bench.numerics.blocks import RHT_SIZE, rht_signs
from bench.numerics.carried_attention import carried_attention_ops
from bench.numerics.carried_attention import route as route_carried_attention
from bench.numerics.chain import EmulatedChain, chained
from bench.numerics.emulation import (
    EMULATED_MODULES,
    BlockOperands,
    CastOp,
    EmulatedConv2d,
    EmulatedLinear,
    FP8TileOperands,
    OpCasts,
    TensorSite,
    carried_ops,
)
from bench.numerics.formats import FORMATS, quantise_value, resolve_overflow
from bench.numerics.native import (
    cast_input_as_autocast_does,
    padded_mxfp8_linear,
    torchao_converts,
    torchao_float8_config,
    torchao_mx_converts,
    torchao_mx_kernel,
)
from bench.numerics.plan import (  # noqa: F401 - PrecisionConfig and PrecisionError lived here before 0.3.0
    BACKENDS,
    PrecisionConfig,
    PrecisionError,
    PrecisionPlan,
    for_model,
    fp32_flags,
    kept_layers,
    plan,
)
from bench.numerics.scaling_methods import ScalingMethod, build, scaling_class
from bench.numerics.swap import restore, swap_modules, swapped, with_state_of
from bench.numerics.telemetry import QuantTelemetry
from bench.numerics.tensor_cores import Accumulation

# train.eval_precision: every evaluation (per-epoch validation and the final test) in the precision the cell trained
# in, native or emulated (its autocast, its rounding sites, its torchao layers), or in FP32 (none of them)
EVAL_PRECISIONS = ("trained", "fp32")


@contextlib.contextmanager
def full_precision(model: nn.Module, widen: bool = False):
    """`model` computing in FP32 for the while: emulated rounding sites and block operands off, torchao's converted
    Linears back to nn.Linear (their weights are the high-precision ones); `widen`: a whole-model 16-bit cast
    (native true mode) widened to FP32 and narrowed back afterwards, exactly (every 16-bit value is an FP32 one)."""
    sites = [(m, m.__dict__.get("casts"), m.__dict__.get("operands")) for m in model.modules() if isinstance(m, CastOp)]
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), None) if widen else None
    converted = swap_modules(model, lambda _, module: with_state_of(nn.Linear, module)
                             if type(module).__name__ in TORCHAO_LINEARS else None)
    for module, _, _ in sites:
        module.casts = module.operands = None
    if dtype is not None:
        model.float()
    try:
        yield
    finally:
        if dtype is not None:
            model.to(dtype)
        restore(model, converted)
        for module, casts, operands in sites:
            for name, value in (("casts", casts), ("operands", operands)):
                if value is None:
                    module.__dict__.pop(name, None)  # back to the class's None
                else:
                    setattr(module, name, value)


# the Linear classes torchao's float8 and MXFP8 training convert to (Precision._convert_with_torchao)
TORCHAO_LINEARS = ("Float8Linear", "PaddedMXFP8Linear")


def _autocast_layers(model: nn.Module) -> list[str]:
    """The Linear and convolution layers of a prepared model that compute under autocast: neither an emulated op's
    rounding sites nor block operands (which compute in FP32 with autocast off) nor torchao's conversion (its own
    FP8 or MXFP8 GEMMs) took them."""
    return [name for name, m in model.named_modules()
            if isinstance(m, (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)) and type(m).__name__ not in TORCHAO_LINEARS
            and getattr(m, "casts", None) is None and getattr(m, "operands", None) is None]


def _tensor_class(x: torch.Tensor) -> str:
    """A GEMM operand's tensor class: a parameter is a weight, anything else an activation."""
    return "weights" if isinstance(x, nn.Parameter) else "activations"


class Precision:
    """A cell's precision carried out: its plan (bench/numerics/plan.py) applied to a model (`prepare`), and what a
    training step and an evaluation need of it (autocast, input casts, true mode's rounding, telemetry)."""

    @classmethod
    def of(cls, fmt: str, device: torch.device, scaling: str | ScalingMethod = "none", **choices) -> "Precision":
        """The precision of format `fmt` on `device`, its other `format.*` choices as keywords (each defaulting as
        conf/format/ does not: FORMAT_DEFAULTS), with a scaling method by name (its knobs' defaults) or as an
        instance: what a tool or a test builds without composing a config."""
        method = scaling if isinstance(scaling, ScalingMethod) else scaling_class(scaling)(name=scaling)
        config = PrecisionConfig(name=fmt, scaling=method.name, **choices)
        return cls.from_plan(plan(config, method, device), method, device)

    @classmethod
    def from_plan(cls, decided: PrecisionPlan, method: ScalingMethod, device: torch.device) -> "Precision":
        precision = cls.__new__(cls)
        precision._start(decided, method, device)
        return precision

    @classmethod
    def from_config(cls, cfg, device: torch.device) -> "Precision":
        """The precision a composed cell config asks for, on `device`: its `format` node, and its scaling method."""
        method = build(cfg.scaling)
        precision = cls.from_plan(plan(PrecisionConfig.from_config(cfg), method, device), method, device)
        if (cfg.get("parallel") or {}).get("fp8_all_gather"):
            precision.gather_in_fp8()
        return precision

    def gather_in_fp8(self) -> None:
        """FSDP2 all-gathers the converted Linear weights in FP8 (`parallel.fp8_all_gather`: torchao's
        `enable_fsdp_float8_all_gather`), each weight cast once on its shard with the whole weight's scale, which
        `after_step` precomputes for every weight at once (torchao's `precompute_float8_dynamic_scale_for_fsdp`).
        torchao gathers in FP8 for its tensorwise recipe alone, and only where it converts the model: natively."""
        if self.plan.torchao_recipe != "tensorwise":
            how = f"it runs {self.plan.backend} here ({self.plan.why})" if not self.native else \
                f"its recipe is {self.plan.torchao_recipe or 'not torchao float8'}"
            raise PrecisionError(f"parallel.fp8_all_gather gathers torchao's float8 weights: it needs format=fp8 "
                                 f"scaling=per_tensor running natively through torchao's tensorwise recipe, and {how}; "
                                 "valid here: parallel.fp8_all_gather=false")
        self.fp8_all_gather = True

    def _start(self, decided: PrecisionPlan, method: ScalingMethod, device: torch.device) -> None:
        self.plan, self.method, self.device = decided, method, device
        self.telemetry = QuantTelemetry()
        self._site_scales: list = []  # every scaler its sites made: paused while evaluating
        self.conversion: dict | None = None  # what `prepare` did to the model (the record's fp8_modules, kept layers)
        # the model's Linear and Conv layers autocast computes (none of the format's GEMMs); None: no model prepared
        self.autocast_layers: list[str] | None = None
        self.carried: list[str] = []  # the emulated ops handing BF16's values on in FP32 tensors (_carry_between_ops)
        self.carried_to_attention: list[str] = []  # those handing them to the attention (_carry_between_ops)
        self.chained: list[str] = []  # the emulated ops run with the modules between them as one node (chain.py)
        self.fp8_all_gather = False  # FSDP2 gathers torchao's float8 weights in FP8 (gather_in_fp8)
        c = decided.config
        if decided.tiles is not None:
            self.block = FP8TileOperands(decided.tiles, c.rounding, self.telemetry)
        elif decided.recipe is not None and decided.recipe.block:
            self.block = BlockOperands(decided.recipe, c.scale_mode, c.rounding, self.telemetry,
                                       weight_tiles=c.weight_blocks == "16x16",
                                       rht=rht_signs(c.rht_seed) if c.rht else None,
                                       rht_output="bf16" if decided.elsewhere == "bf16" or c.scale_rule == "te"
                                       else "fp32", scale_rule=c.scale_rule, sr_bits=c.sr_bits)
        else:
            self.block = None
        # While bench.numerics.memory counts a step, it listens here: (input, output, tensor class, format) of every
        # tensor a rounding site makes. None otherwise.
        self.site_listener: Callable | None = None
        self._listening = lambda: self.site_listener  # every site's one listener lookup (OpCasts checks it is one)

    # what the plan decided, as the rest of the suite reads it
    native = property(lambda self: self.plan.native)
    why = property(lambda self: self.plan.why)
    spec = property(lambda self: self.plan.spec)
    format = property(lambda self: self.plan.format)
    mode = property(lambda self: self.plan.mode)
    recipe = property(lambda self: self.plan.recipe)
    elsewhere = property(lambda self: self.plan.elsewhere)
    backend = property(lambda self: self.plan.backend)
    setting = property(lambda self: self.plan.setting)
    flags = property(lambda self: self.plan.flags)
    dtype = property(lambda self: self.plan.spec.torch_dtype)
    config = property(lambda self: self.plan.config)

    def fp32_flags(self):
        """torch's FP32 precision flags this cell runs under, set while it runs and restored after (the runner's)."""
        return fp32_flags(self.plan.tf32)

    def _site(self, tensor_class: str, fmt: str) -> TensorSite:
        scaler = self.method.site_scale(tensor_class, FORMATS[fmt],
                                        lambda amax, scale: self.telemetry.observe_scale(tensor_class, amax, scale)) \
            if self.plan.site_scales else None
        if scaler is not None:
            if not callable(getattr(scaler, "scale_for", None)):  # else the first forward pass fails, mid-run
                raise PrecisionError(f"scaling={self.method.name}: {type(self.method).__qualname__}.site_scale "
                                     f"returned a {type(scaler).__qualname__}, which has no scale_for(x); a site's "
                                     "scaler gives the factor x is multiplied by before the cast (docs/extending.md)")
            self._site_scales.append(scaler)
        c = self.plan.config
        rounding = c.rounding if tensor_class == "gradients" else "nearest"
        return TensorSite(tensor_class, fmt, c.overflow, c.ftz, self.telemetry, scaler, self._listening, rounding)

    def _kept(self, model: nn.Module, blocks: str | None) -> list[str]:
        """The Linear layers format.keep_high_precision keeps out of the format (PrecisionError where a pattern keeps
        none, or where nothing would be left in the format); every other Linear checked against 16 x 16 tiles.
        `blocks`: the module name of the model's list of blocks (its spec's `blocks`), or None."""
        c = self.plan.config
        linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
        kept = kept_layers(list(linears), c.keep_high_precision, blocks)
        if c.keep_high_precision and len(kept) == len(linears):
            raise PrecisionError(f"format.keep_high_precision={list(c.keep_high_precision)} keeps every Linear layer "
                                 f"({len(linears)}) out of {self.format}: nothing would be in the format; keep fewer")
        if c.weight_blocks == "16x16" and not c.pad_weights:
            for name, module in linears.items():
                if name not in kept and (module.in_features % 16 or module.out_features % 16):
                    raise PrecisionError(
                        f"format.weight_blocks=16x16: {name} is {module.out_features} x {module.in_features}, not "
                        f"whole 16 x 16 tiles (Transformer Engine refuses it too); valid: format.pad_weights=true "
                        f"(shorter edge tiles, as zero padding), format.weight_blocks=1x16, or keep it out of the "
                        f"format (format.keep_high_precision=[{name}])")
        return kept

    def prepare(self, model: nn.Module, blocks: str | None = None) -> nn.Module:
        """Make `model` compute in this precision and return the model to train: `model` itself, changed in place,
        or its replacement where the model is itself a module the precision replaces (a bare Linear); `conversion`
        says what was done, `autocast_layers` which layers autocast computes. `blocks`: the module name of the
        model's list of blocks (model.task.blocks), which format.keep_high_precision's first_blocks/last_blocks
        count."""
        model = self._prepared(model, blocks)
        self.autocast_layers = _autocast_layers(model)
        self._carry_between_ops(model)
        model = chained(model)
        self.chained = [name for name, module in model.named_modules()
                        if isinstance(module, CastOp)] if isinstance(model, EmulatedChain) else []
        return model

    def _carry_between_ops(self, model: nn.Module) -> None:
        """Under format.elsewhere=bf16, the emulated ops told to hand BF16's values on in FP32 tensors (the same
        values, fewer casts), by name: in `carried` those handing them to one another (emulation.carried_ops; all
        but the last, which hands the loss BF16, as before), in `carried_to_attention` those handing them to a
        transformers encoder's attention (carried_attention: its query, key and value, the model switched to the
        attention that takes them; the memory count leaves these alone: the math path a CPU's attention takes saves
        its inputs in FP32 from BF16 too). [] where none does."""
        carrying = self.elsewhere == "bf16" and not self.native
        ops = carried_ops(model)[:-1] if carrying else []
        # on a CPU, where BF16 attention with dropout is FP32 arithmetic (a GPU's BF16 kernels read BF16)
        attending = carried_attention_ops(model) if carrying and self.device.type == "cpu" else []
        if attending:
            route_carried_attention(model)
        for op in ops + attending:
            op.casts.carries_out = True
        names = {id(m): n for n, m in model.named_modules()}
        self.carried = [names[id(op)] for op in ops]
        self.carried_to_attention = [names[id(op)] for op in attending]

    def _prepared(self, model: nn.Module, blocks: str | None) -> nn.Module:
        if self.plan.spec.recipe is None:
            return model
        kept = self._kept(model, blocks) if self.plan.spec.gemm_only else []
        if self.plan.spec.native_path == "torchao":
            self.plan = for_model(self.plan, torchao_mx_converts if self.plan.spec.block else torchao_converts, model)
        if self.native:
            if self.plan.spec.native_path == "torchao":
                return self._convert_with_torchao(model, kept)
            return model.to(self.dtype) if self.mode == "true" else model
        if self.block is not None:
            model = swapped(model, lambda name, module: with_state_of(EmulatedLinear, module)
                            if type(module) is nn.Linear and name not in kept else None)
            for name, module in model.named_modules():
                if name not in kept and isinstance(module, CastOp) and isinstance(module, nn.Linear):  # unit's too
                    module.operands = self.block  # CastOp.linear then runs its GEMMs on block-scaled operands
            self.conversion = {"kept_in_high_precision": [
                n for n, m in model.named_modules()
                if isinstance(m, (nn.Linear, nn.Conv2d)) and getattr(m, "operands", None) is None],
                "kept_by_request": kept}
            return model
        model = swapped(model, lambda name, module: with_state_of(EMULATED_MODULES[type(module)], module)
                        if type(module) in EMULATED_MODULES and name not in kept else None)
        accumulation = self.plan.config.accumulation_model
        for name, module in model.named_modules():
            if name not in kept and isinstance(module, CastOp):
                module.casts = OpCasts(self.recipe, self._site)
                if accumulation is not None:
                    module.accumulation = self._accumulating(name, module, accumulation)
        if kept:
            self.conversion = {"kept_by_request": kept}
        if self.mode == "true":
            self._round_tensors(model.parameters())
        return model

    def _accumulating(self, name: str, module: nn.Module, accumulation: Accumulation) -> Accumulation:
        """The tensor-core model for one emulated op: a Linear, or a convolution with an implicit GEMM (one group,
        numeric zero padding)."""
        why = module.implicit_gemm if isinstance(module, EmulatedConv2d) else None
        if why is not None:
            raise PrecisionError(f"format.accumulation={self.plan.config.accumulation} models a convolution as one "
                                 f"implicit GEMM; {name} has {why}; valid: groups=1 with numeric padding, or "
                                 "format.accumulation=exact")
        return accumulation

    def _convert_with_torchao(self, model: nn.Module, kept: list[str]) -> nn.Module:
        """Native FP8 and MXFP8: torchao converts the Linear layers its kernels take, but those `kept` (by
        format.keep_high_precision); `conversion` lists them and the layers left in high precision."""
        takes = torchao_mx_converts if self.plan.spec.block else torchao_converts
        converts = lambda module, name="": takes(module) and name not in kept
        if self.plan.spec.block:
            from torchao.prototype.mx_formats.config import ScaleCalculationMode

            linear, kernel = padded_mxfp8_linear(), torchao_mx_kernel()
            model = swapped(model, lambda name, module: with_state_of(linear, module)
                            if converts(module, name) else None)
            for module in [m for m in model.modules() if type(m) is linear]:
                module.kernel_preference, module.wgrad_with_hp = kernel, False
                module.scale_calculation_mode = ScaleCalculationMode(self.block.scale_mode)
        else:
            from torchao.float8 import convert_to_float8_training

            config = torchao_float8_config(self.plan.torchao_recipe)
            if self.fp8_all_gather:
                config = replace(config, enable_fsdp_float8_all_gather=True)
            model = convert_to_float8_training(model, config=config, module_filter_fn=converts)
        converted = [(n, m) for n, m in model.named_modules() if type(m).__name__ in TORCHAO_LINEARS]
        for _, module in converted:
            module.register_forward_pre_hook(cast_input_as_autocast_does)
        self.conversion = {
            "converted": [n for n, _ in converted],
            "kept_in_high_precision": [n for n, m in model.named_modules() if type(m) in (nn.Linear, nn.Conv2d)],
            "kept_by_request": kept,
        }
        return model

    def autocast(self):
        """Native 16-bit mixed: autocast in the format. format.elsewhere=bf16: BF16 autocast around the converted GEMMs,
        which take their own operands (emulated ones compute in FP32 and hand on BF16, as an FP8 GEMM writes it)."""
        if self.native and self.mode == "mixed" and self.dtype is not None:
            return torch.autocast(self.device.type, dtype=self.dtype)
        if self.elsewhere == "bf16":
            if self.elsewhere_emulated is None:
                return torch.autocast(self.device.type, dtype=torch.bfloat16)
            return self._autocast_emulating_gemms()
        return contextlib.nullcontext()

    @property
    def elsewhere_emulated(self) -> str | None:
        """Why autocast's own GEMMs are emulated (autocast.py), None where they run natively: as the plan decided
        for the device, but only in a model with a Linear or convolution layer autocast computes. The emulation
        costs a Python call per torch call in the forward pass, repaid by a layer's GEMMs; a model whose every layer
        is the format's own (FP8's emulated sites, which turn autocast off) would only pay it."""
        if self.plan.elsewhere_emulated is None or self.autocast_layers == []:
            return None
        return self.plan.elsewhere_emulated

    @contextlib.contextmanager
    def _autocast_emulating_gemms(self):
        """BF16 autocast whose convolutions and matmuls compute in FP32 as a BF16 kernel would (autocast.py); each
        operand made is told to the memory accounting as a BF16 tensor, as a native run saves it."""
        listener = self.site_listener
        told = None if listener is None else lambda x, widened: listener(x, widened, _tensor_class(x), "bf16")
        with torch.autocast(self.device.type, dtype=torch.bfloat16), EmulatedGemms(self.device.type, told):
            yield

    @contextlib.contextmanager
    def evaluating(self, model: nn.Module, in_precision: str = "trained"):
        """Evaluation, per-epoch validation and the final test alike, as `train.eval_precision` asks: `trained`, as
        a training step computes the forward pass (its autocast, its emulated rounding sites, its torchao layers),
        so that a native and an emulated cell of one setting are measured alike; `fp32`, with none of them and a
        whole-model 16-bit cast widened for the while (FP32 inference of the weights the cell trained). Yields the
        cast for the task's float inputs. Training is left as it was: no telemetry is sampled, and no scaler's
        history (a delayed per-tensor amax) takes an evaluation's values."""
        sampling, self.telemetry.sampling = self.telemetry.sampling, False
        for scale in self._site_scales:
            scale.recording = False
        try:
            if in_precision == "trained":
                with self.autocast():
                    yield self.inputs
            else:
                with full_precision(model, widen=self.native and self.mode == "true"):
                    yield lambda x: x
        finally:
            self.telemetry.sampling = sampling
            for scale in self._site_scales:
                scale.recording = True

    def evaluated_in(self, in_precision: str) -> str:
        """What the record's `metrics.evaluated_in` says: the setting its evaluation computed in."""
        return self.describe()["label"] if in_precision == "trained" else "32-true"

    def inputs(self, x: torch.Tensor) -> torch.Tensor:
        """Cast a floating-point model input as a whole-model ("true") run needs."""
        if self.native and self.mode == "true" and x.is_floating_point():
            return x.to(self.dtype)
        return x

    def after_backward(self, model: nn.Module) -> None:
        """Emulated true mode: gradients of 16-bit parameters are 16-bit."""
        if not self.native and self.mode == "true":
            self._round_tensors(p.grad for p in model.parameters() if p.grad is not None)

    def after_step(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Emulated true mode: parameters and optimiser state live in the 16-bit format. FP8 all-gather: the weights'
        scales for the next step's gathers, from the updated weights (one all-reduce of their amaxes)."""
        if self.fp8_all_gather:
            from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

            precompute_float8_dynamic_scale_for_fsdp(model)
        if not self.native and self.mode == "true":
            self._round_tensors(model.parameters())
            self._round_tensors(v for state in optimizer.state.values() for v in state.values()
                                if torch.is_tensor(v) and v.is_floating_point() and v.dim() > 0)

    @torch.no_grad()
    def _round_tensors(self, tensors) -> None:
        c = self.plan.config
        for t in tensors:
            t.copy_(quantise_value(t, self.recipe.inputs, c.overflow, c.ftz))

    def describe(self) -> dict:
        """What the record's `env.precision` says about this run."""
        p, c = self.plan, self.plan.config
        tiles = p.tiles
        elements = ["fp8_e4m3"] if tiles else (sorted({p.recipe.inputs, p.recipe.grads}) if p.recipe else ["fp32"])
        kept = (self.conversion or {}).get("kept_in_high_precision")
        return {
            "format": p.format,
            "mode": p.mode,
            "setting": p.setting,
            "backend": p.backend,
            "label": p.setting + (" (bf16 elsewhere)" if p.elsewhere == "bf16" else "")
            + ("" if p.native else " (emulated)"),  # what dashboards group by
            "elsewhere": p.elsewhere,  # outside the converted GEMMs (format.elsewhere)
            "elsewhere_emulated": self.elsewhere_emulated,  # why bf16 elsewhere's own GEMMs were emulated; null: native
            "elsewhere_in_fp32_after": self.carried,  # emulated ops handing bf16 elsewhere's values on in FP32 tensors
            "elsewhere_in_fp32_to_attention": self.carried_to_attention,  # ... to a transformers encoder's attention
            "one_node_ops": self.chained,  # emulated ops run with the modules between them as one autograd node
            "backend_reason": p.why,
            "element_formats": elements,
            "element_definitions": {e: FORMATS[e].definition() for e in elements},
            "overflow": {e: "saturate" if self.block else resolve_overflow(FORMATS[e], c.overflow) for e in elements},
            "ftz": c.ftz,
            "rounding_of_gradients": c.rounding,
            "accumulation": accumulation.describe() if (accumulation := c.accumulation_model) else c.accumulation,
            "fp32_precision_flags": p.flags,
            "native_recipe": p.native_recipe,
            "keep_high_precision": {  # format.keep_high_precision: asked, the layers it kept, what they compute in
                "asked": list(c.keep_high_precision), "layers": (self.conversion or {}).get("kept_by_request", []),
                "computes_in": p.elsewhere} if c.keep_high_precision else None,
            "fp8_modules": self.conversion if p.native and p.spec.native_path == "torchao" else None,
            "block": None if self.block is None or p.native else {  # native: torchao scales, fp8_modules says
                "kind": p.scaling, "tile": tiles.tile, "scale": "the power of two at or below 448 / amax",
                "rounding_of_gradients": self.block.rounding, "kept_in_high_precision": kept} if tiles else {
                "kind": p.recipe.block, "block_size": 16 if p.recipe.block == "nvfp4" else 32,
                "scale_mode": self.block.scale_mode if p.recipe.block == "mx" else "E4M3 block x FP32 tensor amax",
                **({"scale_rule": c.scale_rule, "sr_bits": c.sr_bits} if p.recipe.block == "nvfp4" else {}),
                "rounding_of_gradients": self.block.rounding, "kept_in_high_precision": kept,
                **(self._nvfp4_recipe() if p.recipe.block == "nvfp4" else {})},
        }

    def _nvfp4_recipe(self) -> dict:
        """NVIDIA's NVFP4 switches as this cell set them (the record's env.precision.block)."""
        c = self.plan.config
        return {"weight_blocks": c.weight_blocks, "pad_weights": c.pad_weights,
                "rht": {"size": RHT_SIZE, "seed": c.rht_seed, "signs": self.block.rht.int().tolist(),
                        "signs_from": "Transformer Engine's fixed vector" if c.rht_seed is None else "the seed",
                        "input": "bf16" if c.scale_rule == "te" else "as the GEMM reads it",
                        "output": self.block.rht_output} if c.rht else None}
