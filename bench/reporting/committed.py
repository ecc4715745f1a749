"""The committed tables (results/tables/): each folder regenerated from the records beside it, and the index that
says what each folder is, where it ran and how to make it again. What `make tables` runs.

    python -m bench.reporting.committed [--root results/tables] [--no-plots] [--index-only]

A folder holds the tables of one experiment (`<root>/<experiment>/`, or under a device's subfolder such as
`<root>/h100/<experiment>/`) and, since 0.2.0, `records.jsonl.gz` (bench/reporting/archive.py): its tables are
rewritten from those records alone. Folders made before then have no records; the index says so and how to remake
them. The index (`<root>/README.md`) is written from the records, never by hand.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import pandas as pd

from bench.errors import ConfigError
from bench.reporting import aggregate, archive, plots, tables
from bench.running.config import check_declared

ROOT = Path("results/tables")
INDEX = "README.md"
# Folders a tool computes rather than a sweep trains (no records): the command that remakes each.
TOOL_FOLDERS = {"raschka_memory": "make raschka-memory"}


# Experiments a tool runs rather than a conf/experiment preset (its records kept by `bench.aggregate --keep-records`)
TOOL_EXPERIMENTS = {"gpu_report": "make gpu-report, then bench.aggregate --keep-records"}


def make_command(experiment: str, parent: str = "") -> str:
    """The command that makes an experiment's committed folder from nothing (a sweep, then its tables and records),
    into a device's subfolder such as `h100` when `parent` names one (to be run on that device)."""
    if experiment in TOOL_EXPERIMENTS:
        return TOOL_EXPERIMENTS[experiment]
    return ("make committed-tables" + ("" if experiment == "default" else f" EXPERIMENT={experiment}")
            + (f" COMMITTED={ROOT.as_posix()}/{parent}" if parent else ""))


def write_folder(runs, folder: Path, plots_too: bool = True) -> dict[str, str]:
    """One experiment's tables (and plots) from its runs (aggregate.to_frame's) into `folder`; returns the Markdown
    per table (tables.write_all's)."""
    cells = aggregate.summarise(runs)
    written = tables.write_all(runs, cells, folder)
    if plots_too:
        plots.write_all(runs, cells, folder)
    return written


def regenerate(folder: Path, plots_too: bool = True, gpus: tuple | None = None) -> tuple[dict, list[str]]:
    """Rewrite a committed folder's tables (and plots) from its records.jsonl.gz, predicting on `gpus` (default the
    tables' own); returns the Markdown per table and the problems met reading the records."""
    records, problems = archive.read(folder / archive.ARCHIVE)
    check_declared(records)
    runs = aggregate.to_frame(records, gpus)
    if runs.empty:
        return {}, problems + [f"{folder / archive.ARCHIVE}: no valid records"]
    return write_folder(runs, folder, plots_too), problems


def folders(root: Path) -> list[Path]:
    """Every committed table folder under `root`: those with records, and those with tables only (runs.csv)."""
    found = {p.parent for p in root.rglob(archive.ARCHIVE)} | {p.parent for p in root.rglob("runs.csv")}
    return sorted(found | {root / name for name in TOOL_FOLDERS if (root / name).is_dir()})


def _span(records: list[dict]) -> tuple[str, str]:
    """(dates, wall time) of a folder's records: from the first cell's start to the last one's end."""
    starts = [r["env"].get("started_at") for r in records]
    ends = [r["env"].get("finished_at") for r in records]
    if not all(starts) or not all(ends):
        return "not recorded", "not recorded"
    first, last = min(map(datetime.datetime.fromisoformat, starts)), max(map(datetime.datetime.fromisoformat, ends))
    dates = first.date().isoformat() + ("" if last.date() == first.date() else f" to {last.date().isoformat()}")
    minutes = round((last - first).total_seconds() / 60)
    return dates, f"{minutes // 60} h {minutes % 60:02d} min" if minutes >= 60 else f"{minutes} min"


def _device(record: dict) -> str:
    env = record["env"]
    if env.get("device_type") == "cuda":
        return f"{env['device_name']} (compute capability {env.get('compute_capability')})"
    units = env.get("cpu_16bit_units")
    return f"{env['device_name']} ({', '.join(units) if units else 'no bf16/fp16 units'})" if units is not None \
        else env["device_name"]


def _joined(values) -> str:
    return ", ".join(sorted({str(v) for v in values if v is not None})) or "not recorded"


def describe(folder: Path, root: Path) -> dict:
    """One row of the index."""
    name = folder.relative_to(root).as_posix()
    parent = folder.parent.relative_to(root).as_posix()  # a device's subfolder (h100), or "." at the root
    parent = "" if parent == "." else parent
    on = f" on the device `{parent}` names" if parent else ""
    if name in TOOL_FOLDERS:
        return {"folder": f"[{name}]({name}/)", "experiment": "none (computed, not trained)", "runs": "0",
                "device": "see its vs_published.md", "torch": "", "precision-bench": "", "date": "", "wall time": "",
                "records": f"none: remake with `{TOOL_FOLDERS[name]}`"}
    if not (folder / archive.ARCHIVE).exists():
        runs = pd.read_csv(folder / "runs.csv")
        return {"folder": f"[{name}]({name}/)", "experiment": _joined(runs["experiment"]), "runs": f"{len(runs)}",
                "device": _joined(runs["device"]), "torch": "not recorded", "precision-bench": "not recorded",
                "date": "not recorded", "wall time": "not recorded",
                "records": f"not kept (made before 0.2.0); remake{on}: "
                           + "; ".join(f"`{make_command(e, parent)}`" for e in sorted(set(runs["experiment"])))}
    records, _ = archive.read(folder / archive.ARCHIVE)
    experiments = sorted({r["config"]["experiment_name"] for r in records})
    dates, wall = _span(records)
    ok = sum(r["status"] == "ok" for r in records)
    versions = {f"{r['env'].get('version')} ({str(r['env'].get('git_commit'))[:7]}"
                f"{' + uncommitted changes' if r['env'].get('git_changes') else ''})" for r in records}
    return {"folder": f"[{name}]({name}/)", "experiment": ", ".join(experiments), "runs": f"{len(records)} ({ok} ok)",
            "device": _joined(map(_device, records)), "torch": _joined(r["env"].get("torch_version") for r in records),
            "precision-bench": _joined(versions), "date": dates, "wall time": wall,
            "records": f"[{archive.ARCHIVE}]({name}/{archive.ARCHIVE}); made{on} by "
                       + "; ".join(f"`{make_command(e, parent)}`" for e in experiments)}


def index(root: Path) -> str:
    rows = pd.DataFrame([describe(folder, root) for folder in folders(root)])
    return ("# Committed tables\n\n"
            "Written by `make tables` (bench/reporting/committed.py) from the records in each folder: do not edit.\n"
            "`make tables` regenerates every folder that has its records (a test checks that `default` comes out\n"
            "identical); `make compare` puts your own cells beside a folder's. The device column names the CPU's\n"
            "bf16/fp16 units, which decide whether a 16-bit row ran natively; wall time runs from the first cell's\n"
            "start to the last one's end.\n\n" + rows.to_markdown(index=False) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.reporting.committed", description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=ROOT, help=f"the committed tables (default {ROOT})")
    parser.add_argument("--no-plots", action="store_true", help="tables and index only")
    parser.add_argument("--index-only", action="store_true", help="only the index")
    args = parser.parse_args(argv)
    if not args.root.is_dir():
        print(f"config error: --root {args.root}: not a directory", file=sys.stderr)
        return 2
    for folder in [] if args.index_only else folders(args.root):
        if (folder / archive.ARCHIVE).exists():
            try:
                _, problems = regenerate(folder, not args.no_plots)
            except ConfigError as e:
                print(f"config error: {e}", file=sys.stderr)
                return 2
            for problem in problems:
                print(f"skipped: {problem}", file=sys.stderr)
            print(f"regenerated {folder} from its {archive.ARCHIVE}")
        elif folder.name in TOOL_FOLDERS:
            print(f"kept {folder}: computed by `{TOOL_FOLDERS[folder.name]}`, not from records")
        else:
            print(f"kept {folder}: it has no records (made before 0.2.0)")
    (args.root / INDEX).write_text(index(args.root))
    print(f"index: {args.root / INDEX}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
