"""Paper-style tables and plots from run records: what `python -m bench.aggregate` runs.

    python -m bench.aggregate SOURCE... [--out DIR] [--experiment NAME] [--no-plots] [--keep-records]
                              [--predict-for H100,B200]

SOURCE is a results directory, a records.jsonl.gz or wandb://entity/project[/group] (bench/reporting/aggregate.py
reads them). Tables go to <out>/<experiment>/ (default results/local/tables; bench/reporting/tables.py), plots
beside them (bench/reporting/plots.py); with --keep-records the records too, and the tables are made from them
(bench/reporting/committed.py), as a committed folder is.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bench.errors import ConfigError
from bench.reporting import archive
from bench.reporting.recorded_predictions import DEFAULT_GPUS
from bench.speed.profiles import gpu, shipped_gpus


def main(argv: list[str] | None = None, api=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.aggregate", description=__doc__.splitlines()[0])
    parser.add_argument("sources", nargs="+", help="results directories or wandb://entity/project[/group]")
    parser.add_argument("--out", type=Path, default=Path("results/local/tables"),
                        help="where tables and plots go (default results/local/tables: committed tables are never "
                             "rewritten unless named)")
    parser.add_argument("--experiment", help="only this experiment_name")
    parser.add_argument("--no-plots", action="store_true", help="tables only")
    parser.add_argument("--predict-for", default=",".join(DEFAULT_GPUS),
                        help="the GPUs the tables predict each cell's step and time to target on: shipped profiles "
                             f"({', '.join(shipped_gpus())}) or profiles' yaml paths, comma-separated (default: "
                             f"{','.join(DEFAULT_GPUS)})")
    parser.add_argument("--keep-records", action="store_true",
                        help=f"write each experiment's records beside its tables ({archive.ARCHIVE}) and make the "
                             "tables from them: a folder to commit, which `make tables` regenerates")
    args = parser.parse_args(argv)
    if missing := [s for s in args.sources if not str(s).startswith("wandb://") and not Path(s).is_dir()
                   and not (Path(s).name == archive.ARCHIVE and Path(s).is_file())]:
        print(f"config error: {', '.join(missing)}: not a results directory, {archive.ARCHIVE} or "
              "wandb://entity/project[/group]", file=sys.stderr)
        return 2
    from bench.reporting import aggregate, committed  # (pandas, matplotlib, torch: after the arguments are checked)

    try:
        gpus = tuple(gpu(name) for name in args.predict_for.split(",") if name)
        records, problems = aggregate.load_sources(args.sources, api)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    for problem in problems:
        print(f"skipped: {problem}", file=sys.stderr)
    frame = aggregate.to_frame(records, gpus)
    if args.experiment and not frame.empty:
        frame = frame[frame["experiment"] == args.experiment]
    if frame.empty:
        print(f"no valid records in {', '.join(args.sources)}", file=sys.stderr)
        return 1
    for experiment, runs in frame.groupby("experiment", sort=True):
        directory = args.out / str(experiment)
        if args.keep_records:
            archive.write([r for r in aggregate.unique(records) if r["config"]["experiment_name"] == experiment],
                          directory / archive.ARCHIVE)
            written, _ = committed.regenerate(directory, not args.no_plots, gpus)
        else:
            written = committed.write_folder(runs, directory, not args.no_plots)
        print(f"## {experiment}: what each setting costs in accuracy and gains in time and memory against 32-true "
              f"(all tables: {directory})\n\n{written['precision']}\n")
    return 0
