"""Checkpoints that let a killed, preempted or requeued cell resume where it stopped.

A checkpoint holds what the next step depends on: model, optimiser, schedule and loss-scaler state,
the Python / NumPy / torch RNG states, and the loop's position (epoch, batches consumed in it, step)
with the timings and metrics gathered so far. The data order of an epoch is a pure function of
(seed, epoch), so replaying the epoch's batch generator up to the saved position restores the data
stream exactly; on CPU in fp32 the resumed run ends with bitwise the same weights.

Saved every `train.checkpoint_every` steps, on SIGUSR2 / SIGTERM (what SLURM and submitit send before a
timeout or preemption) and on SIGINT (Ctrl-C): the handler only sets a flag, the loop saves at the next step
boundary, hands the signal to the previous handler (submitit requeues on SIGUSR2; the default handlers
exit or raise KeyboardInterrupt) and, if that handler returns (submitit only logs SIGTERM), stops the cell
itself: the next launch resumes from the checkpoint. When training ends a final checkpoint is saved, so
that a pre-emption during a long evaluation resumes at the evaluation; the runner deletes it once the
record is written (unless keep). Writes are atomic (temporary file + rename); one that fails for want of
space raises StorageError and leaves no temporary file.

A checkpoint that cannot be resumed from (truncated, corrupt, another configuration's, written by a torch
that cannot read it) is moved aside as `checkpoint.pt.unreadable-<time>` with a warning saying why, and
the cell resumes from the previous checkpoint where one is kept (`keep_checkpoint=true` keeps the last two:
`checkpoint.pt` and `checkpoint.previous.pt`), else starts from step 0. What happened goes in the record
(`resumed_from`, `discarded_checkpoints`).
"""

from __future__ import annotations

import copy
import logging
import os
import random
import re
import shutil
import signal
import time
from pathlib import Path

import numpy as np
import torch

from bench.numerics.scaling import LossScaler
from bench.running.record import error_line, storage_errors

log = logging.getLogger(__name__)

PREEMPTION_SIGNALS = (signal.SIGUSR2, signal.SIGTERM, signal.SIGINT)
STOPPED_EXIT_CODES = frozenset(128 + sig for sig in PREEMPTION_SIGNALS)  # `Checkpointer._stop`'s SystemExit
CHECKPOINT_NAME = "checkpoint.pt"
PREVIOUS_NAME = "checkpoint.previous.pt"  # with keep_checkpoint: the one before the last
UNREADABLE_SUFFIX = ".unreadable-"


def state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """What a checkpoint of `model` and `optimizer` takes, estimated before the first step (an optimiser makes its
    state lazily): the model's state, plus a copy of the trainable parameters per optimiser slot (Adam's two
    moments, SGD's momentum buffer)."""
    model_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    defaults = optimizer.defaults
    slots = 2 if "betas" in defaults else 1 if defaults.get("momentum") else 0
    return model_bytes + slots * trainable


def _rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class CheckpointMismatch(Exception):
    """A readable checkpoint that is not this run's."""


# A parallel sweep's worker (a joblib process that trains cell after cell) keeps a pre-emption signal that comes while
# none of its cells' Checkpointers holds the signals (between cells, or while a cell is built) instead of ending: the
# default would end an idle worker, and joblib then kills the other workers mid-step. The worker's later cells then
# stop before they train (`Checkpointer.__enter__`), and the sweep's queued cells with them.
_kept_signal: int | None = None


def keep_signal(signum: int, frame=None) -> None:
    """Keep `signum` (a signal handler too): the worker's later cells stop before they train."""
    global _kept_signal
    _kept_signal = signum


def keep_signals_between_cells() -> None:
    """In a parallel sweep's worker, from its first cell on: a pre-emption signal no cell is there to take is kept
    (`keep_signal`), and stops the worker's later cells before they train."""
    for sig in PREEMPTION_SIGNALS:
        signal.signal(sig, keep_signal)


def kept_signal() -> int | None:
    """The pre-emption signal a parallel sweep's worker kept between its cells (None: none)."""
    return _kept_signal


class Checkpointer:
    """Saves and restores one cell's training state under `run_dir`."""

    def __init__(self, run_dir: Path, run_id: str, every: int | None, keep: bool):
        self.path = Path(run_dir) / CHECKPOINT_NAME
        self.previous = Path(run_dir) / PREVIOUS_NAME
        self.run_id, self.every, self.keep = run_id, every, keep
        self.preempted: int | None = None
        self._previous = {}
        self.resumed_from: dict | None = None  # {"checkpoint": name, "step": n} once restore() resumed
        self.discarded: list[dict] = []  # {"moved_to": name, "reason": why} per checkpoint moved aside

    def bytes_needed(self, model, optimizer) -> int:
        """Disk a cell's checkpoints take at their peak: the one being written beside the one it replaces, and
        with keep the previous one as well."""
        return (3 if self.keep else 2) * state_bytes(model, optimizer)

    def __enter__(self):
        if _kept_signal is not None:  # pre-empted while the cell was built: it stops before its first step
            raise KeyboardInterrupt
        if os.name == "posix":
            for sig in PREEMPTION_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        return False

    def _on_signal(self, signum, frame):
        self.preempted = signum

    def restore(self, model, optimizer, scaler: LossScaler, schedule) -> dict | None:
        """Load the newest checkpoint this run can resume from into the given objects and return its loop state;
        None to start afresh. Each one that cannot be loaded is moved aside (`_discard`) and the objects are left
        as they were before it was tried."""
        candidates = [path for path in (self.path, self.previous) if path.exists()]
        before = _snapshot(model, optimizer, scaler, schedule) if candidates else None
        for path in candidates:
            try:
                state = torch.load(path, map_location="cpu", weights_only=False)
                if not isinstance(state, dict) or state.get("run_id") != self.run_id:
                    found = state.get("run_id") if isinstance(state, dict) else type(state).__name__
                    raise CheckpointMismatch(f"it is another configuration's (run_id {found}, this run {self.run_id})")
                model.load_state_dict(state["model"])
                optimizer.load_state_dict(state["optimizer"])
                _state_beside_parameters(optimizer)
                if schedule is not None:
                    schedule.load_state_dict(state["schedule"])
                scaler.load_state_dict(state["scaler"])
                loop, rng = state["loop"], state["rng"]
                steps = int(loop["steps"])
            except Exception as e:  # whatever makes a checkpoint unusable, the answer is the same
                _restore_snapshot(before, model, optimizer, scaler, schedule)
                self._discard(path, e)
                continue
            _set_rng_state(rng)
            self.resumed_from = {"checkpoint": path.name, "step": steps}
            return loop
        return None

    def _discard(self, path: Path, error: Exception) -> None:
        why = str(error) if isinstance(error, CheckpointMismatch) else error_line(error)
        target = path.with_name(f"{path.name}{UNREADABLE_SUFFIX}{time.strftime('%Y%m%d-%H%M%S')}")
        os.replace(path, target)
        self.discarded.append({"moved_to": target.name, "reason": why})
        fallback = "the previous checkpoint" if path == self.path and self.previous.exists() else "step 0"
        log.warning("%s: cannot resume from it (%s); moved aside to %s, starting from %s", path, why, target.name,
                    fallback)

    def save(self, model, optimizer, scaler: LossScaler, schedule, loop: dict) -> None:
        state = _on_host({"run_id": self.run_id, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                          "schedule": schedule.state_dict() if schedule is not None else None,
                          "scaler": scaler.state_dict(), "rng": _rng_state(), "loop": loop})
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        with storage_errors(tmp):
            try:
                _save_file(tmp, state)
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
        if self.keep and self.path.exists():
            os.replace(self.path, self.previous)
        os.replace(tmp, self.path)

    def after_step(self, step: int, save) -> None:
        """Called at each step boundary with `save()` bound to the current state."""
        if signum := self._stop_signal():
            self._stop(signum, save)
        elif self.every and step % self.every == 0:
            save()

    def _stop_signal(self) -> int | None:
        """The pre-emption signal to stop on at this step boundary: this process's."""
        return self.preempted

    def _stop(self, signum: int, save) -> None:
        """Pre-empted by `signum`: save, then hand the signal on (the previous handler), and stop."""
        save()
        self.preempted = None
        previous = self._previous.get(signum, signal.SIG_DFL)
        signal.signal(signum, previous)
        if signum == signal.SIGINT:  # Ctrl-C, or kill -INT where a shell had it ignored: bench.run's one line
            raise KeyboardInterrupt
        os.kill(os.getpid(), signum)  # submitit's SIGUSR2 handler requeues; the default ones exit or raise
        raise SystemExit(128 + signum)  # the previous handler returned: stop here, resumable

    def finish(self, save) -> None:
        """At the end of training: save, so that a pre-emption during the evaluation does not retrain."""
        save()

    def remove(self) -> None:
        """Once the record is written: delete the checkpoint unless asked to keep it."""
        if not self.keep:
            self.path.unlink(missing_ok=True)


def _on_host(state):
    """`state` with XLA tensors copied to the CPU, as torch_xla's xm.save writes them: a checkpoint that loads
    without torch_xla (the load maps it back through the model's and optimiser's own load_state_dict)."""
    if torch.is_tensor(state):
        return state.cpu() if state.device.type == "xla" else state
    if isinstance(state, dict):
        return {k: _on_host(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_on_host(v) for v in state)
    return state


def _state_beside_parameters(optimizer: torch.optim.Optimizer) -> None:
    """On XLA, every optimiser state tensor on its parameter's device: torch's load_state_dict keeps `step` on the
    CPU (its own optimisers read it there), where torch_xla's sync-free kernels want every operand on the device."""
    for param, state in optimizer.state.items():
        if param.device.type == "xla":
            for key, value in state.items():
                if torch.is_tensor(value) and value.device != param.device:
                    state[key] = value.to(param.device)


def _snapshot(model, optimizer, scaler: LossScaler, schedule) -> dict:
    """Copies of the states `restore` may overwrite, so that a checkpoint that fails half-way through loading
    (a model that took its weights, then an optimiser that refused its state) leaves nothing of itself behind."""
    return copy.deepcopy({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                          "schedule": schedule.state_dict() if schedule is not None else None,
                          "scaler": scaler.state_dict()})


def _restore_snapshot(before: dict, model, optimizer, scaler: LossScaler, schedule) -> None:
    model.load_state_dict(before["model"])
    optimizer.load_state_dict(before["optimizer"])
    if schedule is not None:
        schedule.load_state_dict(before["schedule"])
    scaler.load_state_dict(before["scaler"])


EXTRA_NAME = "extra.pt"  # in a distributed checkpoint's folder: run id, loop, schedule, scaler (rank 0's)
WORLD_SIZE_SEGMENT = re.compile(r",parallel\.world_size=\d+")  # where a cell's directory names its world size (not 1)


class DistributedCheckpointer(Checkpointer):
    """A distributed cell's checkpoints, through torch.distributed.checkpoint (DCP), in a folder: every rank writes
    its shards of the model's and optimiser's state (FSDP2's DTensor shards; DDP's replicas once), rank 0 the run id,
    loop position, schedule and loss scaler (`extra.pt`), each rank its RNG states. DCP reshards on load, so a cell
    resumes from a checkpoint of the same run at another world size: where its own folder has none, the newest of
    its sibling cells that differ only in `parallel.world_size` (its record's `resumed_from` names it).

    The ranks agree on when to stop: at each step boundary a pre-emption signal any rank got is all-reduced over a
    gloo group of its own (no device sync), and every rank saves at the same step. A folder is written under a
    temporary name and renamed by rank 0 once every rank has written (atomic as one-device checkpoints are)."""

    def __init__(self, run_dir: Path, run_id: str, every: int | None, keep: bool, any_world_size_id: str):
        import torch.distributed as dist

        super().__init__(run_dir, run_id, every, keep)
        self.path, self.previous = Path(run_dir) / "checkpoint.dcp", Path(run_dir) / "checkpoint.previous.dcp"
        self.any_world_size_id = any_world_size_id  # the run's identity without parallel.world_size
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.control = dist.new_group(backend="gloo")  # the stop flag's all-reduce, on the CPU whatever the device

    def _stop_signal(self) -> int | None:
        """The signal any rank got, agreed by all. What they decide on is what each read before the all-reduce: a
        signal that lands during it stays set for the next step's, so no rank stops a step before another."""
        import torch.distributed as dist

        flag = torch.tensor([self.preempted or 0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.control)
        return int(flag.item()) or None

    def save(self, model, optimizer, scaler: LossScaler, schedule, loop: dict) -> None:
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optimizer_state = get_state_dict(model, optimizer)
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # a save killed half-way
        dist.barrier(group=self.control)
        with storage_errors(tmp):
            dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=tmp)
            _save_file(tmp / f"rng.{self.rank}.pt", _rng_state())
            if self.rank == 0:
                _save_file(tmp / EXTRA_NAME, {"run_id": self.run_id, "any_world_size_id": self.any_world_size_id,
                                              "world_size": self.world_size, "loop": loop,
                                              "schedule": schedule.state_dict() if schedule is not None else None,
                                              "scaler": scaler.state_dict()})
        dist.barrier(group=self.control)
        if self.rank == 0:
            if self.keep and self.path.exists():
                shutil.rmtree(self.previous, ignore_errors=True)
                os.replace(self.path, self.previous)
            shutil.rmtree(self.path, ignore_errors=True)
            os.replace(tmp, self.path)
        dist.barrier(group=self.control)

    def restore(self, model, optimizer, scaler: LossScaler, schedule) -> dict | None:
        """Every rank loads the newest checkpoint folder of this run (its own, else a sibling world size's) into
        copies of its states, then into the live ones once every rank has read it; one that fails anywhere is moved
        aside (by rank 0) and the next is tried."""
        import torch.distributed as dist

        for path in self._candidates():
            try:
                extra, rng = self._load(path, model, optimizer)
                failed = 0
            except Exception as e:  # whatever makes a checkpoint unusable, the answer is the same
                extra, failed, error = None, 1, e
            flag = torch.tensor([failed])
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.control)
            if flag.item():
                if self.rank == 0:
                    self._discard(path, error if failed else RuntimeError("another rank could not read it"))
                dist.barrier(group=self.control)
                continue
            if schedule is not None:
                schedule.load_state_dict(extra["schedule"])
            scaler.load_state_dict(extra["scaler"])
            _set_rng_state(rng)
            steps = int(extra["loop"]["steps"])
            self.resumed_from = {"checkpoint": path.name if path.parent == self.path.parent
                                 else f"../{path.parent.name}/{path.name}", "step": steps,
                                 "world_size": extra["world_size"]}
            return extra["loop"]
        return None

    def _candidates(self) -> list[Path]:
        """This cell's checkpoint folders, else the newest of a sibling cell's that differ only in world size."""
        own = [p for p in (self.path, self.previous) if (p / EXTRA_NAME).exists()]
        if own:
            return own
        cell = self.path.parent
        siblings = [d / self.path.name for d in cell.parent.iterdir() if d != cell and d.is_dir()
                    and WORLD_SIZE_SEGMENT.sub("", d.name) == WORLD_SIZE_SEGMENT.sub("", cell.name)
                    and self._same_run(d / self.path.name)]
        return sorted(siblings, key=lambda p: (p / EXTRA_NAME).stat().st_mtime_ns, reverse=True)[:1]

    def _same_run(self, path: Path) -> bool:
        """Whether `path` is a readable checkpoint of this run at another world size (another run's is left be)."""
        try:
            extra = torch.load(path / EXTRA_NAME, map_location="cpu", weights_only=False)
        except Exception:
            return False
        return isinstance(extra, dict) and extra.get("any_world_size_id") == self.any_world_size_id

    def _load(self, path: Path, model, optimizer) -> tuple[dict, dict]:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        extra = torch.load(path / EXTRA_NAME, map_location="cpu", weights_only=False)
        if path.parent == self.path.parent and extra.get("run_id") != self.run_id:  # a sibling's: `_same_run`
            raise CheckpointMismatch(f"it is another configuration's (run_id {extra.get('run_id')}, this run "
                                     f"{self.run_id})")
        model_state, optimizer_state = get_state_dict(model, optimizer)
        copies = copy.deepcopy({"model": model_state, "optimizer": optimizer_state})  # a failed load spares the live
        dcp.load(copies, checkpoint_id=path)
        rng = path / f"rng.{self.rank}.pt"
        rng = torch.load(rng if rng.exists() else path / "rng.0.pt", weights_only=False)  # another world size's
        set_state_dict(model, optimizer, model_state_dict=copies["model"], optim_state_dict=copies["optimizer"])
        return extra, rng

    def remove(self) -> None:
        if not self.keep:
            shutil.rmtree(self.path, ignore_errors=True)


def _save_file(path: Path, state) -> None:
    """`state` written to `path` and synced to the disk."""
    with open(path, "wb") as f:  # a Python file: a failed write keeps its errno (torch's own reports none)
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
