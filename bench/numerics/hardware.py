"""What a device runs natively, and whether that is fast: one function per format, which the format's spec names
(bench/numerics/specs.py). The precision policy asks `specs.native_support` to choose between native and emulated
execution; `python -m bench.tools.matrix` asks it on simulated devices (by patching the probes here).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import torch

CPU_16BIT_UNITS = ("avx512_bf16", "amx_bf16", "avx512_fp16", "amx_fp16")


def cpu_16bit_units() -> list[str]:
    """The CPU's bf16/fp16 instruction sets (of CPU_16BIT_UNITS): what makes a 16-bit row native and fast on it."""
    return sorted(_cpu_flags() & set(CPU_16BIT_UNITS))


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


def fp32_support(device: torch.device) -> NativeSupport:
    return NativeSupport(True, True, "FP32 is native everywhere")


def _cuda_support(device: torch.device, need: tuple[int, int], slowly_below: bool = False,
                  needs_torchao: bool = False) -> NativeSupport:
    """Native and fast from compute capability `need`; below it still native but slow where `slowly_below` (older
    GPUs run 16-bit kernels without the tensor cores that make them fast)."""
    cc = torch.cuda.get_device_capability(device)
    has = cc >= need
    why = f"compute capability {cc[0]}.{cc[1]} {'>=' if has else '<'} {need[0]}.{need[1]}"
    if needs_torchao and has and not torchao_available():
        return NativeSupport(False, False, why + ", but torchao is not installed (pip install '.[fp8-gpu]')")
    return NativeSupport(has or slowly_below, has, why)


def _no_compute_path(fmt: str, device: torch.device) -> NativeSupport:
    return NativeSupport(False, False, f"torch has no {fmt} compute path on {device.type}")


def _xla_support(fmt: str) -> NativeSupport:
    return NativeSupport(fmt == "bf16", fmt == "bf16", "XLA devices (TPUs) compute natively in bf16 only")


def tf32_support(device: torch.device) -> NativeSupport:
    if device.type == "cuda":
        return _cuda_support(device, (8, 0))
    return _xla_support("tf32") if device.type == "xla" else _no_compute_path("tf32", device)


def fp16_support(device: torch.device) -> NativeSupport:
    if device.type == "cuda":
        return _cuda_support(device, (7, 0), slowly_below=True)
    if device.type == "xla":
        return _xla_support("fp16")
    # Measured: even with avx512_fp16/amx_fp16, torch's CPU fp16 autocast ran LeNet at 113 ms a step against
    # 11 ms emulated (and 3.4x slower than emulation on a CPU without those units): never fast on CPU.
    has = "has" if _cpu_flags() & {"avx512_fp16", "amx_fp16"} else "lacks"
    return NativeSupport(True, False, f"torch's CPU fp16 kernels are slower than emulating fp16 in FP32 "
                                      f"(measured; the CPU {has} avx512_fp16/amx_fp16)")


def bf16_support(device: torch.device) -> NativeSupport:
    if device.type == "cuda":
        return _cuda_support(device, (8, 0), slowly_below=True)
    if device.type == "xla":
        return _xla_support("bf16")
    fast = bool(_cpu_flags() & {"avx512_bf16", "amx_bf16"})
    why = f"CPU {'has' if fast else 'lacks'} amx_bf16/avx512_bf16; torch has CPU bf16 kernels"
    return NativeSupport(True, fast, why)


def fp8_support(device: torch.device) -> NativeSupport:
    if device.type == "cuda":
        return _cuda_support(device, (8, 9), needs_torchao=True)
    return _xla_support("fp8") if device.type == "xla" else _no_compute_path("fp8", device)


def emulated_everywhere(why: str):
    """The native-support function of a format no device runs natively (`why` says so)."""
    return lambda device: NativeSupport(False, False, why)


def mxfp8_support(device: torch.device) -> NativeSupport:
    """MX GEMMs are native on CUDA compute capability >= 10.0; of the MX training recipes, torchao 0.18 has
    MXFP8's as a Linear (MXFP8Linear). FP6/FP4 MX training it has not, and its NVFP4 recipe is another one."""
    if device.type != "cuda":
        return NativeSupport(False, False, f"MXFP8 GEMMs are native on CUDA compute capability >= 10.0, not on "
                                           f"{device.type}")
    cc = torch.cuda.get_device_capability(device)
    why = f"compute capability {cc[0]}.{cc[1]} {'>=' if cc >= (10, 0) else '<'} 10.0"
    if cc >= (10, 0) and not torchao_mxfp8_available():
        return NativeSupport(False, False, why + ", but torchao has no MXFP8Linear (pip install '.[fp8-gpu]', "
                                                 "torchao >= 0.18)")
    return NativeSupport(cc >= (10, 0), cc >= (10, 0), why + (" (torchao MXFP8Linear)" if cc >= (10, 0) else ""))


@contextlib.contextmanager
def simulated(kind: str, cpu_flags=(), capability: tuple[int, int] | None = None, torchao: bool = False):
    """Within the block, this module's probes answer as a device of `kind` (cpu | cuda | xla) with these CPU flags,
    CUDA compute capability and torchao would: what the device matrix (bench/tools/matrix.py) and the speed model's
    "the path the runner would take on that GPU" ask. Yields its torch.device."""
    with mock.patch(f"{__name__}._cpu_flags", lambda: frozenset(cpu_flags)), \
            mock.patch(f"{__name__}.torchao_available", lambda: torchao), \
            mock.patch(f"{__name__}.torchao_mxfp8_available", lambda: torchao), \
            mock.patch.object(torch.cuda, "is_available", lambda: kind == "cuda"), \
            mock.patch.object(torch.cuda, "get_device_capability", lambda *_: capability):
        yield torch.device(kind)
