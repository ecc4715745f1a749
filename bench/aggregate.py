"""Records -> tables. `python -m bench.aggregate RESULTS_DIR [--out DIR]`

Reads every result.json under RESULTS_DIR (a corrupt one is reported by name and skipped), builds
one row per cell, writes `<out>/<experiment>/cells.md` and `cells.csv`, and prints the Markdown.
Speed-up is against the fp32 cell of the same experiment, model, scaling method and seed. Time and
memory of emulated cells measure the emulation, not the format: they carry a dagger and a footnote.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd

from bench.record import RecordError, read_record
from bench.tasks import PRIMARY_METRIC

SETTING_ORDER = ["32-true", "tf32", "16-mixed", "16-true", "bf16-mixed", "bf16-true", "fp8-mixed"]
SCALING_ORDER = ["none", "static", "dynamic", "per_tensor", "unit"]
EMULATED_MARK = "†"
FOOTNOTE = (f"{EMULATED_MARK} emulated in FP32 on this device: its time and memory measure the emulation, "
            "not the format (never a hardware speed-up).")


def load_records(root: Path) -> tuple[list[dict], list[str]]:
    """All valid records under `root`, and one message per record that could not be read."""
    records, problems = [], []
    for path in sorted(Path(root).rglob("result.json")):
        try:
            records.append(read_record(path))
        except RecordError as e:
            problems.append(str(e))
    return records, problems


def to_frame(records: list[dict]) -> pd.DataFrame:
    rows = []
    for r in records:
        cfg, env, numerics = r["config"], r["env"], r["numerics"]
        precision = env.get("precision", {})
        model = cfg["model"]["name"]
        rows.append({
            "experiment": cfg["experiment_name"], "model": model, "setting": precision.get("setting"),
            "scaling": cfg["scaling"]["name"], "seed": cfg["seed"], "backend": precision.get("backend"),
            "device": env.get("device_name"), "status": r["status"],
            "diverged_at_step": numerics.get("diverged_at_step"),
            "metric": PRIMARY_METRIC.get(model), "value": r["metrics"].get(PRIMARY_METRIC.get(model)),
            "train_s": r["timing"].get("train_s"), "step_median_s": r["timing"].get("step_median_s"),
            "peak_bytes": r["memory"].get("peak_bytes"), "skipped_steps": numerics.get("skipped_steps"),
            "final_loss_scale": numerics.get("final_loss_scale"),
        })
    frame = pd.DataFrame(rows)
    if frame.empty:
        return frame
    frame["setting"] = pd.Categorical(frame["setting"], SETTING_ORDER, ordered=True)
    frame["scaling"] = pd.Categorical(frame["scaling"], SCALING_ORDER, ordered=True)
    keys = ["experiment", "model", "scaling", "seed"]
    baseline = frame[frame["setting"] == "32-true"][keys + ["train_s"]].rename(columns={"train_s": "fp32_s"})
    frame = frame.merge(baseline, on=keys, how="left")
    frame["speedup_vs_fp32"] = frame["fp32_s"] / frame["train_s"]
    return frame.drop(columns="fp32_s").sort_values(["experiment", "model", "setting", "scaling", "seed"])


def _fmt(value, pattern: str, emulated: bool = False) -> str:
    if value is None or pd.isna(value):
        return "–"
    return pattern.format(value) + (f" {EMULATED_MARK}" if emulated else "")


def cells_table(frame: pd.DataFrame) -> pd.DataFrame:
    """The human-readable table: one row per cell."""
    rows = []
    for _, r in frame.iterrows():
        emulated = r["backend"] == "emulated"
        status = r["status"] if r["status"] != "diverged" else f"diverged@{int(r['diverged_at_step'])}"
        metric = r["metric"] or "metric"
        value = r["value"] * 100 if metric.endswith("accuracy") and r["value"] is not None else r["value"]
        rows.append({
            "model": r["model"], "format": r["setting"], "scaling": r["scaling"], "seed": r["seed"],
            "backend": r["backend"], "status": status,
            metric.replace("test_accuracy", "test acc (%)"): _fmt(value, "{:.2f}"),
            "train time (s)": _fmt(r["train_s"], "{:.2f}", emulated),
            "speed-up vs fp32": _fmt(r["speedup_vs_fp32"], "{:.2f}×", emulated),
            "peak memory (MiB)": _fmt(r["peak_bytes"] / 2**20 if r["peak_bytes"] else None, "{:.0f}", emulated),
            "skipped steps": _fmt(r["skipped_steps"], "{:.0f}"),
        })
    return pd.DataFrame(rows)


def write_tables(frame: pd.DataFrame, out: Path) -> dict[str, str]:
    """Write cells.md / cells.csv per experiment under `out`; return the Markdown per experiment."""
    written = {}
    for experiment, part in frame.groupby("experiment", sort=True):
        directory = out / str(experiment)
        directory.mkdir(parents=True, exist_ok=True)
        part.to_csv(directory / "cells.csv", index=False)
        table = cells_table(part)
        markdown = table.to_markdown(index=False, disable_numparse=True)
        if (part["backend"] == "emulated").any():
            markdown += "\n\n" + FOOTNOTE
        (directory / "cells.md").write_text(f"# {experiment}\n\n{markdown}\n")
        written[str(experiment)] = markdown
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.aggregate", description=__doc__.splitlines()[0])
    parser.add_argument("sources", nargs="+", type=Path, help="results directories holding */result.json")
    parser.add_argument("--out", type=Path, default=Path("results/tables"), help="where tables go")
    args = parser.parse_args(argv)
    records, problems = [], []
    for source in args.sources:
        if not source.is_dir():
            parser.error(f"{source} is not a directory")
        found, bad = load_records(source)
        records += found
        problems += bad
    for problem in problems:
        print(f"skipped: {problem}", file=sys.stderr)
    if not records:
        print(f"no valid records under {', '.join(map(str, args.sources))}", file=sys.stderr)
        return 1
    for experiment, markdown in write_tables(to_frame(records), args.out).items():
        print(f"## {experiment} ({args.out / experiment})\n\n{markdown}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
