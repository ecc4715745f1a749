"""The native paths' configuration: torchao's float8 and MXFP8 training (which recipe, which Linear layers they
convert, the kernels). The precision policy (precision.py) decides when a run takes them."""

from __future__ import annotations

import functools
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from bench.numerics.blocks import MX_BLOCK


def torchao_float8_config(recipe: str = "tensorwise"):
    """A native FP8 recipe: torchao's float8 training by its recipe name (a scaling method's `torchao_recipe`:
    tensorwise, rowwise, rowwise_with_gw_hp); tests run them with emulate=True on CPU.

    pad_inner_dim: torch._scaled_mm needs every GEMM's inner dimension to be a multiple of 16. The module
    filter (`torchao_converts`) guarantees it for the forward and input-gradient GEMMs; the weight-gradient GEMM
    reduces over the batch's tokens, which no filter can know (a classifier head sees one token per example,
    dynamic padding varies the rest), so torchao zero-pads it: exact, the amax and the sums are unchanged."""
    from torchao.float8 import Float8LinearConfig

    return replace(Float8LinearConfig.from_recipe_name(recipe), pad_inner_dim=True)


def torchao_converts(module: nn.Module, name: str = "") -> bool:
    """torchao's float8 training converts a Linear whose in and out features are multiples of 16 (its GEMM
    kernels' constraint on the dimensions a layer fixes); other layers stay in high precision."""
    return type(module) is nn.Linear and module.in_features % 16 == 0 and module.out_features % 16 == 0


# torchao's MXFP8 training (MXFP8Linear, compute capability >= 10.0): E4M3 for every operand, gradients too, blocks of
# 32 along each GEMM's reduction dimension, the E8M0 scale by rceil (its default) or floor, rounded to nearest.
TORCHAO_MXFP8 = {"gradients": "fp8_e4m3", "scale_modes": ("rceil", "floor"), "rounding": "nearest"}


def torchao_mx_converts(module: nn.Module, name: str = "") -> bool:
    """A Linear whose in and out features are whole MX blocks: its forward and input-gradient GEMMs block along
    them, and torchao's MX casts take whole blocks only."""
    return type(module) is nn.Linear and module.in_features % MX_BLOCK == 0 and module.out_features % MX_BLOCK == 0


def torchao_mx_kernel():
    """The kernels a native MXFP8 Linear runs: torchao's best for the GPU (tests take its EMULATED ones on CPU)."""
    from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

    return KernelPreference.AUTO


def cast_input_as_autocast_does(module: nn.Module, args: tuple) -> tuple | None:
    """Forward pre-hook of a converted Linear: its input in the autocast dtype of its device, as F.linear under
    autocast takes it (format.elsewhere=bf16). torchao's Float8Linear does this for CUDA's autocast only and its
    MXFP8Linear not at all, so on another device, or in MXFP8, the input came in the dtype of whatever op wrote it
    and a high-precision GEMM met an operand in another dtype ("expected m1 and m2 to have the same dtype")."""
    x, *rest = args
    if torch.is_tensor(x) and x.is_floating_point() and torch.is_autocast_enabled(x.device.type):
        return (x.to(torch.get_autocast_dtype(x.device.type)), *rest)
    return None


@functools.cache
def padded_mxfp8_linear() -> type:
    """torchao's MXFP8Linear with the tokens zero-padded to whole blocks of 32.

    Its weight-gradient GEMM blocks along the tokens and asserts whole blocks ("the last dimension ... must be
    divisible by block_size 32"): a classifier head sees one token per example, and a batch's token count is
    anybody's. Zero rows change no block's amax and add nothing to a sum, and their outputs are dropped: exact.
    The module, not the torchao weight-wrapper config (MXFP8TrainingOpConfig), because the wrapper drops the bias
    of F.linear (pytorch/ao#4846, open in 0.18)."""
    from torchao.prototype.moe_training.mxfp8_linear import MXFP8Linear

    class PaddedMXFP8Linear(MXFP8Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            tokens = x.reshape(-1, x.shape[-1])
            padded = F.pad(tokens, (0, 0, 0, -len(tokens) % MX_BLOCK))
            return super().forward(padded)[:len(tokens)].reshape(*x.shape[:-1], -1)

    return PaddedMXFP8Linear
