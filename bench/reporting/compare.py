"""Your results beside the committed ones, cell by cell: `python -m bench.compare MINE [--against FOLDER]`.

MINE is a results directory (records, as `make sweep` writes them), a records.jsonl.gz (a committed folder's
records, bench/reporting/archive.py) or wandb://entity/project[/group]. FOLDER is a
committed table folder (default results/tables/default), or tables of your own, which the output calls the
reference rather than committed ones; its `cells.csv` holds each cell's mean over seeds and the
95% t interval of that mean, and its `vs_published.csv` the published figure where one exists. Cells pair by
experiment, model as configured, setting, scaling method, variant and number of training steps (a configuration
hash holds the device). Your runs' variants are read against the folder's records where it keeps them
(`aggregate.variants`' usual_from), so what else MINE holds does not change them. Where your device or backend
differs from the committed cell's (an AMD CPU emulates the bf16 an Intel CPU with AMX runs natively) the row says
so, since its numerics need not agree.

Each of your cells is *within* when its mean lies in the committed cell's interval, *outside* when it does not
(better or worse, by the direction the model declares, `model.task.higher_is_better`), and has *no interval* when
the committed cell had one seed. Exit 0 when nothing is outside, 1 when something is,
2 for bad input or when none of your cells pairs (each said with the first key where the folder's cells part from it).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd

from bench.data import DATA_DIR
from bench.errors import ConfigError
from bench.reporting import aggregate, archive
from bench.reporting.statistics import CLIPPED, flag
from bench.reporting.table_cells import cell_unit, fmt_stat, setting_label
from bench.running.config import task_spec

KEYS = ["experiment", "model_label", "setting", "scaling", "variant"]


def _with_steps(cells: pd.DataFrame, runs: pd.DataFrame) -> pd.DataFrame:
    """Cells with the median number of training steps of their runs (a smoke run never pairs with a full one), their
    variant labels in key order (`aggregate.canonical_variant`)."""
    runs = runs.assign(setting=runs["setting"].astype(str), scaling=runs["scaling"].astype(str),
                       variant=runs["variant"].map(aggregate.canonical_variant))
    steps = runs.groupby(KEYS)["steps"].median().rename("steps").reset_index()
    cells = cells.assign(setting=cells["setting"].astype(str), scaling=cells["scaling"].astype(str),
                         variant=cells["variant"].map(aggregate.canonical_variant))
    return cells.merge(steps, on=KEYS, how="left")
COMMITTED_TABLES = DATA_DIR.parents[1] / "results" / "tables"  # this checkout's committed table folders
DEFAULT_AGAINST = Path("results/tables/default")


def committed_cells(folder: Path) -> pd.DataFrame:
    """The committed folder's cells, with the published figure beside each where vs_published.csv has one."""
    if not (folder / "cells.csv").is_file():
        raise ConfigError(f"--against {folder}: no cells.csv there; a committed table folder is one of "
                          f"{', '.join(sorted(str(p.parent) for p in Path('results/tables').glob('*/cells.csv')))}")
    cells = _with_steps(pd.read_csv(folder / "cells.csv"), pd.read_csv(folder / "runs.csv"))
    published = folder / "vs_published.csv"
    if published.is_file():
        pub = pd.read_csv(published).rename(columns={"our scaling": "scaling", "published": "published_value"})
        pub = pub[pub["metric"].notna()].drop_duplicates(["model", "task", "setting", "scaling", "metric"])
        pub["published_value"] = pd.to_numeric(pub["published_value"], errors="coerce")  # a claim is no figure
        cells = cells.merge(pub[["model", "task", "setting", "scaling", "metric", "published_value"]],
                            on=["model", "task", "setting", "scaling", "metric"], how="left")
    else:
        cells["published_value"] = float("nan")
    return cells


def _committed_runs(folder: Path) -> pd.DataFrame | None:
    """The folder's runs from its records (None where it keeps none): your runs' variants are read against their
    usual settings, as the folder's own were, so a cell pairs whatever else your results hold (a smoke run beside
    a full one made the full one the variant)."""
    path = folder / archive.ARCHIVE
    if not path.is_file():
        return None
    records, _ = archive.read(path)
    return aggregate.to_frame(records)


def reference_name(folder: Path) -> str:
    """How the tables name the folder compared against: "committed" for one of results/tables/ in this checkout,
    "reference" for any other (your own tables are not committed ones)."""
    return "committed" if Path(folder).resolve().parent == COMMITTED_TABLES.resolve() else "reference"


def compare(mine: pd.DataFrame, committed: pd.DataFrame,
            higher_is_better: dict[str, bool] | None = None, reference: str = "committed") -> pd.DataFrame:
    """One row per cell of mine that the folder compared against has: both means, its interval, the published
    figure, the difference and the verdict; an outside one says whether it is better or worse, by the direction the
    model declares (`higher_is_better`, by model name; default higher). `reference`: how the columns name that folder
    (`reference_name`)."""
    paired = mine.merge(committed, on=[*KEYS, "steps"], suffixes=("", "_committed"))
    rows = []
    for _, c in paired.iterrows():
        metric, metric_unit = c["metric"], cell_unit(c)
        shown, digits = metric_unit.shown, metric_unit.digits
        lo, hi = c["value_ci_lo_committed"], c["value_ci_hi_committed"]
        clipped = CLIPPED if flag(c.get("value_ci_clipped_committed")) else ""
        verdict = "no interval" if pd.isna(lo) else "within" if lo <= c["value"] <= hi else "outside"
        if verdict == "outside":
            higher = (higher_is_better or {}).get(c["model"], True)
            verdict += " (better)" if (c["value"] > hi) == higher else " (worse)"
        differs = [what for what, a, b in (("device", c["device"], c["device_committed"]),
                                           ("backend", c["backend"], c["backend_committed"])) if a != b]
        rows.append({
            "model": c["model_label"], "setting": setting_label(c),
            "scaling": c["scaling"], "metric": metric,
            "mine": fmt_stat(shown(c["value"]), shown(c["value_std"]), c["value_n"], digits),
            f"{reference} [95% interval]": "–" if pd.isna(c["value_committed"]) else
            f"{shown(c['value_committed']):.{digits}f}"
            + ("" if pd.isna(lo) else f" [{shown(lo):.{digits}f}, {shown(hi):.{digits}f}]{clipped}"),
            "published": "–" if pd.isna(c.get("published_value")) else f"{c['published_value']:g}",
            f"mine − {reference}": f"{shown(c['value'] - c['value_committed']):+.{digits}f}",
            "verdict": verdict, "differs": ", ".join(differs)})
    return pd.DataFrame(rows)


def unpaired(mine: pd.DataFrame, committed: pd.DataFrame, reference: str = "committed", shown: int = 5) -> list[str]:
    """Why each of your cells (the first `shown`) paired with none: the first key, in the order cells pair by, where
    the folder's cells that agree with it on the keys before part from it, and their values there."""
    def text(value) -> str:  # a median of steps is a float: 425.0 reads 425; the usual cell's variant is ""
        return f"{value:g}" if isinstance(value, float) else str(value) or "(none)"

    keys, lines = [*KEYS, "steps"], []
    named = {"model_label": "model"}  # as the tables' columns name it
    cells = mine.drop_duplicates(keys)
    for _, cell in cells.head(shown).iterrows():
        agreeing = committed
        for i, key in enumerate(keys):
            same = agreeing[agreeing[key].map(text) == text(cell[key])]
            if same.empty:
                values = sorted({text(v) for v in agreeing[key]})
                agree = [named.get(k, k) for k in keys[:i]]
                lines.append(f"- yours, {', '.join(f'{named.get(k, k)} {text(cell[k])}' for k in keys[:i + 1])}: "
                             f"the {reference} cells{' of the same ' + ', '.join(agree) if agree else ''} have "
                             f"{named.get(key, key)} {', '.join(values[:8])}{' ...' if len(values) > 8 else ''}")
                break
            agreeing = same
    if len(cells) > shown:
        lines.append(f"- and {len(cells) - shown} more cells of yours")
    return lines


def _units(records: list[dict]) -> str | None:
    """The 16-bit instruction sets of the CPUs that ran `records` (env.cpu_16bit_units), or None off CPU / unknown."""
    found = {", ".join(r["env"]["cpu_16bit_units"]) for r in records
             if r["env"].get("device_type") == "cpu" and r["env"].get("cpu_16bit_units") is not None}
    return "; ".join(sorted(found)) if found else None


def main(argv: list[str] | None = None, api=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.compare", description=__doc__.splitlines()[0])
    parser.add_argument("mine", help=f"your results directory (records), a {archive.ARCHIVE}, or "
                                     "wandb://entity/project[/group]")
    parser.add_argument("--against", type=Path, default=DEFAULT_AGAINST, help="a committed table folder")
    args = parser.parse_args(argv)
    try:
        mine = Path(args.mine)
        if not (str(args.mine).startswith("wandb://") or mine.is_dir()
                or (mine.name == archive.ARCHIVE and mine.is_file())):
            raise ConfigError(f"{args.mine}: not a results directory, a {archive.ARCHIVE} or "
                              "wandb://entity/project[/group]")
        committed = committed_cells(args.against)
        records, _ = aggregate.load_sources([args.mine], api)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    frame = aggregate.to_frame(records, usual_from=_committed_runs(args.against))
    if frame.empty:
        print(f"config error: no valid records in {args.mine}", file=sys.stderr)
        return 2
    directions = {r["config"]["model"]["name"]: task_spec(r["config"]["model"]).get("higher_is_better", True)
                  for r in records}
    reference = reference_name(args.against)
    cells = _with_steps(aggregate.summarise(frame), frame)
    table = compare(cells, committed, directions, reference)
    if table.empty:
        print(f"nothing compared: none of the cells in {args.mine} is among {args.against}'s (they pair by experiment, "
              "model, setting, scaling, variant and training steps):\n"
              + "\n".join(unpaired(cells, committed, reference)),
              file=sys.stderr)
        return 2
    outside = int(table["verdict"].str.startswith("outside").sum())
    units = {"yours": _units(records), "committed": _units(archive.read(args.against / archive.ARCHIVE)[0])
             if (args.against / archive.ARCHIVE).is_file() else None}
    devices = sorted(set(frame["device"].dropna()))
    committed_devices = sorted(set(committed["device"].dropna()))
    print(f"## Yours ({', '.join(devices)}) beside {args.against} ({', '.join(committed_devices)})\n")
    print(table.drop(columns=["differs"] if not table["differs"].astype(bool).any() else []).to_markdown(
        index=False, disable_numparse=True))
    print(f"\n{len(table)} cells paired: {int((table['verdict'] == 'within').sum())} within the {reference} cell's 95% "
          f"interval of its mean, {outside} outside, {int((table['verdict'] == 'no interval').sum())} without one"
          + ("; a device or backend that differs can move a cell honestly (emulated bf16 on a CPU without "
             "avx512_bf16 is not the native bf16 of one with it)" if table["differs"].astype(bool).any() else "") + ".")
    if None not in units.values() and units["yours"] != units["committed"]:
        print(f"Your CPU's bf16/fp16 units: {units['yours'] or 'none'}; the {reference} run's: "
              f"{units['committed'] or 'none'}. Rows in bf16 or fp16 that differ did so because of the device (native "
              "on one, emulated or slower on the other), not the code.")
    return 1 if outside else 0
