"""Paper-style tables and plots from run records: what `python -m bench.aggregate` runs.

    python -m bench.aggregate SOURCE... [--out DIR] [--experiment NAME] [--no-plots]

SOURCE is a results directory or wandb://entity/project[/group] (bench/reporting/aggregate.py reads them). Tables
go to <out>/<experiment>/ (default results/local/tables; bench/reporting/tables.py), plots beside them
(bench/reporting/plots.py).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bench.errors import ConfigError
from bench.reporting import aggregate, plots, tables


def main(argv: list[str] | None = None, api=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.aggregate", description=__doc__.splitlines()[0])
    parser.add_argument("sources", nargs="+", help="results directories or wandb://entity/project[/group]")
    parser.add_argument("--out", type=Path, default=Path("results/local/tables"),
                        help="where tables and plots go (default results/local/tables: committed tables are never rewritten"
                             " unless named)")
    parser.add_argument("--experiment", help="only this experiment_name")
    parser.add_argument("--no-plots", action="store_true", help="tables only")
    args = parser.parse_args(argv)
    if missing := [s for s in args.sources if not str(s).startswith("wandb://") and not Path(s).is_dir()]:
        print(f"config error: {', '.join(missing)}: not a results directory or wandb://entity/project[/group]",
              file=sys.stderr)
        return 2
    try:
        records, problems = aggregate.load_sources(args.sources, api)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    for problem in problems:
        print(f"skipped: {problem}", file=sys.stderr)
    frame = aggregate.to_frame(records)
    if args.experiment and not frame.empty:
        frame = frame[frame["experiment"] == args.experiment]
    if frame.empty:
        print(f"no valid records in {', '.join(args.sources)}", file=sys.stderr)
        return 1
    for experiment, runs in frame.groupby("experiment", sort=True):
        directory = args.out / str(experiment)
        cells = aggregate.summarise(runs)
        written = tables.write_all(runs, cells, directory)
        if not args.no_plots:
            plots.write_all(runs, cells, directory)
        print(f"## {experiment}: what each setting costs in accuracy and gains in time and memory against 32-true "
              f"(all tables: {directory})\n\n{written['precision']}\n")
    return 0
