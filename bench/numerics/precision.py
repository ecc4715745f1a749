"""Precision policy: how a run uses its format, natively on the device or emulated in FP32. The format itself is
declared in specs.py; the emulated operands this policy places live in emulation.py, the native (torchao)
configuration in native.py.

Emulation rounds exactly where a native kernel would, at every nn.Linear and nn.Conv2d:
- tf32: activations and weights entering the op, and the gradient entering its backward, keep
  10 mantissa bits (tensor cores read TF32); outputs stay FP32.
- fp16 / bf16 (autocast-style "mixed"): the same, and the op's output, its bias and the gradients
  it returns are rounded too, because a 16-bit kernel writes 16-bit results. FP32 master weights.
- fp8: activations and weights enter as E4M3, gradients enter the backward as E5M2, outputs and
  returned gradients stay in FP32 (FP8 GEMMs accumulate and write in higher precision).
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
Ops other than Linear/Conv2d (norms, softmax, embeddings, loss) stay in FP32, as in the FP8 literature.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace

import torch
from torch import nn

from bench.errors import ConfigError, check_choice
from bench.numerics.blocks import FP8_GRANULARITIES, MX_BLOCK, ROUNDINGS, SCALE_MODES
from bench.numerics.emulation import (
    EMULATED_MODULES,
    BlockOperands,
    CastOp,
    EmulatedLinear,
    FP8TileOperands,
    OpCasts,
    TensorSite,
)
from bench.numerics.formats import FORMATS, OVERFLOW_POLICIES, quantise_value, resolve_overflow
from bench.numerics.native import (
    NATIVE_FP8_RECIPES,
    TORCHAO_MXFP8,
    cast_input_as_autocast_does,
    padded_mxfp8_linear,
    torchao_converts,
    torchao_float8_config,
    torchao_mx_converts,
    torchao_mx_kernel,
)
from bench.numerics.scaling import SCALING_METHODS, PerTensorScale
from bench.numerics.specs import (
    ELSEWHERE,
    FORMAT_SPECS,
    FormatSpec,
    block_formats,
    native_support,
    stochastic_formats,
)
from bench.numerics.telemetry import QuantTelemetry

BACKENDS = ("auto", "native", "emulated")
# train.eval_precision: every evaluation (per-epoch validation and the final test) in the precision the cell trained
# in, native or emulated (its autocast, its rounding sites, its torchao layers), or in FP32 (none of them)
EVAL_PRECISIONS = ("trained", "fp32")


class PrecisionError(ConfigError):
    """A format setting the device or the combination cannot honour: a set-up problem (exit 2, no record), also
    when it is found only as the model is converted (native FP8 on a model with nothing torchao converts)."""


def set_fp32_precision(tf32: bool) -> dict[str, str]:
    """Set (and return) the FP32 matmul/conv precision flags explicitly, both ways.

    "fp32" must never be secretly TF32; oneDNN on CPU is always kept at IEEE so that emulation,
    not the library, decides any rounding.
    """
    value = "tf32" if tf32 else "ieee"
    torch.backends.cuda.matmul.fp32_precision = value
    torch.backends.cudnn.conv.fp32_precision = value
    torch.backends.cudnn.rnn.fp32_precision = value
    torch.backends.mkldnn.matmul.fp32_precision = "ieee"
    torch.backends.mkldnn.conv.fp32_precision = "ieee"
    return {
        "cuda_matmul": torch.backends.cuda.matmul.fp32_precision,
        "cudnn_conv": torch.backends.cudnn.conv.fp32_precision,
        "cudnn_rnn": torch.backends.cudnn.rnn.fp32_precision,
        "mkldnn_matmul": torch.backends.mkldnn.matmul.fp32_precision,
    }


@dataclass(frozen=True)
class PrecisionConfig:
    """A run's format choices, validated once, as they are made (like torchao's Float8LinearConfig): the config check,
    the sweeper's preflight (through it) and Precision all build one, so each mistake is refused in one place, with
    one wording, naming the valid choices. `scaling` is the scaling method where it is known (None: not checked)."""

    format: str
    mode: str = "mixed"
    backend: str = "auto"
    overflow: str | None = None
    ftz: bool = False
    scale_mode: str = "floor"
    rounding: str = "nearest"
    gradients: str | None = None
    scaling: str | None = None
    elsewhere: str | None = None  # outside the converted GEMMs: None/"fp32" (FP32) or "bf16" (autocast)

    def __post_init__(self):
        check_choice(self.format, tuple(FORMAT_SPECS), "format", PrecisionError)
        spec = self.spec
        check_choice(self.mode, spec.modes, f"format.mode (for format={self.format})", PrecisionError)
        check_choice(self.backend, BACKENDS, "format.backend", PrecisionError)
        check_choice(self.scale_mode, SCALE_MODES, "format.scale_mode", PrecisionError)
        check_choice(self.rounding, ROUNDINGS, "format.rounding", PrecisionError)
        if self.scaling is not None:
            check_choice(self.scaling, SCALING_METHODS, "scaling", PrecisionError)
            if self.scaling not in spec.scalings():
                why = ("block formats scale every block themselves (per_tensor would add nothing)" if spec.block else
                       f"{', '.join(FP8_GRANULARITIES)} scaling are FP8 recipes (E4M3 with a scale per row or tile)")
                raise PrecisionError(f"scaling={self.scaling} does not combine with format={self.format}: {why}; "
                                     f"valid for {self.format}: {', '.join(spec.scalings())}")
            if (spec.block or self.granularity) and self.overflow not in (None, "saturate"):
                raise PrecisionError(f"format.overflow={self.overflow}: {self.format} with scaling={self.scaling} "
                                     "saturates its elements; valid there: null or saturate")
        if self.overflow is not None:  # after the combinations: "valid there: null or saturate" is the sharper answer
            check_choice(self.overflow, OVERFLOW_POLICIES, "format.overflow", PrecisionError)
        if not spec.block and self.scale_mode != "floor":
            raise PrecisionError(f"format.scale_mode applies to the block formats only ({', '.join(block_formats())}),"
                                 f" not to format={self.format}")
        if not spec.stochastic_rounding and self.rounding != "nearest":
            raise PrecisionError(f"format.rounding applies to {', '.join(stochastic_formats())}, not to "
                                 f"format={self.format}; valid there: nearest")
        if self.elsewhere is not None:
            check_choice(self.elsewhere, ELSEWHERE, "format.elsewhere", PrecisionError)
            if self.elsewhere != "fp32" and not spec.gemm_only:
                raise PrecisionError(f"format.elsewhere={self.elsewhere} applies to the formats of the GEMM operands "
                                     f"only ({', '.join(n for n, s in FORMAT_SPECS.items() if s.gemm_only)}), not to "
                                     f"format={self.format}; valid there: null or fp32")
        if self.gradients is not None and self.gradients not in spec.gradient_elements:
            valid = {name: ", ".join(s.gradient_elements) for name, s in FORMAT_SPECS.items() if s.gradient_elements}
            raise PrecisionError(f"format.gradients={self.gradients} does not go with format={self.format}; valid: "
                                 "null (the format's recipe), or " + "; ".join(f"{e} for {f}" for f, e in valid.items()))

    @property
    def spec(self) -> FormatSpec:
        return FORMAT_SPECS[self.format]

    @property
    def granularity(self) -> str | None:
        """FP8's rowwise / block scaling, when that is the scaling method (it changes the GEMM operands)."""
        return self.scaling if self.scaling in FP8_GRANULARITIES else None

    @classmethod
    def from_config(cls, cfg) -> PrecisionConfig:
        """From a composed config: its `format` node and `scaling.name`."""
        f = cfg.format
        return cls(f.name, str(f.mode).lower(), f.backend, f.overflow, f.ftz, f.scale_mode, f.rounding, f.gradients,
                   cfg.scaling.name, f.get("elsewhere"))


# what an emulated FP8 granularity scales together (the record's env.precision.block.tile)
FP8_TILES = {"rowwise": "row",
             "rowwise_with_gw_hp": "row; the weight one scale in the input-gradient GEMM; the weight-gradient GEMM in "
                                   "high precision",
             "block": "1x128 (activations, gradients), 128x128 (weights)"}


@contextlib.contextmanager
def full_precision(model: nn.Module, widen: bool = False):
    """`model` computing in FP32 for the while: emulated rounding sites and block operands off, torchao's converted
    Linears back to nn.Linear (their weights are the high-precision ones); `widen`: a whole-model 16-bit cast
    (native true mode) widened to FP32 and narrowed back afterwards, exactly (every 16-bit value is an FP32 one)."""
    converted = [(m, type(m)) for m in model.modules() if type(m).__name__ in TORCHAO_LINEARS]
    sites = [(m, m.__dict__.get("casts"), m.__dict__.get("operands")) for m in model.modules() if isinstance(m, CastOp)]
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), None) if widen else None
    for module, _ in converted:
        module.__class__ = nn.Linear
    for module, _, _ in sites:
        module.casts = module.operands = None
    if dtype is not None:
        model.float()
    try:
        yield
    finally:
        if dtype is not None:
            model.to(dtype)
        for module, kind in converted:
            module.__class__ = kind
        for module, casts, operands in sites:
            for name, value in (("casts", casts), ("operands", operands)):
                if value is None:
                    module.__dict__.pop(name, None)  # back to the class's None
                else:
                    setattr(module, name, value)


# the Linear classes torchao's float8 and MXFP8 training convert to (Precision._convert_with_torchao)
TORCHAO_LINEARS = ("Float8Linear", "PaddedMXFP8Linear")


class Precision:
    """A run's format decisions, made once: native or emulated, which sites round, TF32 flags."""

    def __init__(self, fmt: str, mode: str, backend: str, overflow: str | None, ftz: bool,
                 device: torch.device, per_tensor=None, scale_mode: str = "floor", rounding: str = "nearest",
                 granularity: str | None = None, gradients: str | None = None, elsewhere: str | None = None):
        """per_tensor: a factory `(tensor_class, spec) -> PerTensorScale` when scaling=per_tensor, else None.
        scale_mode: block formats only (bench/numerics/blocks.py's SCALE_MODES); rounding: fp8 and block formats (ROUNDINGS).
        granularity: FP8 only, scaling=rowwise or block (bench/numerics/blocks.py's FP8_GRANULARITIES), else None.
        gradients: the gradient operands' element format (the spec's gradient_elements), None for the recipe's."""
        scaling = granularity or ("per_tensor" if per_tensor is not None else None)
        self.config = PrecisionConfig(fmt, mode, backend, overflow, ftz, scale_mode, rounding, gradients, scaling,
                                      elsewhere)
        self.elsewhere = elsewhere or "fp32"
        self.spec = self.config.spec
        self.format, self.mode, self.device, self.requested_backend = fmt, mode, device, backend
        self.rounding = rounding  # of the gradients entering each GEMM's backward (fp8 and the block formats)
        self.overflow, self.ftz, self.per_tensor = overflow, ftz, per_tensor
        self.granularity = granularity
        self.recipe = self.spec.recipe if gradients is None else replace(self.spec.recipe, grads=gradients)
        self.telemetry = QuantTelemetry()
        self._per_tensor_scales: list = []  # every PerTensorScale its sites made: paused while evaluating
        if granularity is not None:
            self.block = FP8TileOperands(granularity, rounding, self.telemetry)
        elif self.recipe is not None and self.recipe.block:
            self.block = BlockOperands(self.recipe, scale_mode, rounding, self.telemetry)
        else:
            self.block = None
        support = native_support(fmt, device)
        if fmt == "fp32":
            self.native, self.why = True, support.why
            if per_tensor is not None:
                self.why += "; scaling=per_tensor does nothing here: FP32 quantises no tensor (a baseline cell)"
        elif backend == "native":
            if not support.available:
                raise PrecisionError(f"format.backend=native but {fmt} has no native path on {device.type}: "
                                     f"{support.why}; valid here: format.backend=auto or emulated")
            self.native, self.why = True, "requested: " + support.why
        elif backend == "emulated":
            self.native, self.why = False, "requested"
        else:
            self.native, self.why = support.fast, support.why
        if self.native and per_tensor is not None and self.recipe is not None and self.spec.native_path == "torch":
            self._emulate_instead(f"per-tensor scaling of {fmt} needs emulation (native {fmt} kernels take no "
                                  "per-tensor scales); valid: format.backend=auto or emulated",
                                  f"per-tensor scaling of {fmt} needs emulation ({support.why})")
        if self.native and fmt == "fp8" and rounding == "stochastic":
            self._emulate_instead("torchao's float8 recipes round to nearest; format.rounding=stochastic needs "
                                  "emulation: valid here: format.backend=auto or emulated",
                                  f"stochastic rounding of gradients exists only as emulation ({support.why})")
        if self.native and granularity == "block":
            self._emulate_instead("scaling=block (Transformer Engine's Float8BlockScaling) has no native path here: "
                                  "Transformer Engine is not a dependency; valid: format.backend=auto or emulated",
                                  "Transformer Engine's Float8BlockScaling is not wired in: block-scaled FP8 is "
                                  f"emulated ({support.why})")
        if self.native and fmt == "mxfp8":
            differs = [want for want, ok in (
                ("format.gradients=fp8_e4m3", self.recipe.grads == TORCHAO_MXFP8["gradients"]),
                ("format.scale_mode=rceil or floor", scale_mode in TORCHAO_MXFP8["scale_modes"]),
                ("format.rounding=nearest", rounding == TORCHAO_MXFP8["rounding"])) if not ok]
            if differs:
                why = "torchao's MXFP8 recipe (E4M3 gradients, rceil or floor scales, nearest rounding) needs " + \
                    ", ".join(differs)
                self._emulate_instead(f"format.backend=native: {why}; or format.backend=auto or emulated",
                                      f"{why}: this recipe is emulated ({support.why})")
        if self.native and fmt == "fp8" and per_tensor is None and granularity is None:
            # torchao's FP8 recipes scale every tensor themselves: FP8 without per-tensor scales (scaling=none,
            # static, dynamic, unit) exists only as emulation, so `auto` emulates it and says why.
            self._emulate_instead("native FP8 (torchao) always scales per tensor; use scaling=per_tensor, or "
                                  "format.backend=auto or emulated to study FP8 without per-tensor scales",
                                  "FP8 without per-tensor scales exists only as emulation: native FP8 (torchao "
                                  f"tensorwise) scales every tensor itself ({support.why})")
        self.flags = set_fp32_precision(tf32=(fmt == "tf32"))
        self.fp8_modules = None  # native FP8 / MXFP8: which Linear layers torchao converted and which it left alone
        self.kept_in_high_precision = None  # block formats: the Conv2d layers they leave in FP32
        self.dtype = self.spec.torch_dtype
        # While bench.numerics.memory counts a step, it listens here: (input, output, tensor class, format) of every
        # tensor a rounding site makes. None otherwise.
        self.site_listener = None

    @classmethod
    def from_config(cls, cfg, device: torch.device) -> "Precision":
        """The precision a composed cell config asks for, on `device`: its `format` node, and what its scaling method
        asks of the format (per-tensor scales, FP8's row or tile granularity)."""
        per_tensor = None
        if cfg.scaling.name == "per_tensor":
            s = cfg.scaling

            def per_tensor(tensor_class, spec):
                return PerTensorScale(spec, s.amax, s.history_len, s.margin, s.pow2,
                                      on_scale=lambda a, sc: precision.telemetry.observe_scale(tensor_class, a, sc))

        f = cfg.format
        granularity = cfg.scaling.name if cfg.scaling.name in FP8_GRANULARITIES else None
        precision = cls(f.name, f.mode, f.backend, f.overflow, f.ftz, device, per_tensor, f.scale_mode, f.rounding,
                        granularity, f.gradients, f.get("elsewhere"))
        return precision

    def _emulate_instead(self, refusal: str, reason: str) -> None:
        """A native path this cell cannot take: format.backend=native is refused with `refusal` (which names the
        valid choices); auto emulates and records `reason`."""
        if self.requested_backend == "native":
            raise PrecisionError(refusal)
        self.native, self.why = False, reason

    @property
    def backend(self) -> str:
        return "native" if self.native else "emulated"

    @property
    def setting(self) -> str:
        """Lightning-style name of the precision setting: 32-true, tf32, 16-mixed, bf16-true, fp8-mixed."""
        return self.spec.setting(self.mode)

    def _site(self, tensor_class: str, fmt: str) -> TensorSite:
        scaler = self.per_tensor(tensor_class, FORMATS[fmt]) if self.per_tensor else None
        if scaler is not None:
            self._per_tensor_scales.append(scaler)
        rounding = self.rounding if tensor_class == "gradients" else "nearest"
        return TensorSite(tensor_class, fmt, self.overflow, self.ftz, self.telemetry, scaler, self._note_output,
                          rounding)

    def _note_output(self, x: torch.Tensor, rounded: torch.Tensor, tensor_class: str, fmt: str) -> None:
        if self.site_listener is not None:
            self.site_listener(x, rounded, tensor_class, fmt)

    def prepare(self, model: nn.Module) -> nn.Module:
        """Make `model` compute in this precision (in place) and return it."""
        if self.format == "fp32":
            return model
        if self.native:
            if self.spec.native_path == "torchao":
                return self._convert_with_torchao(model)
            return model.to(self.dtype) if self.mode == "true" else model
        if self.block is not None:
            for module in model.modules():
                if type(module) is nn.Linear:
                    module.__class__ = EmulatedLinear  # re-class in place: parameters and state-dict keys are untouched
                if isinstance(module, CastOp) and isinstance(module, nn.Linear):  # unit scaling's Linear too
                    module.operands = self.block  # CastOp.linear then runs its GEMMs on block-scaled operands
            self.kept_in_high_precision = [n for n, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Conv2d))
                                           and getattr(m, "operands", None) is None]
            return model
        for module in model.modules():
            emulated = EMULATED_MODULES.get(type(module))
            if emulated is not None:
                module.__class__ = emulated  # re-class in place: parameters and state-dict keys are untouched
            if isinstance(module, CastOp):
                module.casts = OpCasts(self.recipe, self._site)
        if self.mode == "true":
            self._round_tensors(model.parameters())
        return model

    def _convert_with_torchao(self, model: nn.Module) -> nn.Module:
        """Native FP8 and MXFP8: torchao converts the Linear layers its kernels take (`fp8_modules` lists them and
        the layers left in high precision); a model with none is emulated (auto) or fails (native)."""
        mx = self.format == "mxfp8"
        converts = torchao_mx_converts if mx else torchao_converts
        if not any(converts(m) for m in model.modules()):
            # Native would train every layer in high precision and be recorded in the format.
            why = (f"torchao's {'MXFP8' if mx else 'float8'} training converts only Linear layers whose in and out "
                   f"features are multiples of {MX_BLOCK if mx else 16}, and this model has none (a unit-scaled Linear "
                   "is not one)")
            self._emulate_instead(f"format.backend=native: {why}, so nothing would run in {self.format.upper()}; "
                                  "valid here: format.backend=auto or emulated", f"{why}: emulated ({self.why})")
            return self.prepare(model)
        if mx:
            from torchao.prototype.mx_formats.config import ScaleCalculationMode

            linear, kernel = padded_mxfp8_linear(), torchao_mx_kernel()
            for module in [m for m in model.modules() if converts(m)]:
                module.__class__ = linear  # re-class in place: parameters and state-dict keys are untouched
                module.kernel_preference, module.wgrad_with_hp = kernel, False
                module.scale_calculation_mode = ScaleCalculationMode(self.block.scale_mode)
        else:
            from torchao.float8 import convert_to_float8_training

            model = convert_to_float8_training(model, config=torchao_float8_config(self.granularity or "tensorwise"),
                                               module_filter_fn=converts)
        converted = [(n, m) for n, m in model.named_modules() if type(m).__name__ in TORCHAO_LINEARS]
        for _, module in converted:
            module.register_forward_pre_hook(cast_input_as_autocast_does)
        self.fp8_modules = {
            "converted": [n for n, _ in converted],
            "kept_in_high_precision": [n for n, m in model.named_modules() if type(m) in (nn.Linear, nn.Conv2d)],
        }
        return model

    def autocast(self):
        """Native 16-bit mixed: autocast in the format. format.elsewhere=bf16: BF16 autocast around the converted GEMMs,
        which take their own operands (emulated ones compute in FP32 and hand on BF16, as an FP8 GEMM writes it)."""
        if self.native and self.mode == "mixed" and self.dtype is not None:
            return torch.autocast(self.device.type, dtype=self.dtype)
        if self.elsewhere == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def evaluating(self, model: nn.Module, in_precision: str = "trained"):
        """Evaluation, per-epoch validation and the final test alike, as `train.eval_precision` asks: `trained`, as
        a training step computes the forward pass (its autocast, its emulated rounding sites, its torchao layers),
        so that a native and an emulated cell of one setting are measured alike; `fp32`, with none of them and a
        whole-model 16-bit cast widened for the while (FP32 inference of the weights the cell trained). Yields the
        cast for the task's float inputs. Training is left as it was: no telemetry is sampled, and no per-tensor
        amax enters a delayed-scaling history."""
        sampling, self.telemetry.sampling = self.telemetry.sampling, False
        for scale in self._per_tensor_scales:
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
            for scale in self._per_tensor_scales:
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
        """Emulated true mode: parameters and optimiser state live in the 16-bit format."""
        if not self.native and self.mode == "true":
            self._round_tensors(model.parameters())
            self._round_tensors(v for state in optimizer.state.values() for v in state.values()
                                if torch.is_tensor(v) and v.is_floating_point() and v.dim() > 0)

    def _native_recipe(self) -> str | None:
        if self.native and self.format == "fp8":
            return NATIVE_FP8_RECIPES[self.granularity or "per_tensor"]
        if self.native and self.format == "mxfp8":
            return (f"torchao MXFP8Linear (E4M3 operands, an E8M0 {self.block.scale_mode} scale per 32, tokens "
                    "zero-padded to whole blocks)")
        return None

    @torch.no_grad()
    def _round_tensors(self, tensors) -> None:
        for t in tensors:
            t.copy_(quantise_value(t, self.recipe.inputs, self.overflow, self.ftz))

    def describe(self) -> dict:
        """What the record's `env.precision` says about this run."""
        elements = ["fp8_e4m3"] if self.granularity else (
            sorted({self.recipe.inputs, self.recipe.grads}) if self.recipe else ["fp32"])
        return {
            "format": self.format,
            "mode": self.mode,
            "setting": self.setting,
            "backend": self.backend,
            "label": self.setting + (" (bf16 elsewhere)" if self.elsewhere == "bf16" else "")
            + ("" if self.native else " (emulated)"),  # what dashboards group by
            "elsewhere": self.elsewhere,  # outside the converted GEMMs (format.elsewhere)
            "backend_reason": self.why,
            "element_formats": elements,
            "overflow": {e: "saturate" if self.block else resolve_overflow(FORMATS[e], self.overflow) for e in elements},
            "ftz": self.ftz,
            "rounding_of_gradients": self.rounding,
            "fp32_precision_flags": self.flags,
            "native_recipe": self._native_recipe(),
            "fp8_modules": self.fp8_modules,
            "block": None if self.block is None or self.native else {  # native: torchao scales, fp8_modules says
                "kind": self.granularity, "tile": FP8_TILES[self.granularity],
                "scale": "the power of two at or below 448 / amax",
                "rounding_of_gradients": self.block.rounding,
                "kept_in_high_precision": self.kept_in_high_precision} if self.granularity else {
                "kind": self.recipe.block, "block_size": 16 if self.recipe.block == "nvfp4" else 32,
                "scale_mode": self.block.scale_mode if self.recipe.block == "mx" else "E4M3 block x FP32 tensor amax",
                "rounding_of_gradients": self.block.rounding,
                "kept_in_high_precision": self.kept_in_high_precision},
        }
