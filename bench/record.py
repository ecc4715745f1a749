"""Run records: `result.json` (one per cell, written atomically) and per-step `metrics.jsonl`.

The schema is documented in results/README.md. Non-finite floats are written as the strings
"nan", "inf", "-inf" so that every file is strict JSON.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path

RECORD_KEYS = ("status", "reason", "config", "env", "metrics", "timing", "memory", "numerics")
STATUSES = ("ok", "diverged", "failed")


def _finite_json(value):
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {k: _finite_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_json(v) for v in value]
    return value


def write_json_atomic(path: Path, obj: dict) -> None:
    """Write to a temporary file in the same directory, fsync, then rename: old or new, never torn."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(_finite_json(obj), f, indent=2, allow_nan=False)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class MetricsLog:
    """Appends one JSON line per logged step; a reader skips a torn last line after a kill."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "w")

    def __call__(self, row: dict) -> None:
        self._file.write(json.dumps(_finite_json(row), allow_nan=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class RecordError(ValueError):
    """A result.json that cannot be read or lacks the schema's keys."""


def read_record(path: Path) -> dict:
    try:
        record = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise RecordError(f"{path}: unreadable record ({e})") from None
    missing = [k for k in RECORD_KEYS if not isinstance(record, dict) or k not in record]
    if missing:
        raise RecordError(f"{path}: record lacks {', '.join(missing)}")
    if record["status"] not in STATUSES:
        raise RecordError(f"{path}: status {record['status']!r} is not one of {', '.join(STATUSES)}")
    return record
