"""The accelerator a run uses: selection, which formats it runs natively (and fast), sync, peak memory.

`native_support` is the single place that says whether a format has a hardware path on a device;
the precision policy asks it to choose between native and emulated execution.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import platform
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import torch

DEVICES = ("auto", "cpu", "cuda", "xla")


def select_device(name: str) -> torch.device:
    """auto: CUDA, then XLA when torch_xla is importable, then CPU."""
    if name not in DEVICES:
        raise ValueError(f"unknown device {name!r}; valid: {', '.join(DEVICES)}")
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        name = "xla" if importlib.util.find_spec("torch_xla") else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device=cuda but no CUDA device is visible; valid here: auto, cpu")
    if name == "xla":
        import torch_xla.core.xla_model as xm

        return xm.xla_device()
    return torch.device(name)


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


def synchronize(device: torch.device) -> None:
    """Wait for queued kernels so wall-clock timings cover the work, not just its launch."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "xla":
        import torch_xla.core.xla_model as xm

        xm.mark_step()
        xm.wait_device_ops()


def end_step(device: torch.device) -> None:
    """Close a training step where the device needs it: XLA builds a graph until mark_step() launches it
    (asynchronously: no wait). Nothing elsewhere."""
    if device.type == "xla":
        import torch_xla.core.xla_model as xm

        xm.mark_step()


class StepTimer:
    """Durations of training steps without making the host wait for the device on each step.

    cuda: a pair of CUDA events around each step, read (one wait, for the last event) by `collect()`,
      which the loop calls on log steps only;
    cpu: wall clock per step (CPU kernels have finished when the call returns);
    xla: wall clock from the first step after a `collect()` to the next `collect()`, which waits for the
      device, shared equally by the steps in between (XLA runs a step's graph after mark_step, asynchronously).
    """

    METHODS = {"cuda": "cuda_events", "cpu": "wall_clock", "xla": "wall_clock_between_log_steps"}

    def __init__(self, device: torch.device):
        self.device = device
        self.method = self.METHODS.get(device.type, "wall_clock")
        self._open: list = []  # cuda: (start, end) event pairs; cpu: durations; xla: step count
        self._started: float | torch.cuda.Event | None = None
        self._interval_start: float | None = None  # xla

    def start(self) -> None:
        if self.method == "cuda_events":
            self._started = torch.cuda.Event(enable_timing=True)
            self._started.record()
        else:
            self._started = time.perf_counter()
            if self._interval_start is None:
                self._interval_start = self._started

    def stop(self) -> None:
        if self.method == "cuda_events":
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._open.append((self._started, end))
        elif self.method == "wall_clock":
            self._open.append(time.perf_counter() - self._started)
        else:
            self._open.append(None)

    def collect(self) -> list[float]:
        """Seconds of each step stopped since the last collect, in order."""
        opened, self._open = self._open, []
        if self.method == "cuda_events":
            if opened:
                opened[-1][1].synchronize()
            return [start.elapsed_time(end) / 1e3 for start, end in opened]
        if self.method == "wall_clock":
            return opened
        if not opened:
            return []
        synchronize(self.device)
        seconds, self._interval_start = time.perf_counter() - self._interval_start, None
        return [seconds / len(opened)] * len(opened)


class PeakMemory:
    """Peak memory of one run: CUDA max_memory_allocated on GPU, peak RSS (VmHWM, reset at start) on CPU."""

    def __init__(self, device: torch.device):
        self.device = device
        if device.type == "cuda":
            self.measures = "torch.cuda.max_memory_allocated (bytes of tensors on the GPU)"
        elif device.type == "cpu":
            self.measures = "peak resident set size of the whole process (VmHWM, reset at run start)"
        else:
            self.measures = "not measured on this device"

    def reset(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.device.type == "cpu":
            try:  # Linux: writing 5 to clear_refs resets the process's peak RSS
                Path("/proc/self/clear_refs").write_text("5")
            except OSError:
                self.measures = "peak resident set size of the whole process since it started (VmHWM)"

    def peak_bytes(self) -> int | None:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device)
        if self.device.type == "cpu":
            for line in Path("/proc/self/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
        return None


def _cpu_busy_seconds() -> float | None:
    """Seconds the whole machine's CPUs have been busy (not idle or waiting for I/O), from /proc/stat."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    except (OSError, ValueError, IndexError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


@functools.cache
def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


class TimingConditions:
    """What a timing was measured under, so a reader can trust it or discount it.

    Records torch's intra-op threads, the CPU model and how many cores this process may use, the 1-minute
    load average before and after, and the share of the machine's CPU time other processes used while it
    ran (from /proc/stat, minus this process's own CPU time). A timing is `disturbed` when this process's
    threads plus the cores other processes kept busy exceeded the cores there are by more than a quarter
    core: they competed for the CPU. On CUDA it adds the GPU's clocks and the other processes using it.
    """

    def __init__(self, device: torch.device):
        self.device = device

    def start(self) -> None:
        self._load = os.getloadavg()[0]
        self._busy = _cpu_busy_seconds()
        self._own = time.process_time()
        self._wall = time.perf_counter()
        self._gpu = self._gpu_state()

    def finish(self) -> dict:
        wall = time.perf_counter() - self._wall
        cores = len(os.sched_getaffinity(0))
        threads = torch.get_num_threads()
        busy = _cpu_busy_seconds()
        others = None
        if busy is not None and self._busy is not None and wall > 0:
            others = max(0.0, (busy - self._busy) - (time.process_time() - self._own)) / wall  # cores kept busy
        conditions = {
            "threads": threads, "cpu_model": _cpu_model(), "cores": cores,
            "load_before": round(self._load, 2), "load_after": round(os.getloadavg()[0], 2),
            "other_processes_cores": None if others is None else round(others, 2),
            "disturbed": others is not None and threads + others > cores + 0.25,
        }
        if self.device.type == "cuda":
            conditions["gpu_before"], conditions["gpu_after"] = self._gpu, self._gpu_state()
        return conditions

    def _gpu_state(self) -> dict | None:
        if self.device.type != "cuda":
            return None
        state = {}
        for key, read in (("clock_mhz", torch.cuda.clock_rate), ("other_processes", torch.cuda.list_gpu_processes)):
            try:  # both need pynvml; without it the record says so
                state[key] = read(self.device)
            except Exception as e:  # noqa: BLE001
                state[key] = f"unavailable ({type(e).__name__})"
        return state


def describe(device: torch.device) -> dict:
    """The environment facts every record carries."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        cc = ".".join(map(str, torch.cuda.get_device_capability(device)))
    else:
        name, cc = _cpu_model(), None
    return {
        "device_type": device.type,
        "device_name": name,
        "compute_capability": cc,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch_version": torch.__version__,
        "torchao_version": _version("torchao"),
        "cuda_version": torch.version.cuda,
        "python_version": platform.python_version(),
        "hostname": socket.gethostname(),
        "pid": os.getpid(),
        "slurm_job": slurm_job(),
        "git_commit": _git_commit(),
    }


def slurm_job() -> str | None:
    """The SLURM job running this process, as squeue and scancel name it (`<array job>_<task>` in an array)."""
    env = os.environ
    if "SLURM_ARRAY_JOB_ID" in env and "SLURM_ARRAY_TASK_ID" in env:
        return f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
    return env.get("SLURM_JOB_ID")


def _version(package: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


@functools.cache
def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).parent)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None
