"""A cell's precision, decided once and without side effects: `plan(config, method, device) -> PrecisionPlan`.

The plan says, for the format choices (`PrecisionConfig`), the scaling method (bench/numerics/scaling_methods.py) and
the device, whether the cell runs natively or emulated and why, which element formats its GEMM operands take, how
the ops outside the GEMMs compute, and under which FP32 matmul flags. Building one touches nothing global: the runner
sets torch's flags for the cell's duration (`fp32_flags`), so a device matrix, doctor or a preflight that plans many
cells leaves them as it found them. `Precision` (bench/numerics/precision.py) carries a plan out on a model.

Native where the device has the format (its FormatSpec's `native`), unless one of `EMULATION_RULES` says the native
kernels cannot compute what the cell asks: the first that applies makes `format.backend=auto` emulate (the plan's
`why` says so) and `format.backend=native` a PrecisionError naming the valid choices.
"""

from __future__ import annotations

import contextlib
import fnmatch
import re
from dataclasses import dataclass, field, fields, make_dataclass, replace
from typing import Callable, List, Optional

import torch
from omegaconf import MISSING

from bench.errors import ConfigError, check_choice
from bench.numerics.blocks import MX_BLOCK, ROUNDINGS, SCALE_MODES, SCALE_RULES, TileScaling
from bench.numerics.formats import OVERFLOW_POLICIES, SR_BITS
from bench.numerics.native import TORCHAO_MXFP8
from bench.numerics.scaling_methods import SCALING_METHODS, ScalingMethod, scaling_class
from bench.numerics.specs import (
    ELSEWHERE,
    FORMAT_SPECS,
    FormatSpec,
    Recipe,
    block_formats,
    native_support,
    stochastic_formats,
)
from bench.numerics.tensor_cores import Accumulation

BACKENDS = ("auto", "native", "emulated")
WEIGHT_BLOCKS = ("1x16", "16x16")  # NVFP4's weight: 1 x 16 blocks per GEMM, or 16 x 16 tiles serving both
# format.keep_high_precision's counts: first:<n> / last:<n> Linear layers, first_blocks:<n> / last_blocks:<n> blocks
LAYER_COUNT = re.compile(r"(first|last)(_blocks)?:(\d+)$")
HEAD = "head"  # format.keep_high_precision's name for the output head: the last Linear layer in module order


class PrecisionError(ConfigError):
    """A format setting the device or the combination cannot honour: a set-up problem (exit 2, no record), also
    when it is found only as the model is converted (native FP8 on a model with nothing torchao converts)."""


def fp32_precision_flags(tf32: bool) -> dict[str, str]:
    """torch's FP32 matmul/conv precision flags a cell runs under: "fp32" is never secretly TF32, and oneDNN on CPU
    is always IEEE, so that emulation, not the library, decides any rounding."""
    value = "tf32" if tf32 else "ieee"
    return {"cuda_matmul": value, "cudnn_conv": value, "cudnn_rnn": value, "mkldnn_matmul": "ieee"}


_FLAGS = {"cuda_matmul": (torch.backends.cuda.matmul, "fp32_precision"),
          "cudnn_conv": (torch.backends.cudnn.conv, "fp32_precision"),
          "cudnn_rnn": (torch.backends.cudnn.rnn, "fp32_precision"),
          "mkldnn_matmul": (torch.backends.mkldnn.matmul, "fp32_precision"),
          "mkldnn_conv": (torch.backends.mkldnn.conv, "fp32_precision")}


@contextlib.contextmanager
def fp32_flags(tf32: bool):
    """torch's FP32 precision flags set for a cell (`fp32_precision_flags`, oneDNN's conv IEEE too) while it runs,
    and put back as they were when it ends."""
    wanted = fp32_precision_flags(tf32) | {"mkldnn_conv": "ieee"}
    before = {key: getattr(obj, name) for key, (obj, name) in _FLAGS.items()}
    try:
        for key, (obj, name) in _FLAGS.items():
            setattr(obj, name, wanted[key])
        yield
    finally:
        for key, (obj, name) in _FLAGS.items():
            setattr(obj, name, before[key])


@dataclass(frozen=True)
class FormatChoices:
    """`format.*`, declared once: the keys of conf/format/*.yaml and their defaults. Hydra's schema is its mutable
    twin (`schema`), `PrecisionConfig` validates it, and records and identities read its defaults (`FORMAT_DEFAULTS`).
    A new format key is one line here (and its check in PrecisionConfig, its doc in conf/README.md)."""

    name: str = MISSING
    mode: str = "mixed"  # mixed (FP32 master weights) | true (whole model cast)
    backend: str = "auto"  # auto | native | emulated
    overflow: Optional[str] = None  # saturate | inf | nan; None = each element format's default
    ftz: bool = False  # flush subnormal results to signed zero (TPU bfloat16 semantics)
    scale_mode: str = "floor"  # block formats (MX): floor | ceil | even | rceil (bench/numerics/blocks.py)
    rounding: str = "nearest"  # fp8 and block formats: nearest | stochastic (the gradients entering the backward GEMMs)
    gradients: Optional[str] = None  # mxfp8, mxfp6: the gradient operands' element format; None = the recipe's
    elsewhere: Optional[str] = None  # fp8 and block formats, outside the converted GEMMs: null/fp32 (as before) | bf16
    # NVIDIA's NVFP4 recipe (nvfp4, nvfp4_recipe: bench/numerics/blocks.py), each a switch; format=nvfp4_recipe all on
    rht: bool = False  # 16 x 16 random Hadamard transform of both weight-gradient GEMM operands along the tokens
    rht_seed: Optional[int] = None  # its random signs: null = Transformer Engine's fixed vector | an integer draws them
    weight_blocks: str = "1x16"  # 1x16 (per GEMM) | 16x16 (tiles, one quantised weight for forward and backward)
    pad_weights: bool = False  # 16x16 on a Linear whose dims are not multiples of 16: shorter edge tiles (else refused)
    scale_rule: str = "torchao"  # NVFP4's scale arithmetic: torchao | te (Transformer Engine's: numerics/blocks.py)
    sr_bits: Optional[int] = None  # NVFP4's stochastic rounding: null = an FP32 uniform | 8 (random bits, as TE's)
    # fp8 and block formats: Linear layers kept out of the format, computing as `elsewhere` does (BF16 or FP32):
    # module-name globs (`*.lm_head`), `first:<n>` or `last:<n>` (the first or last n Linear layers in module order)
    keep_high_precision: Optional[List[str]] = None
    # the emulated GEMMs' accumulation: exact (in FP32) | a GPU's tensor cores (bench/numerics/tensor_cores.py), FP8
    # fast where torchao's tensorwise recipe is (<GPU>), or in every GEMM (<GPU>-fast), or promoted (<GPU>-promoted)
    accumulation: str = "exact"

    @classmethod
    def schema(cls) -> type:
        """The same fields as a plain, mutable dataclass: Hydra's structured config must be one (a composed config is
        edited once, bench/running/config.py), and a frozen schema would make `cfg.format` read-only."""
        twin = make_dataclass("FormatConfig", [(f.name, f.type, field(default=f.default)) for f in fields(cls)])
        twin.__module__, twin.__doc__ = cls.__module__, cls.__doc__  # its annotations resolve in this module
        return twin


FORMAT_DEFAULTS = {f.name: f.default for f in fields(FormatChoices)}


@dataclass(frozen=True)
class PrecisionConfig(FormatChoices):
    """A run's format choices, validated once, as they are made (like torchao's Float8LinearConfig): the config check,
    the sweeper's preflight (through it) and the plan all build one, so each mistake is refused in one place, with
    one wording, naming the valid choices. `scaling` is the scaling method's name where it is known (None: not
    checked)."""

    scaling: str | None = None

    def __post_init__(self):
        object.__setattr__(self, "keep_high_precision", tuple(self.keep_high_precision or ()))  # hashable, iterable
        check_choice(self.format, tuple(FORMAT_SPECS), "format", PrecisionError)
        spec = self.spec
        check_choice(self.mode, spec.modes, f"format.mode (for format={self.format})", PrecisionError)
        check_choice(self.backend, BACKENDS, "format.backend", PrecisionError)
        check_choice(self.scale_mode, SCALE_MODES, "format.scale_mode", PrecisionError)
        check_choice(self.rounding, ROUNDINGS, "format.rounding", PrecisionError)
        if self.scaling is not None:
            method = scaling_class(self.scaling) if self.scaling in SCALING_METHODS else None
            check_choice(self.scaling, tuple(SCALING_METHODS), "scaling", PrecisionError)
            if (why := method.combines_with(spec)) is not None:
                valid = [n for n, cls in SCALING_METHODS.items() if cls.combines_with(spec) is None]
                raise PrecisionError(f"scaling={self.scaling} does not combine with format={self.format}: {why}; "
                                     f"valid for {self.format}: {', '.join(valid)}")
            if (spec.block or method.tiles) and self.overflow not in (None, "saturate"):
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
        self._check_recipe_switches()
        self._check_accumulation()
        if self.gradients is not None and self.gradients not in spec.gradient_elements:
            valid = {name: ", ".join(s.gradient_elements) for name, s in FORMAT_SPECS.items() if s.gradient_elements}
            raise PrecisionError(f"format.gradients={self.gradients} does not go with format={self.format}; valid: "
                                 "null (the format's recipe), or "
                                 + "; ".join(f"{e} for {f}" for f, e in valid.items()))

    def _check_recipe_switches(self) -> None:
        """NVIDIA's NVFP4 switches need 16-element blocks; keep_high_precision a format of the GEMM operands."""
        spec = self.spec
        check_choice(self.weight_blocks, WEIGHT_BLOCKS, "format.weight_blocks", PrecisionError)
        sixteen = [n for n, s in FORMAT_SPECS.items() if s.block == "nvfp4"]
        for key in ("rht", "weight_blocks", "pad_weights"):
            value, default = getattr(self, key), FORMAT_DEFAULTS[key]
            if value != default and spec.block != "nvfp4":
                raise PrecisionError(f"format.{key}={value} needs a format in blocks of 16 ({', '.join(sixteen)}), "
                                     f"not format={self.format}; valid there: format.{key}={default}")
        check_choice(self.scale_rule, SCALE_RULES, "format.scale_rule", PrecisionError)
        if self.scale_rule != FORMAT_DEFAULTS["scale_rule"] and spec.block != "nvfp4":
            raise PrecisionError(f"format.scale_rule={self.scale_rule} is NVFP4's ({', '.join(sixteen)}), not "
                                 f"format={self.format}'s; valid there: format.scale_rule=torchao")
        if self.sr_bits is not None:
            check_choice(self.sr_bits, SR_BITS, "format.sr_bits", PrecisionError)
            if spec.block != "nvfp4" or self.rounding != "stochastic":
                raise PrecisionError(f"format.sr_bits={self.sr_bits} sets the random bits of NVFP4's stochastic "
                                     f"rounding ({', '.join(sixteen)} with format.rounding=stochastic), not of "
                                     f"format={self.format} with format.rounding={self.rounding}; valid there: "
                                     "format.sr_bits=null")
        if self.rht_seed is not None and not self.rht:
            raise PrecisionError(f"format.rht_seed={self.rht_seed} draws the signs of a transform that is off; "
                                 "valid: format.rht=true with it, or format.rht_seed=null")
        for pattern in self.keep_high_precision:
            if not spec.gemm_only:
                raise PrecisionError(f"format.keep_high_precision applies to the formats of the GEMM operands only "
                                     f"({', '.join(n for n, s in FORMAT_SPECS.items() if s.gemm_only)}), not to "
                                     f"format={self.format}; valid there: null")
            count = LAYER_COUNT.match(pattern)
            if pattern.startswith(("first", "last")) and ":" in pattern and (count is None or int(count[3]) < 1):
                raise PrecisionError(f"format.keep_high_precision: {pattern!r} is not valid; valid: first:<n>, "
                                     "last:<n>, first_blocks:<n> or last_blocks:<n> with n >= 1, head, or a glob over "
                                     "module names such as '*.lm_head'")

    def _check_accumulation(self) -> None:
        """A tensor-core model needs GEMMs on per-tensor-scaled operands in its input types (`accumulation_model`)."""
        if self.accumulation == FORMAT_DEFAULTS["accumulation"]:
            return
        spec, tiled = self.spec, self.scaling in SCALING_METHODS and scaling_class(self.scaling).tiles is not None
        modelled = [n for n, s in FORMAT_SPECS.items() if s.recipe is not None and not s.block]
        if spec.recipe is None or spec.block:
            why = "FP32 GEMMs run on CUDA cores (TF32 off)" if spec.recipe is None else \
                "block-scaled GEMMs (scales applied inside the MMA) are not in the tensor-core data"
            raise PrecisionError(f"format.accumulation={self.accumulation} models the tensor cores of GEMMs on "
                                 f"per-tensor formats ({', '.join(modelled)}), not format={self.format}: {why}; valid "
                                 "there: format.accumulation=exact")
        if tiled:
            raise PrecisionError(f"format.accumulation={self.accumulation} models GEMMs on per-tensor-scaled operands; "
                                 f"scaling={self.scaling} scales rows or tiles, which the tensor-core data does not "
                                 "cover; valid: format.accumulation=exact, or scaling=per_tensor")
        self.accumulation_model  # noqa: B018 - parsed here so that a mistake is refused with the config

    @property
    def accumulation_model(self) -> Accumulation | None:
        """format.accumulation as a tensor-core model of this format's GEMM operands; None where exact."""
        if self.accumulation == FORMAT_DEFAULTS["accumulation"]:
            return None
        recipe = self.spec.recipe
        operands = (recipe.inputs, self.gradients or recipe.grads)
        try:
            return Accumulation.parse(self.accumulation, operands)
        except ConfigError as error:
            raise PrecisionError(str(error)) from None

    @property
    def format(self) -> str:
        """The format's name (`format.name`)."""
        return self.name

    @property
    def spec(self) -> FormatSpec:
        return FORMAT_SPECS[self.format]

    @property
    def by_layer(self) -> bool:
        """Whether a choice depends on the model's Linear layers (layers named to keep, whole 16 x 16 weight tiles):
        only Precision.prepare on the built model can refuse it, so the preflight builds one."""
        return bool(self.keep_high_precision) or self.weight_blocks == "16x16"

    @classmethod
    def from_config(cls, cfg) -> PrecisionConfig:
        """From a composed config: its `format` node and `scaling.name`."""
        chosen = {key: cfg.format.get(key, default) for key, default in FORMAT_DEFAULTS.items()}
        return cls(**chosen | {"mode": str(chosen["mode"]).lower()}, scaling=cfg.scaling.name)


@dataclass(frozen=True)
class PrecisionPlan:
    """What a cell computes in, decided once (see the module docstring). Nothing writes into it afterwards."""

    config: PrecisionConfig
    scaling: str  # the scaling method's name
    native: bool
    why: str
    recipe: Recipe | None  # the element formats emulated GEMM operands round to (format.gradients applied); None: FP32
    site_scales: bool  # every emulated rounding site scales its tensor (the method's site_scale)
    tiles: TileScaling | None  # FP8 operands scaled per row or tile
    torchao_recipe: str | None  # native FP8: torchao's float8 recipe
    native_recipe: str | None  # how the record describes a native torchao recipe
    # format.elsewhere=bf16's own GEMMs (autocast's convolutions and matmuls): None, native BF16; else why they are
    # emulated in FP32 (bench/numerics/autocast.py: a CPU without BF16 units)
    elsewhere_emulated: str | None = None

    @property
    def spec(self) -> FormatSpec:
        return self.config.spec

    @property
    def format(self) -> str:
        return self.config.format

    @property
    def mode(self) -> str:
        return self.config.mode

    @property
    def elsewhere(self) -> str:
        return self.config.elsewhere or "fp32"

    @property
    def setting(self) -> str:
        """Lightning-style name of the precision setting: 32-true, tf32, 16-mixed, bf16-true, fp8-mixed."""
        return self.spec.setting(self.mode)

    @property
    def backend(self) -> str:
        return "native" if self.native else "emulated"

    @property
    def tf32(self) -> bool:
        return self.spec.name == "tf32"

    @property
    def flags(self) -> dict[str, str]:
        return fp32_precision_flags(self.tf32)

    @property
    def ops(self) -> dict[str, str]:
        """What each class of op computes in: the GEMMs (Linear, Conv2d; torchao converts Linears only) and the rest."""
        if self.spec.recipe is None:
            return {"gemm": "fp32", "elsewhere": "fp32"}
        how = "native" if self.native else "emulated in FP32"
        if self.spec.gemm_only:
            return {"gemm": f"{self.setting} ({how})", "elsewhere": self.elsewhere}
        dtype = self.spec.name if self.native and self.spec.torch_dtype is not None else None
        elsewhere = "fp32" if dtype is None else dtype if self.mode == "true" else f"autocast {dtype}"
        return {"gemm": f"{self.setting} ({how})", "elsewhere": elsewhere}


@dataclass(frozen=True)
class EmulationRule:
    """A reason the native kernels cannot compute what a cell asks: `applies(plan, method)` on a tentatively native
    plan; `refusal` (format.backend=native: the error, naming the valid choices) and `reason` (auto: the plan's
    `why`), formatted with fmt, method and support (the device's own why)."""

    applies: Callable[[PrecisionPlan, ScalingMethod], bool]
    refusal: str
    reason: str


def _torchao_float8(plan: PrecisionPlan) -> bool:
    return plan.spec.native_path == "torchao" and not plan.spec.block


def _torchao_mx_differs(plan: PrecisionPlan) -> list[str]:
    """What an MX cell asks that torchao's MXFP8 recipe does not do."""
    if not (plan.spec.native_path == "torchao" and plan.spec.block):
        return []
    c = plan.config
    return [want for want, ok in (
        ("format.gradients=fp8_e4m3", plan.recipe.grads == TORCHAO_MXFP8["gradients"]),
        ("format.scale_mode=rceil or floor", c.scale_mode in TORCHAO_MXFP8["scale_modes"]),
        ("format.rounding=nearest", c.rounding == TORCHAO_MXFP8["rounding"])) if not ok]


_AUTO = "valid: format.backend=auto or emulated"
EMULATION_RULES = (
    EmulationRule(lambda p, m: m.site_scales and p.spec.native_path == "torch",
                  "{title} of {fmt} needs emulation (native {fmt} kernels take no per-tensor scales); " + _AUTO,
                  "{title} of {fmt} needs emulation ({support})"),
    EmulationRule(lambda p, m: _torchao_float8(p) and p.config.rounding == "stochastic",
                  "torchao's float8 recipes round to nearest; format.rounding=stochastic needs emulation: valid here: "
                  "format.backend=auto or emulated",
                  "stochastic rounding of gradients exists only as emulation ({support})"),
    EmulationRule(lambda p, m: m.tiles is not None and m.torchao_recipe is None,
                  "scaling={method} (Transformer Engine's Float8BlockScaling) has no native path here: Transformer "
                  "Engine is not a dependency; " + _AUTO,
                  "Transformer Engine's Float8BlockScaling is not wired in: block-scaled FP8 is emulated ({support})"),
    EmulationRule(lambda p, m: bool(_torchao_mx_differs(p)),
                  "format.backend=native: torchao's MXFP8 recipe (E4M3 gradients, rceil or floor scales, nearest "
                  "rounding) needs {differs}; or format.backend=auto or emulated",
                  "torchao's MXFP8 recipe (E4M3 gradients, rceil or floor scales, nearest rounding) needs {differs}: "
                  "this recipe is emulated ({support})"),
    # torchao's FP8 recipes scale every tensor themselves: FP8 without their scales (scaling=none, static, dynamic,
    # unit, or a method of the user's) exists only as emulation
    EmulationRule(lambda p, m: p.config.accumulation != FORMAT_DEFAULTS["accumulation"],
                  "format.accumulation={accumulation} models a GPU's tensor cores on emulated GEMMs; native kernels "
                  "accumulate as this device does: " + _AUTO,
                  "format.accumulation={accumulation} models a GPU's tensor cores, which only emulation can "
                  "({support})"),
    EmulationRule(lambda p, m: _torchao_float8(p) and m.torchao_recipe is None,
                  "native FP8 (torchao) always scales per tensor; use scaling=per_tensor, or format.backend=auto or "
                  "emulated to study FP8 without per-tensor scales",
                  "FP8 without per-tensor scales exists only as emulation: native FP8 (torchao tensorwise) scales "
                  "every tensor itself ({support})"),
)


def _emulated(plan: PrecisionPlan, refusal: str, reason: str) -> PrecisionPlan:
    """A native path the cell cannot take: format.backend=native is refused with `refusal`; auto emulates, saying
    `reason`."""
    if plan.config.backend == "native":
        raise PrecisionError(refusal)
    return replace(plan, native=False, why=reason, torchao_recipe=None, native_recipe=None)


def plan(config: PrecisionConfig, method: ScalingMethod, device: torch.device) -> PrecisionPlan:
    """The cell's precision on `device` (see the module docstring)."""
    made = _plan(config, method, device)
    return replace(made, elsewhere_emulated=elsewhere_emulated(made, device))


def elsewhere_emulated(made: PrecisionPlan, device: torch.device) -> str | None:
    """Why format.elsewhere=bf16's autocast GEMMs are emulated on `device` (None: they run natively): on a CPU
    whose BF16 kernels are not fast (no BF16 units), where they cost more than the format's whole emulation."""
    if made.elsewhere != "bf16" or device.type != "cpu":
        return None
    support = native_support("bf16", device)
    if support.fast:
        return None
    return f"{support.why}: autocast's BF16 convolutions and matmuls emulated in FP32 (bench/numerics/autocast.py)"


def _plan(config: PrecisionConfig, method: ScalingMethod, device: torch.device) -> PrecisionPlan:
    spec = config.spec
    support = native_support(config.format, device)
    recipe = spec.recipe if config.gradients is None else replace(spec.recipe, grads=config.gradients)
    made = PrecisionPlan(config, method.name, native=False, why="", recipe=recipe, site_scales=method.site_scales,
                         tiles=method.tiles,
                         torchao_recipe=method.torchao_recipe if torchao_float8_spec(spec) else None,
                         native_recipe=None)
    if spec.recipe is None:  # FP32: nothing to round, native everywhere
        note = f"; scaling={method.name} does nothing here: FP32 quantises no tensor (a baseline cell)" \
            if method.site_scales else ""
        return replace(made, native=True, why=support.why + note)
    if config.backend == "native":
        if not support.available:
            raise PrecisionError(f"format.backend=native but {config.format} has no native path on {device.type}: "
                                 f"{support.why}; valid here: format.backend=auto or emulated")
        made = replace(made, native=True, why="requested: " + support.why)
    elif config.backend == "emulated":
        return replace(made, why="requested", torchao_recipe=None)
    else:
        made = replace(made, native=support.fast, why=support.why)
    if not made.native:
        return replace(made, torchao_recipe=None)
    for rule in EMULATION_RULES:
        if rule.applies(made, method):
            words = {"fmt": config.format, "method": method.name, "accumulation": config.accumulation,
                     "support": f"this device has {config.format}: {support.why}",  # not what the cell gets
                     "title": method.title or f"scaling={method.name}", "differs": ", ".join(_torchao_mx_differs(made))}
            return _emulated(made, rule.refusal.format(**words), rule.reason.format(**words))
    return replace(made, native_recipe=_native_recipe(made, method))


def blocks_of(linears: list[str], holder: str) -> list[str]:
    """The model's blocks, in order, from its Linear layers' names: the children of module `holder` (`h` -> `h.0`,
    `h.1`, ...) that hold a Linear."""
    inside = (name[len(holder) + 1:].split(".")[0] for name in linears if name.startswith(holder + "."))
    return [f"{holder}.{child}" for child in dict.fromkeys(inside)]


def kept_layers(linears: list[str], patterns: tuple[str, ...], blocks: str | None = None) -> list[str]:
    """The Linear layers (`linears`: their module names, in module order) that format.keep_high_precision keeps out
    of the format: `first:<n>`, `last:<n>`; `first_blocks:<n>`, `last_blocks:<n>`, every Linear inside the first or
    last n children of module `blocks` (the model spec's `blocks`; None: it declares none); `head`, the last Linear;
    or every name a glob matches. A pattern that keeps nothing is a mistake (a typo, a layer renamed):
    PrecisionError naming what there is."""
    kept: set[str] = set()
    for pattern in patterns:
        count = LAYER_COUNT.match(pattern)
        if count:  # the first or last n Linear layers, or n blocks (each standing for the Linears inside it)
            if count[2] and blocks is None:
                raise PrecisionError(f"format.keep_high_precision: {pattern} counts blocks, and this model declares "
                                     "none (model.task.blocks); valid: first:<n>, last:<n>, head, or a glob over "
                                     f"these: {', '.join(linears)}")
            units, what = (blocks_of(linears, blocks), "blocks") if count[2] else (linears, "Linear layers")
            n = int(count[3])
            if n > len(units):
                raise PrecisionError(f"format.keep_high_precision: {pattern} asks for {n} {what}; the model has "
                                     f"{len(units)}" + (f" ({blocks}.*)" if count[2] else ""))
            inside = units[:n] if count[1] == "first" else units[-n:]
            chosen = [name for name in linears if any(name == unit or name.startswith(unit + ".") for unit in inside)]
        elif pattern == HEAD:
            chosen = linears[-1:]
        else:
            chosen = fnmatch.filter(linears, pattern)
        if not chosen:
            raise PrecisionError(f"format.keep_high_precision: {pattern!r} matches no Linear layer; valid: first:<n>, "
                                 f"last:<n>, head, or a glob over these: {', '.join(linears)}")
        kept.update(chosen)
    return [name for name in linears if name in kept]


def torchao_float8_spec(spec: FormatSpec) -> bool:
    """Whether torchao's float8 training runs the format natively (its per-tensor, row-wise recipes)."""
    return spec.native_path == "torchao" and not spec.block


def _native_recipe(plan: PrecisionPlan, method: ScalingMethod) -> str | None:
    if _torchao_float8(plan):
        return method.native_recipe
    if plan.spec.native_path == "torchao":
        return (f"torchao MXFP8Linear (E4M3 operands, an E8M0 {plan.config.scale_mode} scale per {MX_BLOCK}, tokens "
                "zero-padded to whole blocks)")
    return None


def for_model(plan: PrecisionPlan, converts: Callable[[torch.nn.Module], bool], model: torch.nn.Module,
              ) -> PrecisionPlan:
    """The plan for `model`: a native torchao plan whose filter (`converts`) takes none of the model's layers would
    train every layer in high precision and be recorded in the format, so it is emulated (auto) or refused (native)."""
    if not (plan.native and plan.spec.native_path == "torchao") or any(converts(m) for m in model.modules()):
        return plan
    mx = bool(plan.spec.block)
    why = (f"torchao's {'MXFP8' if mx else 'float8'} training converts only Linear layers whose in and out features "
           f"are multiples of {MX_BLOCK if mx else 16}, and this model has none (a unit-scaled Linear is not one)")
    return _emulated(plan, f"format.backend=native: {why}, so nothing would run in {plan.format.upper()}; valid here: "
                           "format.backend=auto or emulated", f"{why}: emulated ({plan.why})")
