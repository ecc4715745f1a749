"""Committed records: the records a committed table folder was made from, kept beside its tables in git as one
`records.jsonl.gz`, so anyone can regenerate the tables (`make tables`), check a figure, or table them another way.

One line per run, sorted by cell: its result.json as written, `cell` (its place under the results directory it was
made in), and `losses`, its training curve as `[step, loss]` pairs at the log steps (metrics.jsonl's other columns,
per-step telemetry and timings, are left out: no table or plot reads them, and they are most of its bytes). Written
with gzip's timestamp zeroed, so the same records make the same bytes.
"""

from __future__ import annotations

import gzip
import io
import json
from pathlib import Path

from bench.running.record import RecordError, check_record

ARCHIVE = "records.jsonl.gz"


def write(records: list[dict], path: Path) -> Path:
    """Archive `records` (as aggregate loads them: `_losses` beside each) at `path`; returns it."""
    lines = sorted(json.dumps({"cell": r["config"].get("cell") or r.get("_dir"), "losses": r.get("_losses") or [],
                               **{k: v for k, v in r.items() if not k.startswith("_")}}, sort_keys=True)
                   for r in records)
    buffer = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buffer, mtime=0) as archive:
        archive.write("".join(line + "\n" for line in lines).encode())
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(buffer.getvalue())
    return path


def read(path: Path) -> tuple[list[dict], list[str]]:
    """The valid records of an archive (each with `_dir`, its cell, and `_losses`), and one message per bad one."""
    records, problems = [], []
    try:
        lines = gzip.decompress(Path(path).read_bytes()).decode().splitlines()
    except (OSError, EOFError, UnicodeDecodeError) as e:
        return [], [f"{path}: unreadable archive ({e})"]
    for number, line in enumerate(lines, 1):
        try:
            entry = json.loads(line)
            cell, curve = entry.pop("cell"), entry.pop("losses")
            records.append(check_record(entry, f"{path}:{number}: record") | {"_dir": cell, "_losses": curve})
        except (json.JSONDecodeError, KeyError, AttributeError) as e:
            problems.append(f"{path}:{number}: malformed line ({type(e).__name__}: {e})")
        except RecordError as e:
            problems.append(str(e))
    return records, problems
