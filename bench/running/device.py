"""The accelerator a run uses: selection, sync, step times, peak memory, and what a record says about it.
(Which formats it runs natively is bench/numerics/hardware.py's.)"""

from __future__ import annotations

import datetime
import fcntl
import functools
import importlib.util
import os
import platform
import re
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from bench import __version__
from bench.numerics import fused, hardware

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
        import torch_xla

        return torch_xla.device()
    return torch.device(name)


def visible_gpus() -> list[str]:
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES names them where it is set (by SLURM, by a user),
    else every device CUDA sees. An empty list on a machine without GPUs."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is None:
        return [str(i) for i in range(torch.cuda.device_count())]
    gpus = []
    for name in (part.strip() for part in listed.split(",")):
        if not name or name.startswith("-"):
            break  # CUDA stops at the first invalid entry
        gpus.append(name)
    return gpus


def parallel_jobs() -> int:
    """How many cells LAUNCHER=parallel runs side by side: BENCH_PARALLEL_JOBS where set (to pack small cells onto
    a GPU, or to leave cores free), else one per visible GPU (cells that share a GPU time each other), else one
    per core (-1, joblib's spelling)."""
    if os.environ.get("BENCH_PARALLEL_JOBS"):
        return int(os.environ["BENCH_PARALLEL_JOBS"])
    return len(visible_gpus()) or -1


_gpu_claim: tuple[int, object] | None = None  # (index among the visible GPUs, the open lock file) for life


def claim_gpu() -> int | None:
    """One of the visible GPUs for this process, for the rest of its life: the first that no other process of this
    user holds (an flock on a file in the temp directory, which the kernel releases when the process exits,
    however it exits). LAUNCHER=parallel starts one process per GPU, so each cell has a GPU to itself; a process
    reused for the next cell keeps its GPU. Returns the GPU's index among the visible ones (what cuda:<index>
    names); None without GPUs. Where every GPU is held (cells packed on purpose, BENCH_PARALLEL_JOBS), the
    process shares one, and its timings say so (TimingConditions)."""
    global _gpu_claim
    if _gpu_claim is not None:
        return _gpu_claim[0]
    gpus = visible_gpus()
    if not gpus:
        return None
    for index, gpu in enumerate(gpus):
        handle = open(Path(tempfile.gettempdir()) / f"precision-bench-gpu-{os.getuid()}-{gpu}.lock", "a")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            continue
        _gpu_claim = (index, handle)
        return index
    _gpu_claim = (os.getpid() % len(gpus), None)
    return _gpu_claim[0]


def cell_device(device: torch.device) -> torch.device:
    """The device a cell trains on: on CUDA, the GPU this process claimed (claim_gpu), made current."""
    if device.type != "cuda":
        return device
    index = claim_gpu() or 0
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


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
            shared = sorted(_other_gpu_processes(conditions["gpu_before"])
                            | _other_gpu_processes(conditions["gpu_after"]))
            conditions["gpu_shared_with"] = shared  # pids of other processes on this GPU while it trained
            conditions["disturbed"] = conditions["disturbed"] or bool(shared)
        return conditions

    def _gpu_state(self) -> dict | None:
        if self.device.type != "cuda":
            return None
        state = {}
        for key, read in (("clock_mhz", torch.cuda.clock_rate), ("other_processes", torch.cuda.list_gpu_processes)):
            try:  # both need pynvml; without it the record says so
                state[key] = read(self.device)
            except Exception as e:
                state[key] = f"unavailable ({type(e).__name__})"
        return state


def _other_gpu_processes(state: dict | None) -> set[int]:
    """Pids of processes other than this one in torch.cuda.list_gpu_processes's report ('process 123 uses ...')."""
    report = (state or {}).get("other_processes")
    if not isinstance(report, str):
        return set()
    return {int(pid) for pid in re.findall(r"process\s+(\d+)", report)} - {os.getpid()}


def describe(device: torch.device) -> dict:
    """The environment facts every record carries."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        cc = ".".join(map(str, torch.cuda.get_device_capability(device)))
    elif device.type == "xla":
        import torch_xla.core.xla_model as xm

        hardware_name = xm.xla_device_hw(device)  # TPU, CPU (PJRT_DEVICE=CPU), CUDA
        name, cc = f"XLA:{hardware_name}" + (f" ({_cpu_model()})" if hardware_name == "CPU" else ""), None
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
        "version": __version__,  # precision-bench's (CHANGELOG.md), beside the commit it ran
        "git_commit": _git_commit(),
        "git_changes": _git_changes(),  # the code ran with uncommitted changes to git_commit (None: not a checkout)
        "visible_gpus": visible_gpus(),  # CUDA_VISIBLE_DEVICES's GPUs (or all CUDA sees)
        "gpu_index": device.index if device.type == "cuda" else None,  # the one among them this cell used
        "cpu_16bit_units": hardware.cpu_16bit_units(),  # what decides whether bf16/fp16 run natively on a CPU
        "fused_quantisers": fused.enabled(),  # emulated rounding fused by inductor (the same bits, another time)
        "fused_compile": fused.compile_when() if fused.enabled() else None,  # when a layout's graph was made
        "started_at": utc_now(),
    }


def utc_now() -> str:
    """The time now, UTC, to the second, as records write it (ISO 8601)."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


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


CODE = ("bench", "conf", "hydra_plugins")  # what a run computes with: a change here is not git_commit's code


@functools.cache
def _git_changes() -> bool | None:
    """Whether the code differs from git_commit (modified or untracked files under CODE): such a record's commit is
    where its code came from, not what it ran."""
    root = Path(__file__).parents[2]
    try:
        out = subprocess.run(["git", "status", "--porcelain", "--", *CODE], capture_output=True, text=True, timeout=5,
                             cwd=root)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return bool(out.stdout.strip()) if out.returncode == 0 else None


@functools.cache
def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).parent)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None
