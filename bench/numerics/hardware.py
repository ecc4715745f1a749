"""Which formats a device runs natively, and whether that is fast: the single place that says so.

The precision policy (bench/numerics/precision.py) asks `native_support` to choose between native and emulated
execution; `python -m bench.tools.matrix` asks it on simulated devices.
"""

from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass
from pathlib import Path

import torch


@functools.cache
def _cpu_flags() -> frozenset[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def torchao_available() -> bool:
    """torchao runs native FP8 training on CUDA (`make setup` installs it where there is a GPU)."""
    return importlib.util.find_spec("torchao") is not None


def torchao_mxfp8_available() -> bool:
    """torchao's MXFP8 training Linear (torchao >= 0.18; earlier ones kept MX training elsewhere)."""
    return torchao_available() and importlib.util.find_spec("torchao.prototype.moe_training") is not None and \
        importlib.util.find_spec("torchao.prototype.moe_training.mxfp8_linear") is not None


@dataclass(frozen=True)
class NativeSupport:
    available: bool  # the device can run the format natively at all
    fast: bool  # ...and faster than emulating it in FP32
    why: str


BLOCK_FORMATS = ("mxfp8", "mxfp6", "mxfp4", "nvfp4")


def native_support(fmt: str, device: torch.device) -> NativeSupport:
    """Whether `fmt` (fp32, tf32, fp16, bf16, fp8, or a block format) runs natively on `device`, and whether that
    is fast."""
    if fmt == "fp32":
        return NativeSupport(True, True, "FP32 is native everywhere")
    if fmt in BLOCK_FORMATS:
        return _block_format_support(fmt, device)
    if device.type == "cuda":
        cc = torch.cuda.get_device_capability(device)
        need = {"tf32": (8, 0), "fp16": (7, 0), "bf16": (8, 0), "fp8": (8, 9)}[fmt]
        has = cc >= need
        why = f"compute capability {cc[0]}.{cc[1]} {'>=' if has else '<'} {need[0]}.{need[1]}"
        if fmt == "fp8" and has and not torchao_available():
            return NativeSupport(False, False, why + ", but torchao is not installed (pip install '.[fp8-gpu]')")
        available = has or fmt in ("fp16", "bf16")  # older GPUs still run 16-bit kernels, slowly
        return NativeSupport(available, has, why)
    if device.type == "xla":
        return NativeSupport(fmt == "bf16", fmt == "bf16", "XLA devices (TPUs) compute natively in bf16 only")
    if fmt == "fp16":
        # Measured: even with avx512_fp16/amx_fp16, torch's CPU fp16 autocast ran LeNet at 113 ms a step against
        # 11 ms emulated (and 3.4x slower than emulation on a CPU without those units): never fast on CPU.
        has = "has" if _cpu_flags() & {"avx512_fp16", "amx_fp16"} else "lacks"
        return NativeSupport(True, False, f"torch's CPU fp16 kernels are slower than emulating fp16 in FP32 "
                                          f"(measured; the CPU {has} avx512_fp16/amx_fp16)")
    if fmt == "bf16":
        fast = bool(_cpu_flags() & {"avx512_bf16", "amx_bf16"})
        why = f"CPU {'has' if fast else 'lacks'} amx_bf16/avx512_bf16; torch has CPU bf16 kernels"
        return NativeSupport(True, fast, why)
    return NativeSupport(False, False, f"torch has no {fmt} compute path on {device.type}")


def _block_format_support(fmt: str, device: torch.device) -> NativeSupport:
    """MX and NVFP4 GEMMs are native on CUDA compute capability >= 10.0; of their training recipes, torchao 0.18
    has MXFP8's as a Linear (MXFP8Linear). Its NVFP4 recipe is another one (a random Hadamard transform, BF16,
    every dimension a multiple of 128), and FP6/FP4 MX training it has not."""
    if fmt != "mxfp8":
        why = ("torchao's NVFP4 training is a recipe of its own (random Hadamard transform, BF16 operands, dimensions "
               "multiples of 128), not this one" if fmt == "nvfp4" else f"torchao has no {fmt} training path")
        return NativeSupport(False, False, f"{fmt} is emulated on every device: {why}")
    if device.type != "cuda":
        return NativeSupport(False, False, f"MXFP8 GEMMs are native on CUDA compute capability >= 10.0, not on "
                                           f"{device.type}")
    cc = torch.cuda.get_device_capability(device)
    why = f"compute capability {cc[0]}.{cc[1]} {'>=' if cc >= (10, 0) else '<'} 10.0"
    if cc >= (10, 0) and not torchao_mxfp8_available():
        return NativeSupport(False, False, why + ", but torchao has no MXFP8Linear (pip install '.[fp8-gpu]', "
                                                 "torchao >= 0.18)")
    return NativeSupport(cc >= (10, 0), cc >= (10, 0), why + (" (torchao MXFP8Linear)" if cc >= (10, 0) else ""))
