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
import signal
import time
from pathlib import Path

import numpy as np
import torch

from bench.numerics.scaling import LossScaler
from bench.running.record import error_line, storage_errors

log = logging.getLogger(__name__)

PREEMPTION_SIGNALS = (signal.SIGUSR2, signal.SIGTERM, signal.SIGINT)
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
                with open(tmp, "wb") as f:  # a Python file: a failed write keeps its errno (torch's own reports none)
                    torch.save(state, f)
                    f.flush()
                    os.fsync(f.fileno())
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
        if self.keep and self.path.exists():
            os.replace(self.path, self.previous)
        os.replace(tmp, self.path)

    def after_step(self, step: int, save) -> None:
        """Called at each step boundary with `save()` bound to the current state."""
        if self.preempted is not None:
            save()
            signum, self.preempted = self.preempted, None
            previous = self._previous.get(signum, signal.SIG_DFL)
            signal.signal(signum, previous)
            if signum == signal.SIGINT:  # Ctrl-C, or kill -INT where a shell had it ignored: bench.run's one line
                raise KeyboardInterrupt
            os.kill(os.getpid(), signum)  # submitit's SIGUSR2 handler requeues; the default ones exit or raise
            raise SystemExit(128 + signum)  # the previous handler returned: stop here, resumable
        elif self.every and step % self.every == 0:
            save()

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
