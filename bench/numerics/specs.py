"""Every training format, declared once: config validation, the precision policy, the device matrix and the
tables' order all read `FORMAT_SPECS`. Adding a format is one `register(FormatSpec(...))` (with its element
formats in bench/numerics/formats.py's FORMATS) and one yaml, conf/format/<name>.yaml; docs/extending.md shows how.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from typing import Callable

import torch

from bench.errors import ConfigError
from bench.numerics import hardware
from bench.numerics.formats import FORMATS
from bench.numerics.hardware import NativeSupport

MODES = ("mixed", "true")  # FP32 master weights (Lightning's 16-mixed), or the whole model cast (16-true)
# format.elsewhere: what may run outside the GEMMs of a gemm_only format (torchao, Transformer Engine and DeepSeek-V3
# train FP8 with BF16 autocast there)
ELSEWHERE = ("fp32", "bf16")


@dataclass(frozen=True)
class Recipe:
    """Element formats an emulated matmul/conv rounds to (names in bench/numerics/formats.py's FORMATS)."""

    inputs: str  # activations and weights entering the op (forward)
    grads: str  # gradients entering the op's backward
    sixteen_bit_kernel: bool  # output, bias and returned gradients are rounded to `inputs` too (a 16-bit GEMM's)
    block: str | None = None  # "mx" or "nvfp4": block-scaled GEMM operands (bench/numerics/blocks.py)


@dataclass(frozen=True)
class FormatSpec:
    """One training format: `format.name`, the modes it runs in, what an emulated op rounds to, what tables call it,
    and which devices run it natively. docs/extending.md ("Bring your own format") documents every field."""

    name: str  # format.name, and the yaml's name in conf/format/
    modes: tuple[str, ...]  # among MODES: mixed (FP32 master weights), true (the whole model cast)
    recipe: Recipe | None  # None: nothing rounds (FP32)
    native: Callable[[torch.device], NativeSupport]  # which devices run it natively, and whether that is fast
    setting_names: tuple[str, ...] = ()  # the tables' name per mode, as `modes`; () = `<name>-<mode>`
    torch_dtype: torch.dtype | None = None  # where native: autocast's dtype (mixed), the model's (true)
    gradient_elements: tuple[str, ...] = ()  # format.gradients choices (null keeps the recipe's)
    stochastic_rounding: bool = False  # format.rounding=stochastic applies (to the gradients entering the backward)
    tile_scalings: bool = False  # the scaling methods with FP8 scales per row or tile apply (scaling_methods.py)
    native_path: str = "torch"  # where native: "torch" (autocast or the model cast; no per-tensor scales) or "torchao"
    gemm_only: bool = False  # only the GEMM operands are in the format: the rest is a choice (format.elsewhere)
    declared_in: str = ""  # the module that registered it (set by `register`): records name it, messages too

    def setting(self, mode: str) -> str:
        """Lightning-style name of the precision setting: 32-true, tf32, 16-mixed, bf16-true, fp8-mixed."""
        return self.setting_names[self.modes.index(mode)] if self.setting_names else f"{self.name}-{mode}"

    @property
    def block(self) -> str | None:
        return self.recipe.block if self.recipe else None



FORMAT_SPECS: dict[str, FormatSpec] = {}


def register(spec: FormatSpec) -> FormatSpec:
    """Declare a training format (a user's in a plug-in module: docs/extending.md). Its recipe's element formats must
    be registered first (bench.formats.register_element)."""
    if not set(spec.modes) <= set(MODES) or (spec.setting_names and len(spec.setting_names) != len(spec.modes)):
        raise ValueError(f"{spec.name}: modes must be among {MODES}, with one setting name each")
    if spec.recipe and (unknown := [e for e in (spec.recipe.inputs, spec.recipe.grads, *spec.gradient_elements)
                                    if e not in FORMATS]):
        raise ValueError(f"format {spec.name}: element format {unknown[0]!r} is not registered (register it first with "
                         f"bench.formats.register_element); registered: {', '.join(FORMATS)}")
    if not spec.declared_in:
        spec = dataclasses.replace(spec, declared_in=sys._getframe(1).f_globals.get("__name__", ""))
    taken = FORMAT_SPECS.get(spec.name)
    if taken is not None and taken.declared_in != spec.declared_in:  # the same module again (a re-import) replaces it
        raise ValueError(f"format {spec.name!r} is already declared (in {taken.declared_in or 'bench'}): a format of "
                         f"your own takes a name of its own; taken: {', '.join(FORMAT_SPECS)}")
    FORMAT_SPECS[spec.name] = spec
    return spec


def format_spec(name: str) -> FormatSpec:
    try:
        return FORMAT_SPECS[name]
    except KeyError:
        raise ConfigError(f"format={name!r} is not valid; valid: {', '.join(FORMAT_SPECS)}") from None


def native_support(fmt: str, device: torch.device) -> NativeSupport:
    """Whether `fmt` runs natively on `device`, and whether that is fast."""
    return format_spec(fmt).native(device)


def settings_in_order() -> list[str]:
    """Every setting name, in the order formats were registered: the tables' row order."""
    return [spec.setting(mode) for spec in FORMAT_SPECS.values() for mode in spec.modes]


def block_formats() -> list[str]:
    return [name for name, spec in FORMAT_SPECS.items() if spec.block]


def stochastic_formats() -> list[str]:
    return [name for name, spec in FORMAT_SPECS.items() if spec.stochastic_rounding]


register(FormatSpec("fp32", ("true",), None, hardware.fp32_support, ("32-true",)))
register(FormatSpec("tf32", ("true",), Recipe("tf32", "tf32", False), hardware.tf32_support, ("tf32",)))
register(FormatSpec("fp16", MODES, Recipe("fp16", "fp16", True), hardware.fp16_support, ("16-mixed", "16-true"),
                    torch.float16))
register(FormatSpec("bf16", MODES, Recipe("bf16", "bf16", True), hardware.bf16_support, ("bf16-mixed", "bf16-true"),
                    torch.bfloat16))
register(FormatSpec("fp8", ("mixed",), Recipe("fp8_e4m3", "fp8_e5m2", False), hardware.fp8_support,
                    stochastic_rounding=True, tile_scalings=True, native_path="torchao", gemm_only=True))
# The MX paper's training recipes (Rouhani et al. 2023): E4M3 / E5M2, E2M3 / E3M2, E2M1 throughout. torchao's and
# Transformer Engine's MXFP8 recipes take E4M3 gradients (format.gradients=fp8_e4m3).
_NO_MX_TRAINING = "emulated on every device: torchao has no {} training path"
register(FormatSpec("mxfp8", ("mixed",), Recipe("fp8_e4m3", "fp8_e5m2", False, "mx"), hardware.mxfp8_support,
                    gradient_elements=("fp8_e4m3", "fp8_e5m2"), stochastic_rounding=True, native_path="torchao",
                    gemm_only=True))
register(FormatSpec("mxfp6", ("mixed",), Recipe("fp6_e2m3", "fp6_e3m2", False, "mx"),
                    hardware.emulated_everywhere("mxfp6 is " + _NO_MX_TRAINING.format("mxfp6")),
                    gradient_elements=("fp6_e2m3", "fp6_e3m2"), stochastic_rounding=True, gemm_only=True))
register(FormatSpec("mxfp4", ("mixed",), Recipe("fp4_e2m1", "fp4_e2m1", False, "mx"),
                    hardware.emulated_everywhere("mxfp4 is " + _NO_MX_TRAINING.format("mxfp4")),
                    stochastic_rounding=True, gemm_only=True))
_NVFP4 = register(FormatSpec("nvfp4", ("mixed",), Recipe("fp4_e2m1", "fp4_e2m1", False, "nvfp4"),
                             hardware.emulated_everywhere(
                                 "nvfp4 is emulated on every device: native NVFP4 training (Transformer Engine's "
                                 "NVFP4BlockScaling, torchao's prototype) is not wired in"),
                             stochastic_rounding=True, gemm_only=True))
# NVIDIA's whole recipe as a preset: the same element formats; conf/format/nvfp4_recipe.yaml turns every switch on
register(dataclasses.replace(_NVFP4, name="nvfp4_recipe", declared_in=""))
