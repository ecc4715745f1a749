"""Plots beside the tables (PNG and SVG): metric vs train time, format x scaling heatmap, loss curves and
loss-scale trajectories, one set per model as configured and per settings variant, in the tables' units.
Emulated cells are drawn hollow: their time is the emulation's, not the format's. A cell with diverged or
failed runs is crossed: its point is the mean of the runs that finished."""

from __future__ import annotations

import re
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from bench.numerics.scaling import LOSS_SCALING
from bench.numerics.scaling_methods import SCALING_METHODS, scaling_class, scaling_order
from bench.reporting.experiment_tables import BlockRow, best_learning_rates, declared_table_of, parametrisation
from bench.reporting.statistics import SIGNIFICANT
from bench.reporting.table_cells import cell_unit, fmt_difference

MARKERS = dict(zip(SCALING_METHODS, "os^Dv"))  # the first five methods, in the registry's order
# The same records draw the same bytes (a committed figure is checked against its records): SVG element ids
# from a fixed salt, and no creation date in either file.
plt.rcParams["svg.hashsalt"] = "precision-bench"
METADATA = {".svg": {"Date": None}, ".png": {}}


def _save(fig, directory: Path, name: str) -> list[Path]:
    for ax in fig.axes:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6, ncol=3)
    paths = [directory / f"{name}.png", directory / f"{name}.svg"]
    for path in paths:
        fig.savefig(path, bbox_inches="tight", dpi=120, metadata=METADATA[path.suffix])
    plt.close(fig)
    return paths


def _metric_label(part: pd.DataFrame) -> str:
    return f"{part['metric'].iloc[0]}{cell_unit(part.iloc[0]).suffix}"


def _with_interval(c) -> tuple[float, list | None]:
    """A cell's mean in its shown units, and its 95% interval as errorbar's [[below], [above]] (None: no interval)."""
    shown = cell_unit(c).shown
    value = shown(c["value"])
    if pd.isna(c["value_ci_lo"]):
        return value, None
    return value, [[value - shown(c["value_ci_lo"])], [shown(c["value_ci_hi"]) - value]]


def metric_vs_time(part: pd.DataFrame, title: str, directory: Path, name: str) -> list[Path]:
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    settings = list(dict.fromkeys(part["setting"].astype(str)))
    colours = dict(zip(settings, plt.cm.tab10.colors))
    for _, c in part.iterrows():
        emulated = c["backend"] == "emulated"
        colour = colours[str(c["setting"])]
        value, interval = _with_interval(c)
        time_range = None if c["train_s_n"] < 2 else [[c["train_s"] - c["train_s_min"]],
                                                          [c["train_s_max"] - c["train_s"]]]
        ax.errorbar(c["train_s"], value, yerr=interval, xerr=time_range, fmt="none",
                    ecolor=colour, elinewidth=0.8, capsize=2)
        ax.scatter(c["train_s"], value, marker=MARKERS.get(str(c["scaling"]), "o"), s=60,
                   facecolors="none" if emulated else colour, edgecolors=colour, linewidths=1.5)
        if c["diverged"] or c["failed"]:
            ax.scatter(c["train_s"], value, marker="x", s=90, color="red", linewidths=1.2)
    for setting in settings:
        ax.scatter([], [], color=colours[setting], label=setting)
    for scaling in dict.fromkeys(part["scaling"].astype(str)):
        ax.scatter([], [], marker=MARKERS.get(scaling, "o"), facecolors="none", edgecolors="grey", label=scaling)
    if (part["diverged"] + part["failed"]).any():
        ax.scatter([], [], marker="x", color="red", label="some runs diverged/failed")
    ax.set_xlabel("train time (s): median over seeds, bars min–max; hollow = emulated")
    ax.set_ylabel(f"{_metric_label(part)}: mean over seeds, bars 95% t interval")
    ax.set_title(f"{title}: {part['metric'].iloc[0]} vs train time", fontsize=9)
    return _save(fig, directory, f"{name}_metric_vs_time")


def heatmap(part: pd.DataFrame, title: str, directory: Path, name: str) -> list[Path]:
    labels = [f"{s}{' †' if b == 'emulated' else ''}" for s, b in
              dict.fromkeys(zip(part["setting"].astype(str), part["backend"]))]
    rows = list(dict.fromkeys(zip(part["setting"].astype(str), part["backend"])))
    columns = scaling_order(part["scaling"].astype(str))
    grid = np.full((len(rows), len(columns)), np.nan)
    texts = np.full(grid.shape, "–", dtype=object)
    for _, c in part.iterrows():
        i, j = rows.index((str(c["setting"]), c["backend"])), columns.index(str(c["scaling"]))
        grid[i, j] = cell_unit(c).shown(c["value"])
        if not np.isnan(grid[i, j]):  # the mean, then the paired difference to 32-true with its 95% interval
            texts[i, j] = f"{grid[i, j]:.3g}\n{fmt_difference(c, with_n=False)}"
    fig, ax = plt.subplots(figsize=(1.6 * len(columns) + 2, 0.7 * len(rows) + 1.5))
    image = ax.imshow(grid, cmap="viridis", aspect="auto")
    ax.set_xticks(range(len(columns)), columns)
    ax.set_yticks(range(len(rows)), labels)
    for (i, j), text in np.ndenumerate(texts):
        ax.text(j, i, text, ha="center", va="center", color="w", fontsize=6)
    fig.colorbar(image, ax=ax, label=_metric_label(part))
    ax.set_title(f"{title}: {part['metric'].iloc[0]} by format and scaling\n(mean; Δ vs 32-true [95% interval], "
                 f"{SIGNIFICANT} = excludes 0)", fontsize=9)
    return _save(fig, directory, f"{name}_heatmap")


def loss_curves(runs: pd.DataFrame, title: str, directory: Path, name: str) -> list[Path]:
    """One panel per scaling method, one colour per setting, one thin line per seed."""
    scalings = [str(x) for x in dict.fromkeys(runs["scaling"].astype(str))]
    colours = dict(zip(dict.fromkeys(runs["setting"].astype(str)), plt.cm.tab10.colors))
    fig, axes = plt.subplots(1, len(scalings), figsize=(3.2 * len(scalings) + 1, 3.6), sharey=True, squeeze=False)
    for ax, scaling in zip(axes[0], scalings):
        labelled = set()
        for _, r in runs[runs["scaling"].astype(str) == scaling].iterrows():
            setting = str(r["setting"])
            if r["losses"]:
                steps, losses = zip(*r["losses"])
                ax.plot(steps, losses, lw=0.8, color=colours[setting],
                        label=None if setting in labelled else setting)
                labelled.add(setting)
        ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_title(scaling, fontsize=9)
    axes[0][0].set_ylabel("training loss")
    fig.suptitle(f"{title}: training loss (one line per seed)", fontsize=9)
    return _save(fig, directory, f"{name}_loss_curves")


def loss_scale_trajectories(runs: pd.DataFrame, title: str, directory: Path, name: str) -> list[Path]:
    fig, ax = plt.subplots(figsize=(7, 4))
    for _, r in runs.iterrows():
        history = r["loss_scale_history"]
        if history and r["loss_scaling"] in LOSS_SCALING[1:]:  # a loss scale that is not 1
            steps = [h[0] for h in history] + [r["steps"]]  # hold the last scale to the end of the run
            scales = [h[1] for h in history] + [history[-1][1]]
            ax.step(steps, scales, where="post", lw=1, label=f"{r['setting']}/{r['scaling']}/s{r['seed']}")
    ax.set_yscale("log", base=2)
    ax.set_xlabel("step")
    ax.set_ylabel("loss scale")
    ax.set_title(f"{title}: loss-scale trajectories (static and dynamic)", fontsize=9)
    return _save(fig, directory, f"{name}_loss_scale")


def metric_vs_bits(part: pd.DataFrame, title: str, directory: Path, name: str,
                   block_rows: list[BlockRow]) -> list[Path]:
    """block_formats: the metric (mean, 95% t interval) against bits per element (the preset's declared rows, log
    scale); filled markers round gradients to nearest, hollow ones stochastically."""
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    # one colour per format and recipe, both roundings
    formats = list(dict.fromkeys((r.setting, r.scaling, r.options) for r in block_rows))
    for block_row in block_rows:
        setting, scaling, rounding, label, bits, options = block_row
        match = part[block_row.selects(part)]
        if match.empty:
            continue
        c = match.iloc[0]
        value, interval = _with_interval(c)
        colour = plt.cm.tab10.colors[formats.index((setting, scaling, options)) % 10]
        # side by side with its nearest twin, another recipe of the format on the other side
        x = bits * (1.02 if rounding == "stochastic" else 0.98 if options else 1.0)
        ax.errorbar(x, value, yerr=interval, fmt="none", ecolor=colour, elinewidth=0.8, capsize=2)
        ax.scatter(x, value, s=60, color=colour, facecolors="none" if rounding == "stochastic" else colour,
                   label=label.split(" (")[0] if rounding == "nearest" else None)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("bits per element, scales included (hollow: stochastic rounding of gradients)")
    ax.set_ylabel(f"{_metric_label(part)}: mean over seeds, bars 95% t interval")
    ax.set_title(f"{title}: {part['metric'].iloc[0]} vs bits per element", fontsize=9)
    ax.legend(fontsize=7)
    return _save(fig, directory, f"{name}_metric_vs_bits")


def lr_transfer(cells: pd.DataFrame, directory: Path) -> list[Path]:
    """The u-μP paper's learning-rate transfer plot, in its style: the metric against the learning rate (log 2), one
    curve per model as configured (a width), one panel per parametrisation; each curve's best learning rate starred.
    Diverged cells are missing."""
    best = best_learning_rates(cells)
    scalings = list(dict.fromkeys(str(s) for s in best["scaling"]))
    fig, axes = plt.subplots(1, len(scalings), figsize=(5 * len(scalings), 4), squeeze=False)
    for ax, scaling in zip(axes[0], scalings):
        labels = best[best["scaling"].astype(str) == scaling]
        for (_, row), colour in zip(labels.iterrows(), plt.cm.viridis(np.linspace(0, 0.85, len(labels)))):
            part = cells[(cells["scaling"].astype(str) == scaling) & (cells["model_label"] == row["model_label"])]
            part = part.sort_values("lr")
            ax.plot(part["lr"], part["value"], "o-", color=colour, ms=3, lw=1,
                    label=row["model_label"].split("(")[-1].split(",")[0])
            ax.scatter([row["best"]["lr"]], [row["best"]["value"]], marker="*", s=120, color=colour, zorder=3)
        ax.set_xscale("log", base=2)
        ax.set_xlabel(scaling_class(scaling).lr_meaning if scaling in SCALING_METHODS else "learning rate")
        ax.set_title(parametrisation(scaling), fontsize=9)
    axes[0][0].set_ylabel(f"{cells['metric'].iloc[0]} (★ best per width)")
    values = cells["value"].dropna()
    if not values.empty:  # the region around the optima: diverging learning rates would squash it
        low = values.min()
        for ax in axes[0]:
            ax.set_ylim(low - 0.05, min(values.max(), low + 1.0) + 0.05)
    return _save(fig, directory, f"{cells['model'].iloc[0]}_lr_transfer")


def write_all(runs: pd.DataFrame, cells: pd.DataFrame, directory: Path) -> list[Path]:
    """Per model as configured and settings variant: `<model>[_<configuration>][_<variant>]_<plot>.png`/`.svg`,
    the configuration (model_label's parenthesis, e.g. `4L_128_post-norm_shakespeare_char`) named only where one
    model appears in several (charlm's pre- and post-norm would otherwise write the same files)."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    labels_per_model = cells.groupby("model")["model_label"].nunique()
    declared = declared_table_of(cells)
    if declared and declared[0] == "lr_transfer":
        # one figure: the usual set per variant would be one per learning rate
        return lr_transfer(cells, directory)
    if declared and declared[0] == "block_formats":  # the table the preset declares, as tables.write_all reads it
        for model, part in cells.groupby("model", sort=False):
            paths += metric_vs_bits(part, part["model_label"].iloc[0], directory, model, declared[1])
    for (model, label, variant), part in cells.groupby(["model", "model_label", "variant"], sort=False):
        configuration = label.partition("(")[2].rstrip(")") if labels_per_model[model] > 1 else ""
        name = "_".join([model] + [re.sub(r"[^A-Za-z0-9.=-]+", "_", t).strip("_")
                                   for t in (configuration, variant) if t])
        title = f"{label}{f' [{variant}]' if variant else ''}"
        its_runs = runs[(runs["model_label"] == label) & (runs["variant"] == variant)]
        paths += metric_vs_time(part, title, directory, name)
        paths += heatmap(part, title, directory, name)
        paths += loss_curves(its_runs, title, directory, name)
        paths += loss_scale_trajectories(its_runs, title, directory, name)
    return paths
