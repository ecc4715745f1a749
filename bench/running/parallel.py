"""Cells bigger than one device: data-parallel training through DDP or FSDP2, with the precision of the
communication part of the answer (`parallel.*`; conf/parallel/).

One cell is one job of `parallel.world_size` ranks on this machine, started by torch's elastic launcher (the engine
behind torchrun: `torch.distributed.launcher.api.elastic_launch`), or, in a SLURM job of as many tasks, one rank per
task (`as_slurm_task`); gloo on CPU and NCCL on CUDA, one thread per rank unless `threads` says otherwise. Every
rank builds the same cell (same seed, same batches) and trains on its contiguous share of each batch (`shard`), so
the global batch is the one-device cell's, and the wrapper averages the gradients over the ranks:
- ddp: DistributedDataParallel. `parallel.gradient_compression` (none | bf16 | fp16) reduces its gradient buckets in
  that type through a communication hook (`reduce_in`): torch's fp16_compress_hook's arithmetic, under a name DDP
  does not refuse on CPU (it refuses `bf16_compress_hook` by name without NCCL);
- fsdp2: `fully_shard` on each block of the model's `blocks` (where it declares them), then on the whole model
  (torchtitan's pattern), with FSDP2's MixedPrecisionPolicy(`parallel.param_dtype`, `parallel.reduce_dtype`).
Rank 0 writes the record; its `parallel` section holds the world size, the communication keys, each rank's peak
memory and the bytes each kind of collective carried in the first step (`CollectiveBytes`). A rank that fails (killed,
crashed, its training failed, a collective timed out: `collective_timeout`) ends the job: the launcher stops the
other ranks and the cell is recorded as failed (`JobFailed`), rank 0's record where it wrote one.

Checkpoints go through torch.distributed.checkpoint (bench.running.checkpoint.DistributedCheckpointer): a pre-empted
cell resumes bit for bit, and at another world size from its sibling cell's checkpoint (`any_world_size`).

Scaling methods, BF16 master weights and low-bit optimiser states run under both wrappers (the loss scaler agrees
on a skipped step over the ranks; FSDP2's new parameters keep what was keyed by or attached to the old: `wrap`).
`parallel.fp8_all_gather` gathers torchao's float8 weights in FP8 (FSDP2, format=fp8 scaling=per_tensor, natively:
bench.numerics.precision's `gather_in_fp8`). Compiled (train.compile), a distributed cell compiles each of its blocks
before it is wrapped (`wrap`). Not yet (#54), refused by name before anything starts: XLA.
bench.predict prices a rank's step with its collectives and its memory (bench.speed.model.collectives,
rank_memory); a record's own predictions are one device's step of the whole batch.
"""

from __future__ import annotations

import datetime as dt
import logging
import multiprocessing
import os
import signal
import time
from collections import Counter
from dataclasses import dataclass

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from torch.distributed.elastic.multiprocessing.errors import record
from torch.utils._python_dispatch import TorchDispatchMode

from bench.errors import ConfigError
from bench.numerics.formats import FORMATS
from bench.numerics.plan import torchao_float8_spec
from bench.numerics.scaling_methods import scaling_class
from bench.numerics.specs import FORMAT_SPECS
from bench.running.compile import BACKEND, MODE
from bench.tasks.base import block_of

log = logging.getLogger(__name__)

WRAPPERS = ("none", "ddp", "fsdp2")
# what may travel between ranks: the registered element formats torch holds in 16 bits or more (fp32, fp16, bf16)
COMMUNICATED = {name: spec.torch_dtype for name, spec in FORMATS.items()
                if spec.torch_dtype is not None and spec.storage_bytes >= 2}
COMPRESSIONS = ("none", *(name for name in COMMUNICATED if COMMUNICATED[name] != torch.float32))  # DDP's hook


@dataclass(frozen=True)
class Ranks:
    """This process's place in its cell's job: (0, 1) outside one."""

    rank: int = 0
    world_size: int = 1
    distributed: bool = False  # in a job's process group, whatever its size (one rank of DDP is still DDP's)

    @classmethod
    def current(cls) -> "Ranks":
        if dist.is_available() and dist.is_initialized():
            return cls(dist.get_rank(), dist.get_world_size(), distributed=True)
        return cls()

    @property
    def writes(self) -> bool:
        """Whether this process writes the cell's files (record, metrics, logs): rank 0 only."""
        return self.rank == 0


def wanted(cfg: DictConfig) -> bool:
    """Whether the cell trains on more than one process (`parallel` other than none)."""
    return cfg.get("parallel") is not None and cfg.parallel.name != "none"


def check(cfg: DictConfig) -> None:
    """The parallel keys and what they combine with (ConfigError naming the valid choices)."""
    p = cfg.get("parallel")
    if p is None:
        return
    if p.name not in WRAPPERS:
        raise ConfigError(f"parallel={p.name!r} is not valid; valid: {', '.join(WRAPPERS)}")
    if p.world_size < 1:
        raise ConfigError(f"parallel.world_size={p.world_size}: a job has one rank or more (valid: 1, 2, ...)")
    if p.name == "none" and p.world_size != 1:
        raise ConfigError(f"parallel.world_size={p.world_size}: parallel=none trains on one device (world_size 1); "
                          "parallel=ddp or parallel=fsdp2 for more")
    for key in ("param_dtype", "reduce_dtype"):
        if p[key] not in COMMUNICATED:
            raise ConfigError(f"parallel.{key}={p[key]!r} is not valid; valid: {', '.join(COMMUNICATED)}")
        if p.name != "fsdp2" and p[key] != "fp32":
            raise ConfigError(f"parallel.{key} is FSDP2's mixed-precision policy: valid with parallel=fsdp2 (under "
                              f"parallel={p.name}: fp32)")
    if p.gradient_compression not in COMPRESSIONS:
        raise ConfigError(f"parallel.gradient_compression={p.gradient_compression!r} is not valid; valid: "
                          f"{', '.join(COMPRESSIONS)}")
    if p.name != "ddp" and p.gradient_compression != "none":
        raise ConfigError("parallel.gradient_compression is DDP's communication hook: valid with parallel=ddp "
                          "(parallel.reduce_dtype is FSDP2's)")
    if p.fp8_all_gather:
        if p.name != "fsdp2":
            raise ConfigError("parallel.fp8_all_gather is FSDP2's all-gather of torchao's float8 weights: valid with "
                              f"parallel=fsdp2 (under parallel={p.name}: false)")
        spec = FORMAT_SPECS.get(cfg.format.name)
        if spec is None or not torchao_float8_spec(spec) or scaling_class(cfg.scaling.name).torchao_recipe != \
                "tensorwise":
            raise ConfigError("parallel.fp8_all_gather gathers the weights as torchao's tensorwise recipe casts them: "
                              f"valid with format=fp8 scaling=per_tensor (this cell: format={cfg.format.name} "
                              f"scaling={cfg.scaling.name})")
    if p.name == "none":
        return
    batch = cfg.model.get("batch_size")
    if isinstance(batch, int) and batch % p.world_size:  # a rank's share short or empty: its mean weighs as much
        raise ConfigError(f"parallel.world_size={p.world_size} does not split model.batch_size={batch} into equal "
                          "shares, so the ranks' averaged losses and gradients would not be the whole batch's; valid "
                          f"world sizes for it: {', '.join(str(n) for n in range(1, batch + 1) if batch % n == 0)}")
    if cfg.device == "xla":
        raise ConfigError(f"parallel={p.name} does not run with device=xla yet (#54); a distributed cell runs on CPU "
                          "or CUDA")
    if cfg.train.get("compile") is True and not cfg.model.task.get("blocks"):
        raise ConfigError(f"train.compile=true under parallel={p.name} compiles the model's blocks one by one, and "
                          f"this model declares none (model.task.blocks); valid: train.compile=false or auto")


def any_world_size(config: dict) -> str:
    """The run's identity with its world size left out: a checkpoint of it resumes at any world size (DCP reshards)."""
    from bench.running.identity import run_id

    return run_id(config | {"parallel": config["parallel"] | {"world_size": 1}})


class JobFailed(Exception):
    """A rank of a cell's job failed (killed, crashed, or its training failed: a collective that timed out, say):
    the launcher stopped the others; the message says which rank (`first_rank`, the first to fail), how, and its
    error where it left one."""

    def __init__(self, summary: str, first_rank: int):
        super().__init__(summary)
        self.first_rank = first_rank


COLLECTIVE_TIMEOUT = dt.timedelta(minutes=10)  # a collective a rank waits on longer than this fails the job
TIMEOUT_VARIABLE = "PRECISION_BENCH_COLLECTIVE_TIMEOUT_S"  # seconds, instead (a test's few; a slow disk's more)


def launch(cfg: DictConfig, config: dict, train_rank) -> dict:
    """Run the cell as a job of `parallel.world_size` ranks here (torch's elastic launcher, standalone rendezvous),
    each `rank(cfg, config, train_rank)`, and return rank 0's record; JobFailed where a rank failed (the launcher
    has then stopped every rank). `train_rank(cfg, config, device, precision)` (bench.running.run's, a
    module-level function: the ranks unpickle it) trains the cell on a rank."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if (crowded := oversubscribed(cfg)) is not None:
        log.warning("%s: %s", cfg.cell, crowded)
    if cfg.parallel.world_size == 1:  # `parallel.name=ddp` keeps the none group's world size: said, not refused
        log.warning("%s: parallel.name=%s with parallel.world_size=1 is a job of one rank, wrapped (the config group "
                    "parallel=%s brings its own world size, conf/parallel/%s.yaml; parallel.world_size=N sets any)",
                    cfg.cell, cfg.parallel.name, cfg.parallel.name, cfg.parallel.name)
    multiprocessing.set_forkserver_preload(PRELOADED)
    job = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=cfg.parallel.world_size, run_id=f"bench-{os.getpid()}",
                       rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0, monitor_interval=0.1,
                       start_method="forkserver")
    launched_from = Launcher(dict(os.environ), os.getcwd())
    try:
        results = elastic_launch(job, rank)(OmegaConf.to_yaml(cfg, resolve=True), config, train_rank, launched_from)
    except ChildFailedError as e:
        if (refusal := _refusal(e)) is not None:
            raise ConfigError(refusal) from None
        raise JobFailed(failure_summary(e, cfg.parallel.world_size), first_failure(e)[0]) from None
    except SignalException as e:  # the launcher passed it to the ranks, which saved a checkpoint at a step boundary
        if e.sigval == signal.SIGINT:
            raise KeyboardInterrupt from None  # bench.run's "interrupted: ... run the same command again"
        raise SystemExit(128 + e.sigval) from None  # pre-empted: the next launch resumes
    return results[0]


def oversubscribed(cfg: DictConfig, cores: int | None = None) -> str | None:
    """A warning where a CPU cell's ranks want more cores than this machine gives the process (each rank `threads`
    of them): it runs, slower, and its timings are of ranks sharing cores. Not a refusal: a reduction's arithmetic
    does not depend on it, and a sweep's cells are checked where it starts, not where they run."""
    from bench.running.device import select_device

    cores = cores or len(os.sched_getaffinity(0))
    wanted = cfg.parallel.world_size * (cfg.threads or 1)
    if select_device(cfg.device).type != "cpu" or wanted <= cores:
        return None
    return (f"parallel.world_size={cfg.parallel.world_size} ranks of threads={cfg.threads or 1} want {wanted} cores; "
            f"this machine gives {cores}: the ranks share cores (slower; step times of shared cores)")


def _error_lines(failure) -> list[str]:
    """The lines of the error file a failed rank's `record` wrote (none after a signal)."""
    message = failure.message if isinstance(failure.message, str) else (failure.message or {}).get("message", "")
    return str(message).splitlines()


def _refusal(error) -> str | None:
    """The ConfigError a rank refused the cell with (RankRefused, the last line of its error file), or None."""
    said = f"{RankRefused.__name__}: "  # as the error file names it (with its module or without)
    return next((line.split(said, 1)[1].strip() for line in reversed(_error_lines(error.get_first_failure()[1]))
                 if said in line), None)


# How a rank can end because another one vanished: a crash inside gloo's or NCCL's handling of the closed connection
# (seen: rank 0 SIGSEGV within a tenth of a second of rank 1's SIGKILL), or its collective's error (LOST_PEER).
CRASH_SIGNALS = frozenset({signal.SIGSEGV, signal.SIGBUS, signal.SIGABRT})


def first_failure(error) -> tuple[int, object]:
    """The rank whose end caused the job's (torch's ChildFailedError), and its ProcessFailure. torch's own choice
    (`get_first_failure`) takes the earliest timestamp, in whole seconds, and a signal's end is stamped when the
    launcher saw it, so two ranks found dead in one of its checks tie and the lower rank wins: a rank that crashed
    because its peer was killed was named as the cause. Among ranks ending in the same second, an end of its own
    (a signal from outside, its error) comes before a crash and a crash before a lost peer's error."""
    def consequence(failure) -> int:
        if failure.exitcode < 0:
            return int(-failure.exitcode in CRASH_SIGNALS)
        return 2 if any(words in line for line in _error_lines(failure) for words in LOST_PEER) else 0

    return min(error.failures.items(), key=lambda item: (item[1].timestamp, consequence(item[1]), item[0]))


def _how_it_ended(failure) -> str:
    """'was killed by SIGKILL' or 'exited with code 1', and its error's last line, a collective's timeout named."""
    if failure.exitcode < 0:
        return f"was killed by {failure.signal_name()}"
    last = next((line.strip() for line in reversed(_error_lines(failure)) if line.strip()), "")
    if "timed out" in last.lower() or "timeout" in last.lower():
        last = f"a collective timed out (after {collective_timeout().total_seconds():g} s): {last}"
    said = f": {last}" if last and not last.startswith("To enable traceback") else ""
    return f"exited with code {failure.exitcode}{said}"


def failure_summary(error, world_size: int) -> str:
    """One line for the rank whose end failed the job (`first_failure`): how it ended, then any other rank the
    launcher found ended in the same check, and whether it stopped the rest."""
    first, failure = first_failure(error)
    others = "".join(f"; rank {r} (pid {f.pid}) had ended too: it {_how_it_ended(f)}"
                     for r, f in sorted(error.failures.items()) if r != first)
    stopped = "; the launcher stopped the other ranks" if len(error.failures) < world_size else ""
    return f"rank {first} of {world_size} (pid {failure.pid}) {_how_it_ended(failure)}{others}{stopped}"


def collective_timeout() -> dt.timedelta:
    """How long a rank waits in a collective before the job fails (COLLECTIVE_TIMEOUT, or TIMEOUT_VARIABLE's)."""
    seconds = os.environ.get(TIMEOUT_VARIABLE)
    return dt.timedelta(seconds=float(seconds)) if seconds else COLLECTIVE_TIMEOUT


# Ranks start from a fork server that has imported these once (multiprocessing's "forkserver"), not each from a fresh
# interpreter ("spawn"): a two-rank LeNet cell here takes 2 s instead of 5. The server is one process, started
# before any thread, and lives as long as the launching process; it forks each rank from its clean state.
# scikit-learn (LeNet's split) is among them: 1.4 s once, where each rank of each LeNet cell imported it (2-core AMD
# EPYC). transformers and datasets are not: huggingface_hub reads HF_HOME and HF_HUB_OFFLINE when it is imported,
# and a rank takes its launcher's environment (Launcher) only after the fork.
PRELOADED = ["bench.running.run", "bench.speed.trace", "torch._dynamo", "torch.distributed.fsdp",
             "torch.distributed.checkpoint", "sklearn.model_selection"]


@dataclass(frozen=True)
class Launcher:
    """What a rank takes from the process that launched it: its environment and working directory. A forked rank
    inherits the fork server's, which are as they were when the server started (the first cell of a process)."""

    environment: dict
    cwd: str

    def apply(self) -> None:
        """This process's environment as the launcher's, keeping what the elastic launcher set for this rank."""
        ours = {k: v for k, v in os.environ.items() if k.startswith(LAUNCHER_VARIABLES)}
        os.environ.clear()
        os.environ.update(self.environment | ours)
        os.chdir(self.cwd)


# the variables torch's elastic launcher sets for each rank (its torchelastic bookkeeping, rendezvous and rank; the
# launcher's own NCCL_* settings are the launching process's, so they come from there)
LAUNCHER_VARIABLES = ("TORCHELASTIC_", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_", "ROLE_",
                      "MASTER_", "TORCH_NCCL_", "OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES")


@record
def rank(cfg_yaml: str, config: dict, train_rank, launched_from: Launcher) -> dict:
    """One rank of a cell's job started by the elastic launcher (`_train_rank`); a failed record makes the rank exit
    non-zero, so that the launcher stops a rank that may wait on this one."""
    launched_from.apply()
    try:
        outcome = _train_rank(cfg_yaml, config, train_rank)
    except ConfigError as e:  # found while building the cell (its data, say): the launcher's error file carries it
        raise RankRefused(str(e)) from None
    if outcome["status"] == "failed":
        if any(words in outcome["reason"] for words in LOST_PEER):
            time.sleep(LOST_PEER_GRACE_S)
        raise RankFailed(outcome["reason"])
    return outcome


# A rank that failed because another one vanished (gloo's and NCCL's words for it) waits before it exits: the launcher
# reports the first failed rank it sees, one only, and it should see the vanished rank's end, the cause, first.
LOST_PEER = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "Read error")
LOST_PEER_GRACE_S = 1.0  # ten of the launcher's checks (monitor_interval 0.1 s)


class RankFailed(Exception):
    """A rank's training failed (its record says why; rank 0 has written it)."""


class RankRefused(Exception):
    """A rank refused the cell while building it (a ConfigError: no record); `launch` says it as the ConfigError it
    was, so a distributed cell's setup problem exits 2 as a one-device cell's does."""


class _RefusalSaidOnce(logging.Filter):
    """Drops the traceback torch's elastic launcher logs for a rank that refused the cell (RankRefused, some forty
    lines): `launch` says the refusal, in one line. A rank that failed otherwise keeps its traceback there."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and f"{RankRefused.__name__}: " in str(record.exc_info[1]))


logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_RefusalSaidOnce())


def slurm_tasks() -> int:
    """The tasks of this SLURM job (submitit's tasks_per_node x nodes): each one rank of a distributed cell, where
    there are more than one; 1 outside SLURM (the cell then launches its ranks itself)."""
    return int(os.environ.get("SLURM_NTASKS", "1")) if os.environ.get("SLURM_JOB_ID") else 1


def as_slurm_task(cfg: DictConfig, config: dict, train_rank) -> dict:
    """This SLURM task as one rank of the cell's job (submitit started one process per task, each running the cell):
    torch's env:// variables from submitit's TorchDistributedEnvironment (the job's first node as the master), then
    the rank's training. Every task returns its record; rank 0's is the one written."""
    from submitit.helpers import TorchDistributedEnvironment

    TorchDistributedEnvironment().export(set_cuda_visible_devices=False)  # a GPU per LOCAL_RANK, as under torchrun
    return _train_rank(OmegaConf.to_yaml(cfg, resolve=True), config, train_rank)


def _train_rank(cfg_yaml: str, config: dict, train_rank) -> dict:
    """One rank of a cell's job: join the process group, train the cell on this rank's shares, leave."""
    from bench import plugins
    from bench.numerics.precision import Precision
    from bench.running.device import select_device

    cfg = OmegaConf.create(cfg_yaml)
    plugins.load(cfg.get("plugins") or (), named_by="the plugins: config key")
    torch.set_num_threads(cfg.threads or 1)  # one per rank: a rank per core, not every rank on every core
    device = select_device(cfg.device)
    if device.type == "cuda":  # a GPU per rank, as torchrun numbers them
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    precision = Precision.from_config(cfg, device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=collective_timeout())
    try:
        with precision.fp32_flags():
            return train_rank(cfg, config, device, precision)
    finally:
        dist.destroy_process_group()


def shard(batch, ranks: Ranks):
    """This rank's contiguous share of every tensor in `batch` (a tensor, or tuples, lists and dicts of them) along
    its first dimension; ranks beyond a short batch's rows get none."""
    if torch.is_tensor(batch):
        return batch.tensor_split(ranks.world_size)[ranks.rank] if batch.dim() else batch
    if isinstance(batch, dict):
        return type(batch)({k: shard(v, ranks) for k, v in batch.items()})
    if isinstance(batch, (tuple, list)):
        return type(batch)(shard(v, ranks) for v in batch)
    return batch


def reduce_in(dtype: torch.dtype):
    """A DDP communication hook that averages each gradient bucket in `dtype` (torch.float32: DDP's own all-reduce),
    the bucket divided by the world size before the sum, as torch's fp16_compress_hook does."""
    def hook(group, bucket):  # unannotated: DDP compares annotations to its classes, and this module's are strings
        group = group if group is not None else dist.group.WORLD
        buffer = bucket.buffer()
        sent = buffer.to(dtype).div_(group.size())
        future = dist.all_reduce(sent, group=group, async_op=True).get_future()

        def back(done):
            buffer.copy_(done.value()[0])
            return buffer

        return future.then(back)

    hook.__name__ = f"{str(dtype).removeprefix('torch.')}_reduce_hook"
    return hook


@dataclass
class Wrapped:
    """A model under the cell's data-parallel wrapper: `model`; each of its parameters as the wrapped model holds it
    (`replaced`, {before: after}: FSDP2 makes new ones, sharded DTensors, which take the old ones' Python attributes,
    u-μP's `mup_type`; DDP keeps them); the blocks compiled one by one (`compiled_blocks`, their module names)."""

    model: torch.nn.Module
    replaced: dict
    compiled_blocks: list


def wrap(model: torch.nn.Module, cfg: DictConfig, device: torch.device, compile_blocks: bool = False) -> Wrapped:
    """The model under the cell's data-parallel wrapper (after the precision has converted its layers).
    compile_blocks: each of the model's blocks (model.task.blocks) compiled by inductor before it is wrapped,
    torchtitan's pattern: a whole FSDP2 model compiles nothing (dynamo breaks its graph at FSDP's hooks)."""
    before = list(model.parameters())
    blocks = [(name, module) for name, module in model.named_modules()
              if block_of(name, cfg.model.task.get("blocks")) == name]  # one of its repeated blocks
    for _, module in blocks if compile_blocks else ():
        module.compile(backend=BACKEND, mode=MODE)
    wrapped = _wrapped(model, cfg, device, [module for _, module in blocks])
    replaced = dict(zip(before, wrapped.parameters(), strict=True))  # the same modules, in the same order
    for old, new in replaced.items():
        if new is not old:
            new.__dict__.update(old.__dict__)
    return Wrapped(wrapped, replaced, [name for name, _ in blocks] if compile_blocks else [])


def _wrapped(model: torch.nn.Module, cfg: DictConfig, device: torch.device, blocks: list) -> torch.nn.Module:
    p = cfg.parallel
    if p.name == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        wrapped = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
        if p.gradient_compression != "none":
            wrapped.register_comm_hook(None, reduce_in(COMMUNICATED[p.gradient_compression]))
        return wrapped
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=COMMUNICATED[p.param_dtype], reduce_dtype=COMMUNICATED[p.reduce_dtype])
    for module in blocks:
        fully_shard(module, mp_policy=policy)
    return fully_shard(model, mp_policy=policy)


class CollectiveBytes(TorchDispatchMode):
    """Bytes this rank handed to each kind of collective while active (c10d's ops as the dispatcher sees them: the
    tensors a rank sends, its input)."""

    KINDS = {"allreduce_": "all_reduce", "_allgather_base_": "all_gather", "allgather_into_tensor_coalesced_":
             "all_gather", "_reduce_scatter_base_": "reduce_scatter", "reduce_scatter_tensor_coalesced_":
             "reduce_scatter", "allgather_": "all_gather", "reduce_scatter_": "reduce_scatter"}

    def __init__(self):
        super().__init__()
        self.bytes: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        namespace, name = func.namespace, func._opname
        if namespace == "c10d" and name in self.KINDS:
            self.bytes[self.KINDS[name]] += _tensor_bytes(args[0] if name == "allreduce_" else args[1])  # inputs
        return func(*args, **(kwargs or {}))


KINETO_QUIET = 6  # past its highest severity (libkineto's Logger: VERBOSE 0 ... ERROR 4, USDT 5)


class CollectiveTime:
    """The time one step's collectives took, as torch's profiler sees them: gloo's work on its own threads (on CPU), or
    NCCL's kernels on the GPU, by the backend's event name, beside the step's wall time. Where the wrapper overlaps
    them with compute (DDP's buckets, FSDP2's prefetch), part of that time is hidden: what a rank waited for is not
    separable here, and the speed model's `collectives` gives the exposed part of a GPU's."""

    PROFILED_STEP = 2  # not the first (its memory is counted) nor the second (where a compiled cell compiles)

    def __init__(self, device: torch.device):
        from torch.profiler import ProfilerActivity, profile

        # kineto, the profiler's library, prints its profiler_start and profiler_stop trace points ("USDT:" lines)
        # on every rank unless told its own log level (it reads it when first started); set one, to see them
        os.environ.setdefault("KINETO_LOG_LEVEL", str(KINETO_QUIET))
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        self._profile, self.device = profile(activities=activities), device
        self.measured: dict | None = None

    def __enter__(self):
        self._started = time.perf_counter()
        self._profile.__enter__()
        return self

    def __exit__(self, *exc):
        self._profile.__exit__(*exc)
        step_s = time.perf_counter() - self._started
        by_event: Counter = Counter()  # the backend's names: gloo:all_reduce (FSDP2's reduce-scatter on gloo too)
        for event in self._profile.events():
            if event.name.startswith("gloo:"):
                by_event[event.name] += event.cpu_time_total / 1e6
            elif self.device.type == "cuda" and event.name.startswith("nccl") and "Kernel" in event.name:
                by_event[event.name.split("(")[0]] += event.device_time_total / 1e6
        self.measured = {"step": self.PROFILED_STEP, "step_s": step_s, "collective_s": sum(by_event.values()),
                         "by_event_s": dict(sorted(by_event.items())),
                         "how": "NCCL's kernels on the GPU" if self.device.type == "cuda" else
                         "gloo's work on its threads (overlapping compute where the wrapper overlaps them)"}
        return False


def _tensor_bytes(value) -> int:
    if torch.is_tensor(value):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


def batch_weighted(loss: torch.Tensor, terms: torch.Tensor, gradient_too: bool = True) -> torch.Tensor:
    """A rank's `loss`, the mean over its `terms` of a batch's loss terms, weighted by world_size * terms / all the
    ranks' terms, so that the ranks' average (DDP's and FSDP2's of the gradients, `averaged`'s of the logged losses)
    is the whole batch's mean, as one device takes it, where shares hold unequal numbers of terms (a masked LM's
    chosen positions). `gradient_too=False` weights the value alone: a loss whose backward sums its terms (unit
    scaling's cross-entropy) already weighs every term alike. A share without terms (its mean NaN) gives zero."""
    total = terms.detach().to(torch.float32).clone()
    dist.all_reduce(total)
    weight = dist.get_world_size() * terms.to(torch.float32) / total.clamp(min=1)
    weighted = loss * weight if gradient_too else loss + (loss * (weight - 1)).detach()
    return torch.where(terms > 0, weighted, torch.zeros_like(weighted))


def averaged(losses: torch.Tensor) -> torch.Tensor:
    """A rank's losses (each the mean over its share of a batch, weighted by its share's terms where they differ:
    `batch_weighted`) averaged over the ranks: the whole batch's, as a one-device cell logs them."""
    total = losses.detach().clone()
    dist.all_reduce(total)
    return total / dist.get_world_size()


def gathered(value):
    """`value` from every rank, in rank order (on rank 0; every rank takes part)."""
    found = [None] * dist.get_world_size()
    dist.all_gather_object(found, value)
    return found


def describe(cfg: DictConfig, peaks: list[int | None], collective_bytes: dict, compiled_blocks: list,
             collective_time: dict | None) -> dict:
    """The record's `parallel` section."""
    p = cfg.parallel
    known = [b for b in peaks if b is not None]
    return {"wrapper": p.name, "world_size": p.world_size,
            "ranks": "SLURM tasks (submitit)" if slurm_tasks() > 1 else "torch's elastic launcher",
            "param_dtype": p.param_dtype,
            "reduce_dtype": p.reduce_dtype, "gradient_compression": p.gradient_compression,
            "fp8_all_gather": p.fp8_all_gather, "compiled_blocks": compiled_blocks,
            "peak_bytes_per_rank": peaks, "peak_bytes_max": max(known) if known else None,
            "collective_bytes_first_step": dict(sorted(collective_bytes.items())),
            "collective_time": collective_time,
            "note": "the record's predicted step times price one device's step of the whole batch; bench.predict "
                    "gives a rank's step with its collectives, and its memory"}

