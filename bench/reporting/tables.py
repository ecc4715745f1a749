"""Paper-style tables from the per-run frame and the per-cell summary (bench/reporting/aggregate.py).

Written to <out>/<experiment>/, each as Markdown, LaTeX (booktabs) and CSV:
- precision: Raschka's table, one row per setting (and scaling method): time, speed-up vs 32-true, modelled
  memory and its ratio to 32-true, measured peak, TFLOP/s (native), primary metric as mean ± std (n), and the
  paired difference to 32-true with its 95% confidence interval;
- scaling_grid: rows = format setting, columns = scaling method, cells = the primary metric, failures marked;
- squad: the Unit Scaling paper's layout, rows = model x setting, columns = scaling method, cells = EM / F1;
- numerics: skipped steps, final loss scale, underflow / subnormal / overflow fractions per tensor class;
- vs_published: ours beside every published figure whose model, task and setting match a cell;
- unit_scaling_charlm (char-LM cells in two or more of its columns): the Unit Scaling paper's char-LM layout,
  rows = norm, columns = FP16 regular without / with a loss scale, FP16 unit, FP32 regular and unit (then FP8),
  cells = validation BPC and its paired difference to FP32 regular, beside the paper's WikiText-103 figures;
plus runs.csv (one row per run) and cells.csv (the numeric summary).
"""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

from bench.numerics.scaling_methods import scaling_order
from bench.numerics.telemetry import TENSOR_CLASSES
from bench.reporting.aggregate import EVALUATED_WITHOUT_AUTOCAST
from bench.reporting.experiment_tables import (
    DECLARED_TABLES,
    best_learning_rates,
    declared_table_of,
    lr_shift,
)
from bench.reporting.statistics import (
    flag,
)
from bench.reporting.table_cells import (
    EMULATED,
    NOTES,
    ROW_MARKS,
    Table,
    cell_identity,
    cell_unit,
    fmt_difference,
    fmt_mib,
    fmt_seconds,
    fmt_stat,
    fmt_time,
    made_fused_graphs,
    metric_text,
    near_chance_note,
    predicted_cells,
    predicted_gpus,
    published_rows,
    setting_label,
    status_note,
    to_latex,
    to_markdown,
    unpredicted,
)


def precision_table(cells: pd.DataFrame) -> pd.DataFrame:
    rows = []
    for _, c in cells.iterrows():
        emulated = EMULATED if c["backend"] == "emulated" else ""
        rows.append({
            **cell_identity(c, cells), "setting": setting_label(c), "scaling": c["scaling"],
            "train time (s)": fmt_time(c) + emulated,
            "speed-up vs 32-true": "–" if pd.isna(c["speedup_vs_fp32"]) else f"{c['speedup_vs_fp32']:.2f}×{emulated}",
            **{k: v for name in predicted_gpus(cells) for k, v in predicted_cells(c, name).items()},
            "modelled memory (MiB)": fmt_mib(c["step_bytes"]),
            "memory vs 32-true": "–" if pd.isna(c["step_memory_ratio_vs_fp32"])
            else f"{c['step_memory_ratio_vs_fp32']:.2f}",
            "measured peak (MiB)": "–" if pd.isna(c["peak_bytes"]) else f"{c['peak_bytes'] / 2**20:.0f}{emulated}",
            "TFLOP/s": "–" if pd.isna(c["tflop_per_s"]) else f"{c['tflop_per_s']:.3g}",
            (c["metric"] or "metric"): metric_text(c),
            "Δ vs 32-true": fmt_difference(c),
        })
    return pd.DataFrame(rows).fillna("")


def time_to_target_table(cells: pd.DataFrame) -> pd.DataFrame:
    """Time to quality (bench/reporting/quality.py): per cell, its target, the steps its seeds took to reach it (mean
    [95% interval], how many reached it), and those steps at the speed model's compiled step on each GPU."""
    rows = []
    for _, c in cells.iterrows():
        metric_unit = cell_unit(c)
        judged, reached = int(c["target_judged"]), int(c["target_reached"])
        if flag(c.get("baseline_near_chance")):  # its target is chance: no steps or time worth quoting
            reached = 0  # (the predicted times below say "–")
            steps = f"– ({near_chance_note(c)})"
        elif not judged:
            steps = ("no target (no 32-true run with a quality curve)" if pd.isna(c["target"]) else
                     "no quality curve" if c["ok"] else "–")
        elif not reached:
            steps = f"not reached (0 of {judged})"
        else:
            spread = "" if pd.isna(c["steps_to_target_lo"]) else \
                f" [{c['steps_to_target_lo']:.0f}, {c['steps_to_target_hi']:.0f}]"
            steps = f"{c['steps_to_target']:.0f}{spread} ({reached} of {judged})"
        row = {**cell_identity(c, cells), "setting": setting_label(c), "scaling": c["scaling"],
               "target": "–" if pd.isna(c["target"]) else f"{metric_unit.shown(c['target']):.{metric_unit.digits}f}",
               "steps to target": steps}
        for name in predicted_gpus(cells):
            seconds = c[f"predicted_{name}_to_target_s"]
            row[f"predicted time to target ({name})"] = (
                unpredicted(c, name) if pd.isna(c[f"predicted_{name}_compiled_s"]) else
                fmt_seconds(seconds) + ("" if reached == judged else f" ({reached} of {judged} seeds)")
                if reached else "–")
        rows.append(row)
    return pd.DataFrame(rows)


def scaling_grid(cells: pd.DataFrame) -> pd.DataFrame:
    present = scaling_order(cells["scaling"].astype(str))
    rows = []
    for _, part in cells.groupby(["model_label", "variant", "setting", "backend"], observed=True, sort=True):
        row = {**cell_identity(part.iloc[0], cells), "setting": setting_label(part.iloc[0]),
               "metric": part.iloc[0]["metric"]}
        by_scaling = {str(c["scaling"]): c for _, c in part.iterrows()}
        for scaling in present:
            row[scaling] = metric_text(by_scaling[scaling]) if scaling in by_scaling else ""
        rows.append(row)
    return pd.DataFrame(rows)


def squad_table(cells: pd.DataFrame) -> pd.DataFrame:
    qa = cells[cells["metric"] == "f1"]
    present = scaling_order(qa["scaling"].astype(str))
    rows = []
    for _, part in qa.groupby(["model_label", "variant", "setting", "backend"], observed=True, sort=True):
        row = {**cell_identity(part.iloc[0], qa), "setting": setting_label(part.iloc[0])}
        by_scaling = {str(c["scaling"]): c for _, c in part.iterrows()}
        for scaling in present:
            c = by_scaling.get(scaling)
            if c is None:
                row[scaling] = ""
            elif c["exact_match_n"] == 0:
                row[scaling] = f"– [{status_note(c)}]"
            else:
                note = status_note(c)
                row[scaling] = f"{c['exact_match']:.2f} / {c['f1']:.2f}" + (f" [{note}]" if note else "")
        rows.append(row)
    return pd.DataFrame(rows)


def numerics_table(cells: pd.DataFrame) -> pd.DataFrame:
    """Per cell: skipped steps, final loss scale, underflow / overflow per tensor class; where a cell has
    block-scaled operands, their clipped blocks, flushed elements and relative MSE per class too."""
    blocks = any(f"{tc}_rel_mse" in cells and cells[f"{tc}_rel_mse"].notna().any() for tc in TENSOR_CLASSES)

    def pct(v):
        return "–" if pd.isna(v) else f"{100 * v:.3g}%"

    rows = []
    for _, c in cells.iterrows():
        row = {**cell_identity(c, cells), "setting": setting_label(c), "scaling": c["scaling"],
               "skipped steps": "–" if pd.isna(c["skipped_steps"]) else f"{c['skipped_steps']:.1f}",
               "final loss scale": "–" if pd.isna(c["final_loss_scale"]) else f"{c['final_loss_scale']:g}"}
        for tc in TENSOR_CLASSES:
            row[f"{tc} underflow / overflow"] = f"{pct(c[f'{tc}_underflow'])} / {pct(c[f'{tc}_overflow'])}"
        if blocks:
            for tc in TENSOR_CLASSES:
                row[f"{tc} blocks clipped / flushed / rel. MSE"] = \
                    f"{pct(c[f'{tc}_clipped_blocks'])} / {pct(c[f'{tc}_flushed'])} / {pct(c[f'{tc}_rel_mse'])}"
        rows.append(row)
    return pd.DataFrame(rows)




PUBLISHED_COLUMNS = ["source", "model", "task", "setting", "our scaling", "metric", "published", "ours", "difference",
                     "published time (min)", "our time (min)", "our backend / device", "note"]


def _claim_rows(pub: dict, match: pd.DataFrame) -> list[dict]:
    """A published claim (a statement, not a figure) beside what our cells measure of it: the best learning rate's
    move across the widths of a sweep (`best_lr_shift`), or a cell's paired difference to 32-true."""
    base = {"source": pub["source"], "model": pub["model"], "task": pub["task"], "setting": pub["setting"],
            "metric": pub["metric"], "published": pub["claim"], "difference": "–", "published time (min)": "–",
            "our time (min)": "–", "note": pub.get("note", "")}
    if pub["metric"] == "best_lr_shift":
        best = best_learning_rates(match)
        shift = lr_shift(best, pub["scaling"])
        if shift is None:
            return []
        mine = best[best["scaling"].astype(str) == pub["scaling"]]
        first, last = mine.iloc[0], mine.iloc[-1]
        # what the narrowest model's best learning rate costs the widest: a shift may be a step within the noise
        transferred = match[(match["model_label"] == last["model_label"])
                            & (match["scaling"].astype(str) == pub["scaling"]) & (match["lr"] == first["best"]["lr"])]
        cost = "" if transferred.empty or not pd.notna(transferred["value"].iloc[0]) else (
            f"; the widest at the narrowest's best lr: {transferred['value'].iloc[0] - last['best']['value']:+.4f} "
            f"{last['best']['metric']}")
        return [base | {"our scaling": pub["scaling"], "ours": f"{shift:+.0f} (lr {first['best']['lr']:.3g} at "
                        f"{first['model_label']} → {last['best']['lr']:.3g} at {last['model_label']}{cost})",
                        "our backend / device": f"{first['best']['backend']} / {first['best']['device']}"}]
    return [base | {"our scaling": c["scaling"], "ours": fmt_difference(c),
                    "our backend / device": f"{c['backend']} / {c['device']}"} for _, c in match.iterrows()]


def _ran_as_published(settings: dict, config: dict) -> bool:
    """Whether a cell's settings (dotted keys of its semantic config) hold every value a published run names in its
    `config:`; a key the record leaves out is null."""
    def same(ours, theirs):
        if theirs is None:
            return ours is None
        if isinstance(theirs, float) and isinstance(ours, (int, float)) and not isinstance(ours, bool):
            return math.isclose(ours, theirs, rel_tol=1e-9)
        return ours == theirs
    return all(same(settings.get(key), value) for key, value in config.items())


def published_table(cells: pd.DataFrame) -> pd.DataFrame:
    """Ours beside every published figure of the same model, task and setting (and scaling, if it names one, and
    the published run's other settings, if it names them: `config`), and beside every published claim we measure
    (`claim` instead of `value`: _claim_rows)."""
    rows = []
    for pub in published_rows():
        match = cells[(cells["model"] == pub["model"]) & (cells["task"] == pub["task"])
                      & (cells["setting"].astype(str) == pub["setting"])]
        if "scaling" in pub:
            match = match[match["scaling"].astype(str) == pub["scaling"]]
        if "config" in pub:
            match = match[[_ran_as_published(s, pub["config"]) for s in match["settings"]]]
        if "claim" in pub:
            rows += _claim_rows(pub, match)
            continue
        for _, c in match.iterrows():
            metric = pub["metric"]
            n = c["value_n"] if metric == c["metric"] else c[f"{metric}_n"]
            metric_unit = cell_unit(c)
            ours = metric_unit.shown(c["value"] if metric == c["metric"] else c[metric])
            std = metric_unit.shown(c["value_std"] if metric == c["metric"] else c[f"{metric}_std"])
            rows.append({
                "source": pub["source"], "model": pub["model"], "task": pub["task"], "setting": pub["setting"],
                "our scaling": c["scaling"], "metric": metric, "published": f"{pub['value']:.2f}",
                "ours": fmt_stat(ours, std, n, metric_unit.digits),
                "difference": "–" if pd.isna(ours) else f"{ours - pub['value']:+.{metric_unit.digits}f}",
                "published time (min)": pub.get("train_min", "–"),
                "our time (min)": "–" if pd.isna(c["train_s"]) else f"{c['train_s'] / 60:.2f}",
                "our backend / device": f"{c['backend']} / {c['device']}",
                "note": pub.get("note", ""),
            })
    return pd.DataFrame(rows, columns=PUBLISHED_COLUMNS)


# The tables every folder gets, in the order they are written (a preset's declared table follows them)
GENERIC_TABLES = {
    "precision": Table(lambda runs, cells, rows: precision_table(cells),
                       "Time, memory and the primary metric per precision setting", ("timing", "predicted")),
    "scaling_grid": Table(lambda runs, cells, rows: scaling_grid(cells),
                          "Primary metric per format setting (rows) and scaling method (columns)"),
    "numerics": Table(lambda runs, cells, rows: numerics_table(cells),
                      "Numerics health per cell: skipped steps, final loss scale, underflow / overflow fractions"),
    "vs_published": Table(lambda runs, cells, rows: published_table(cells),
                          "Ours beside the published figures for the same model, task and setting"),
    "time_to_target": Table(lambda runs, cells, rows: time_to_target_table(cells),
                            "Steps to the quality target per cell, and the time they take on a GPU by the speed "
                            "model's prediction", ("time_to_target", "predicted")),
    "squad": Table(lambda runs, cells, rows: squad_table(cells) if (cells["metric"] == "f1").any() else None,
                   "SQuAD v1.1 exact match / F1 per model and setting (rows) and scaling method (columns)"),
}


def _common_notes(cells: pd.DataFrame) -> list[str]:
    """The notes every table of these cells carries: the machines that made them first."""
    machines = sorted(set(cells["machine"].dropna().astype(str))) if "machine" in cells else []
    return ([f"made on {'; '.join(machines)}."] if machines else []) + [NOTES["std"]] \
        + ([NOTES["emulated"]] if (cells["backend"] == "emulated").any() else []) \
        + ([NOTES["stalled"]] if cells["stalled"].any() else []) \
        + ([NOTES["clipped"]] if cells[["value_ci_clipped", "value_vs_fp32_clipped"]].map(flag).any(axis=None)
           else []) \
        + ([NOTES["evaluated"]] if cells["evaluated_in"].str.contains(EVALUATED_WITHOUT_AUTOCAST, regex=False).any()
           else [])


def _timing_notes(cells: pd.DataFrame) -> list[str]:
    """The notes of a table with measured times (the `timing` key of a Table's notes)."""
    return [NOTES["time"], NOTES["memory"], NOTES["difference"]] \
        + ([NOTES["disturbed"]] if cells["disturbed"].any() else []) \
        + ([NOTES["compiled"]] if cells["compiled"].astype(bool).any() else []) \
        + ([NOTES["fused_graphs"]] if any(made_fused_graphs(cell) for _, cell in cells.iterrows()) else []) \
        + ([NOTES["native_fp8"]] if ((cells["setting"] == "fp8-mixed") & (cells["backend"] == "native")
                                     & ~cells["compiled"].astype(bool)).any() else [])


def _predicted_notes(cells: pd.DataFrame) -> list[str]:
    """The notes of a table with predicted columns (the `predicted` key), and what a distributed cell's mean."""
    distributed = cells["format_options"].fillna("").str.contains(r"\bparallel=(?:ddp|fsdp2)").any()
    return [NOTES["predicted"]] + ([NOTES["predicted_distributed"]] if distributed else [])


def _marked_in(table: pd.DataFrame, notes: list[str]) -> list[str]:
    """`notes` less those explaining a mark (ROW_MARKS: †, §, ...) that none of the table's cells carries: the folder's
    cells decide which notes its tables may need, and one table shows a mark another does not."""
    text = "".join(table.astype(str).to_numpy().ravel())
    return [n for n in notes if n[:1] not in ROW_MARKS or n[:1] in text]


def write_all(runs: pd.DataFrame, cells: pd.DataFrame, directory: Path) -> dict[str, str]:
    """Every generic table and the one the preset declares (if its cells are there), each as Markdown, LaTeX and CSV,
    with runs.csv and cells.csv; returns each table's Markdown."""
    directory.mkdir(parents=True, exist_ok=True)
    runs.drop(columns=["loss_scale_history", "losses", "settings", "learning", "cell"]).to_csv(
        directory / "runs.csv", index=False)
    cells.drop(columns="settings").to_csv(directory / "cells.csv", index=False)
    declared = declared_table_of(cells)
    chosen = GENERIC_TABLES | ({declared[0]: DECLARED_TABLES[declared[0]]}
                               if declared and declared[0] in DECLARED_TABLES else {})
    rows = declared[1] if declared else []
    common = _common_notes(cells)
    markdown = {}
    for name, entry in chosen.items():
        table = entry.build(runs, cells, rows)
        if table is None:
            continue
        notes = [n for key in entry.notes for n in (_timing_notes(cells) if key == "timing" else
                                                    _predicted_notes(cells) if key == "predicted" else [NOTES[key]])]
        markdown[name] = to_markdown(table, _marked_in(table, common + notes))
        (directory / f"{name}.md").write_text(f"# {entry.caption}\n\n{markdown[name]}\n")
        (directory / f"{name}.tex").write_text(to_latex(table, entry.caption))
        table.to_csv(directory / f"{name}.csv", index=False)
    return markdown
