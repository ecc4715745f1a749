"""Run records: `result.json` (one per cell, written atomically) and per-step `metrics.jsonl`.

The schema is documented in results/README.md. Non-finite floats are written as the strings
"nan", "inf", "-inf" so that every file is strict JSON.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import math
import os
import shutil
import tempfile
from pathlib import Path

RECORD_KEYS = ("status", "reason", "config", "env", "metrics", "timing", "memory", "numerics")
STATUSES = ("ok", "diverged", "failed")
RETRY_HINT = "retry_failed=true runs failed and diverged cells again"  # a finished record is never re-run without it
IN_FLIGHT = "in_flight"  # not a record's status: what a sweep reports for a cell another process is training


def _finite_json(value):
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {k: _finite_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_json(v) for v in value]
    return value


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# A write that fails with one of these is the disk's fault, not the cell's: no space, over quota, too large for the
# file-size limit, or an I/O error (a flaky network filesystem).
STORAGE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO}
# Free space a cell needs beyond its checkpoints: the record, metrics.jsonl, run.log and an offline W&B run.
WRITE_MARGIN_BYTES = 32 * 2**20


class StorageError(Exception):
    """The results disk cannot take a cell's files (full, over quota, failing). The cell stops without a record,
    its temporary files removed; the next launch runs it again, from its last checkpoint."""


@contextlib.contextmanager
def storage_errors(path: Path):
    """Turn an OSError with a STORAGE_ERRNOS errno, raised while writing `path`, into a StorageError naming it;
    also when a library reports it as a RuntimeError raised while handling it (torch.save's zip writer)."""
    try:
        yield
    except (OSError, RuntimeError) as e:
        cause = e if isinstance(e, OSError) else e.__cause__ or e.__context__
        if not isinstance(cause, OSError) or cause.errno not in STORAGE_ERRNOS:
            raise
        raise StorageError(f"cannot write {path}: {cause.strerror or os.strerror(cause.errno)} "
                           f"({errno.errorcode.get(cause.errno, cause.errno)})") from e


def error_line(error: BaseException, limit: int = 300) -> str:
    """`Type: first line of the message`, at most `limit` characters of it: torch's and dynamo's errors run on."""
    return f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0][:limit]}"


def _size(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.0f} KiB"


def require_free_space(directory: Path, needed: int, what: str) -> None:
    """StorageError unless the filesystem holding `directory` has `needed` bytes free (for `what`)."""
    free = shutil.disk_usage(directory).free
    if free < needed:
        raise StorageError(f"{directory} has {_size(free)} free; {what} needs {_size(needed)}")


def write_json_atomic(path: Path, obj: dict) -> None:
    """Write to a temporary file in the same directory, fsync, then rename: old or new, never torn. A full disk
    raises StorageError and leaves no temporary file."""
    with storage_errors(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600; a shared results folder needs the umask's mode
            with os.fdopen(fd, "w") as f:
                json.dump(_finite_json(obj), f, indent=2, allow_nan=False)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


class MetricsLog:
    """Appends one JSON line per logged step; a reader skips a torn last line after a kill.

    Resuming at step k keeps the complete lines of steps before k and drops the rest (the torn line
    and anything logged after the checkpoint): the resumed run logs those again.
    """

    def __init__(self, path: Path, resume_step: int | None = None):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        kept = []
        if resume_step is not None and path.exists():
            for line in path.read_text().splitlines():
                try:
                    if json.loads(line)["step"] < resume_step:
                        kept.append(line + "\n")
                except (json.JSONDecodeError, KeyError, TypeError):
                    continue
        with storage_errors(path):
            self._file = open(path, "w")
            self._file.writelines(kept)

    def __call__(self, row: dict) -> None:
        with storage_errors(self.path):
            self._file.write(json.dumps(_finite_json(row), allow_nan=False) + "\n")
            self._file.flush()

    def close(self) -> None:
        with storage_errors(self.path):
            self._file.close()


def logged_losses(run_dir: Path) -> list[list[float]]:
    """A run's training curve, `[step, loss]` at its log steps, from its metrics.jsonl (empty without one)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    curve = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # a torn last line after a kill
            continue
        if isinstance(row.get("loss"), (int, float)):
            curve.append([row["step"], row["loss"]])
    return curve


class RecordError(ValueError):
    """A result.json that cannot be read or lacks the schema's keys."""


# What the aggregator reads, as (dotted path, accepted types); numbers may also be null or "nan"/"inf"/"-inf".
REQUIRED_FIELDS = (("config.experiment_name", str), ("config.seed", int), ("config.model.name", str),
                   ("config.model.data.source", str), ("config.format.name", str), ("config.scaling.name", str),
                   ("env.precision", dict), ("metrics", dict), ("timing", dict), ("memory", dict), ("numerics", dict))
NUMERIC_FIELDS = ("timing.train_s", "timing.steps", "timing.step_median_s", "timing.samples_per_s", "memory.peak_bytes",
                  "numerics.skipped_steps", "numerics.overflow_steps", "numerics.final_loss_scale")


def _field(record: dict, path: str):
    value = record
    for part in path.split("."):
        if not isinstance(value, dict) or part not in value:
            raise KeyError(path)
        value = value[part]
    return value


def check_record(record, source: str) -> dict:
    """`record` if it has the schema's keys and types and a known status; else RecordError naming `source`
    and the problem (an older schema, a hand-edited value)."""
    missing = [k for k in RECORD_KEYS if not isinstance(record, dict) or k not in record]
    if missing:
        raise RecordError(f"{source} lacks {', '.join(missing)}")
    if record["status"] not in STATUSES:
        raise RecordError(f"{source}: status {record['status']!r} is not one of {', '.join(STATUSES)}")
    for path, kind in REQUIRED_FIELDS:
        try:
            value = _field(record, path)
        except KeyError:
            raise RecordError(f"{source} lacks {path}") from None
        if not isinstance(value, kind) or isinstance(value, bool) and kind is int:
            raise RecordError(f"{source}: {path} is {value!r}, expected {kind.__name__}")
    for path in NUMERIC_FIELDS:
        try:
            value = _field(record, path)
        except KeyError:
            continue
        if not (value is None or value in ("nan", "inf", "-inf")
                or isinstance(value, (int, float)) and not isinstance(value, bool)):
            raise RecordError(f"{source}: {path} is {value!r}, expected a number")
    return record


def read_record(path: Path) -> dict:
    try:
        record = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise RecordError(f"{path}: unreadable record ({e})") from None
    return check_record(record, f"{path}: record")


def previous_record(run_dir: Path) -> tuple[dict | None, str | None]:
    """The record already in `run_dir` (None if there is none), and a message if it is unreadable."""
    path = Path(run_dir) / "result.json"
    if not path.exists():
        return None, None
    try:
        return read_record(path), None
    except RecordError as e:
        return None, str(e)


LOCK_NAME = ".lock"


@contextlib.contextmanager
def cell_lock(run_dir: Path):
    """Yields whether this process now holds the cell's lock (an flock on `<run_dir>/.lock`, non-blocking).

    One process trains a cell at a time, whichever sweep or SLURM job started it. The kernel releases the
    lock when its process exits, however it exits (SIGKILL, OOM, node reboot), so a dead job never leaves a
    cell locked; the file itself may stay and means nothing. Linux NFS clients carry flock to the server.
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / LOCK_NAME, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def in_flight(run_dir: Path) -> bool:
    """Whether another process holds the cell's lock now (without creating anything)."""
    if not (Path(run_dir) / LOCK_NAME).exists():
        return False
    with cell_lock(Path(run_dir)) as mine:
        return not mine
