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
record is written (unless keep). Writes are atomic (temporary file + rename).
"""

from __future__ import annotations

import os
import random
import signal
from pathlib import Path

import numpy as np
import torch

from bench.numerics.scaling import LossScaler

PREEMPTION_SIGNALS = (signal.SIGUSR2, signal.SIGTERM, signal.SIGINT)
CHECKPOINT_NAME = "checkpoint.pt"


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


class Checkpointer:
    """Saves and restores one cell's training state under `run_dir`."""

    def __init__(self, run_dir: Path, run_id: str, every: int | None, keep: bool):
        self.path = Path(run_dir) / CHECKPOINT_NAME
        self.run_id, self.every, self.keep = run_id, every, keep
        self.preempted: int | None = None
        self._previous = {}

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
        """Load the saved state into the given objects; return the loop state, or None to start afresh."""
        if not self.path.exists():
            return None
        state = torch.load(self.path, map_location="cpu", weights_only=False)
        if state["run_id"] != self.run_id:
            return None  # a checkpoint of another configuration: start afresh (it is overwritten)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        if schedule is not None:
            schedule.load_state_dict(state["schedule"])
        scaler.load_state_dict(state["scaler"])
        _set_rng_state(state["rng"])
        return state["loop"]

    def save(self, model, optimizer, scaler: LossScaler, schedule, loop: dict) -> None:
        state = {"run_id": self.run_id, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                 "schedule": schedule.state_dict() if schedule is not None else None,
                 "scaler": scaler.state_dict(), "rng": _rng_state(), "loop": loop}
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        torch.save(state, tmp)
        os.replace(tmp, self.path)

    def after_step(self, step: int, save) -> None:
        """Called at each step boundary with `save()` bound to the current state."""
        if self.preempted is not None:
            save()
            signum, self.preempted = self.preempted, None
            previous = self._previous.get(signum, signal.SIG_DFL)
            signal.signal(signum, previous)
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
