"""Plots beside the tables (PNG and SVG): metric vs time to target (on a GPU, predicted by the speed model), format x
scaling heatmap, loss curves and loss-scale trajectories, one set per model as configured and per settings variant,
in the tables' units. Emulated cells are drawn hollow. A cell with diverged or failed runs is crossed: its point is
the mean of the runs that finished; one with stalled runs is drawn without them and marked ¶. Legends sit outside
the data."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path
from typing import NamedTuple

import matplotlib

matplotlib.use("Agg")
import matplotlib.lines
import matplotlib.pyplot as plt
import matplotlib.ticker
import numpy as np
import pandas as pd

from bench.numerics.scaling import LOSS_SCALING
from bench.numerics.scaling_methods import SCALING_METHODS, scaling_class, scaling_order
from bench.reporting.experiment_tables import BlockRow, best_learning_rates, declared_table_of, parametrisation
from bench.reporting.statistics import SIGNIFICANT
from bench.reporting.table_cells import STALLED, cell_unit, fmt_difference

MARKER_CYCLE = "os^Dv<>pPhX*"  # one per scaling method: the registry's in its order, then plug-ins as they appear
TIME_GPUS = ("H100", "B200", "A100", "H200", "V100")  # metric_vs_time's x-axis: the first GPU with a time
# The same records draw the same bytes (a committed figure is checked against its records): SVG element ids
# from a fixed salt, and no creation date in either file.
plt.rcParams["svg.hashsalt"] = "precision-bench"
METADATA = {".svg": {"Date": None}, ".png": {}}


def _save(fig, directory: Path, name: str) -> list[Path]:
    for ax in fig.axes:
        if ax.get_legend_handles_labels()[0] and ax.get_legend() is None:  # outside the data, to the right
            ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
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


def scaling_markers(scalings) -> dict[str, str]:
    """A distinct marker per scaling method: the registry's methods in its order, then any other (a plug-in) as it
    comes, so a plug-in never shares `none`'s circle."""
    known = list(SCALING_METHODS)
    ordered = known + [s for s in dict.fromkeys(map(str, scalings)) if s not in known]
    return {name: MARKER_CYCLE[i % len(MARKER_CYCLE)] for i, name in enumerate(ordered)}


class TimeAxis(NamedTuple):
    """metric_vs_time's x-axis: each cell's time, the error bar below and above it, what the time is (the title's
    words), and the axis label."""

    time: pd.Series
    below: pd.Series
    above: pd.Series
    quantity: str
    label: str


def time_axis(part: pd.DataFrame) -> TimeAxis:
    """Each cell's time to target on the first GPU of TIME_GPUS with a prediction for any cell (the speed model's
    step x the cell's steps to target; its own measured step where it ran natively there: its prediction has an
    error), with the 95% interval of its steps as error bars; else the measured train time on this device."""
    for name in TIME_GPUS:
        if f"predicted_{name}_to_target_s" in part and part[f"predicted_{name}_to_target_s"].notna().any():
            measured = part[f"predicted_{name}_error"].notna()
            step = part[f"predicted_{name}_compiled_s"].where(~measured, part["step_median_s"])
            time = part["steps_to_target"] * step
            return TimeAxis(time, time - part["steps_to_target_lo"] * step, part["steps_to_target_hi"] * step - time,
                            "time to target",
                            f"time to target on {name} (s), predicted by the speed model (measured where the cell ran "
                            f"natively there): mean over seeds, bars 95% interval\n(how far off the model has been: "
                            "results/bench/speed_model_validation.md)")
    return TimeAxis(part["train_s"], part["train_s"] - part["train_s_min"], part["train_s_max"] - part["train_s"],
                    "train time", "train time on this device (s): median over seeds, bars min–max")


def metric_vs_time(part: pd.DataFrame, title: str, directory: Path, name: str) -> list[Path]:
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    settings = list(dict.fromkeys(part["setting"].astype(str)))
    colours = dict(zip(settings, plt.cm.tab10.colors))
    markers = scaling_markers(part["scaling"].astype(str))
    time, below, above, quantity, time_label = time_axis(part)
    left_out = []
    for index, c in part.iterrows():
        emulated = c["backend"] == "emulated"
        colour = colours[str(c["setting"])]
        if pd.isna(time[index]):
            left_out.append(f"{c['setting']}/{c['scaling']}")
            continue
        stalled = c["stalled"] > 0 and pd.notna(c["value_without_stalled"])
        value, interval = _with_interval(c)
        if stalled:  # the runs that learned, marked: a stalled run's metric would stretch the axis for one point
            value, interval = cell_unit(c).shown(c["value_without_stalled"]), None
            ax.annotate(STALLED, (time[index], value), xytext=(5, 3), textcoords="offset points", fontsize=9)
        spread = None if pd.isna(below[index]) else [[max(below[index], 0)], [max(above[index], 0)]]
        ax.errorbar(time[index], value, yerr=interval, xerr=spread, fmt="none", ecolor=colour, elinewidth=0.8,
                    capsize=2)
        ax.scatter(time[index], value, marker=markers[str(c["scaling"])], s=60,
                   facecolors="none" if emulated else colour, edgecolors=colour, linewidths=1.5)
        if c["diverged"] or c["failed"]:
            ax.scatter(time[index], value, marker="x", s=90, color="red", linewidths=1.2)
    for setting in settings:
        ax.scatter([], [], color=colours[setting], label=setting)
    for scaling in dict.fromkeys(part["scaling"].astype(str)):
        ax.scatter([], [], marker=markers[scaling], color="grey", label=f"scaling={scaling}")
    if (part["backend"] == "emulated").any():
        ax.scatter([], [], marker="o", facecolors="none", edgecolors="black", label="hollow: emulated here")
    if (part["diverged"] + part["failed"]).any():
        ax.scatter([], [], marker="x", color="red", label="some runs diverged/failed")
    if (part["stalled"] > 0).any():
        ax.scatter([], [], marker="$¶$", color="black", label=f"{STALLED} without its stalled runs")
    if left_out:
        ax.text(0.0, -0.22, "not shown (no time on the GPU, or the target never reached): " + ", ".join(left_out),
                transform=ax.transAxes, fontsize=6, wrap=True)
    shown = time.dropna()
    if not shown.empty and (shown + above.reindex(shown.index).fillna(0)).max() > 2 * shown.max():
        ax.set_xlim(0, 1.5 * shown.max())  # an interval many times the points' span runs off the edge
    ax.set_xlabel(time_label, fontsize=8)
    ax.set_ylabel(f"{_metric_label(part)}: mean over seeds, bars 95% t interval")
    ax.set_title(f"{title}: {part['metric'].iloc[0]} vs {quantity}", fontsize=9)
    return _save(fig, directory, f"{name}_metric_vs_time")


def text_colour(rgba) -> str:
    """Black or white, whichever reads on a cell of colour `rgba` (its relative luminance, WCAG's weights)."""
    linear = [c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4 for c in rgba[:3]]
    return "black" if 0.2126 * linear[0] + 0.7152 * linear[1] + 0.0722 * linear[2] > 0.179 else "white"


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
            texts[i, j] = f"{grid[i, j]:.3g}\n" + fmt_difference(c, with_n=False).replace(
                "; without stalled runs: ", "\nwithout stalled runs:\n")
    fig, ax = plt.subplots(figsize=(2.0 * len(columns) + 2, 0.8 * len(rows) + 1.5))
    image = ax.imshow(grid, cmap="viridis", aspect="auto")
    ax.set_xticks(range(len(columns)), columns)
    ax.set_yticks(range(len(rows)), labels)
    for (i, j), text in np.ndenumerate(texts):
        colour = "black" if np.isnan(grid[i, j]) else text_colour(image.cmap(image.norm(grid[i, j])))
        ax.text(j, i, text, ha="center", va="center", color=colour, fontsize=7, wrap=True)
    bar = fig.colorbar(image, ax=ax, label=_metric_label(part))
    bar.formatter = matplotlib.ticker.ScalarFormatter(useOffset=False)  # no offset text over the title
    bar.update_ticks()
    interval = ("Δ vs 32-true [95% interval], " f"{SIGNIFICANT} = excludes 0" if part["value_ci_lo"].notna().any()
                else "Δ vs 32-true; one seed per cell: no interval")
    ax.set_title(f"{title}: {part['metric'].iloc[0]} by format and scaling\n(mean; {interval})", fontsize=9)
    return _save(fig, directory, f"{name}_heatmap")


def loss_curves(runs: pd.DataFrame, title: str, directory: Path, name: str) -> list[Path]:
    """One panel per scaling method, one colour per setting, one thin line per seed."""
    scalings = [str(x) for x in dict.fromkeys(runs["scaling"].astype(str))]
    colours = dict(zip(dict.fromkeys(runs["setting"].astype(str)), plt.cm.tab10.colors))
    fig, axes = plt.subplots(1, len(scalings), figsize=(3.2 * len(scalings) + 1, 3.6), sharey=True, squeeze=False)
    drawn: list[str] = []  # the settings with a curve, in order: the legend's
    for ax, scaling in zip(axes[0], scalings):
        labelled = set()
        for _, r in runs[runs["scaling"].astype(str) == scaling].iterrows():
            setting = str(r["setting"])
            if points := curve_points(r):
                steps, losses = zip(*points)
                ax.plot(steps, losses, lw=0.8, color=colours[setting])
                labelled.add(setting)
        drawn += [setting for setting in colours if setting in labelled and setting not in drawn]
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(PLAIN)
        ax.yaxis.set_minor_formatter(PLAIN_MINOR)
        ax.set_xlabel("step")
        ax.set_title(scaling, fontsize=9)
    axes[0][0].set_ylabel("training loss")
    fig.suptitle(f"{title}: training loss (one line per seed)", fontsize=9)
    if drawn:  # one legend for the panels, outside them
        axes[0][-1].legend([matplotlib.lines.Line2D([], [], color=colours[s], lw=0.8) for s in drawn], drawn,
                           fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return _save(fig, directory, f"{name}_loss_curves")


def curve_points(run) -> list[tuple[int, float]]:
    """A run's logged training losses, to its last step: the loss it ended on (the record's final_train_loss, at
    `steps`) where the log stopped short of it."""
    points = [tuple(p) for p in run["losses"] or []]
    final, steps = run.get("final_train_loss"), run.get("steps")
    if points and pd.notna(final) and steps and points[-1][0] < steps:
        points.append((int(steps), float(final)))
    return points


# plain tick labels on a log axis ("0.3", "2"), never "3×10^-1"; minor ticks labelled only where a decade has no major
PLAIN = matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}")
PLAIN_MINOR = matplotlib.ticker.LogFormatter(labelOnlyBase=False, minor_thresholds=(2, 0.5))


def trajectory_groups(runs: pd.DataFrame) -> list[tuple[tuple, str]]:
    """The loss-scale trajectories to draw, identical ones merged: ((steps, scales), label naming every run that
    followed it, by scaling method, setting and seeds), so that no line hides another."""
    groups: dict[tuple, dict[tuple[str, str], list]] = {}
    for _, r in runs.iterrows():
        history = r["loss_scale_history"]
        if history and r["loss_scaling"] in LOSS_SCALING[1:]:  # a loss scale that is not 1
            steps = tuple([h[0] for h in history] + [r["steps"]])  # hold the last scale to the end of the run
            scales = tuple([h[1] for h in history] + [history[-1][1]])
            groups.setdefault((steps, scales), {}).setdefault((str(r["scaling"]), str(r["setting"])), []).append(
                int(r["seed"]))
    drawn = []
    for trajectory, members in groups.items():
        by_scaling: dict[str, list[str]] = {}
        for (scaling, setting), seeds in members.items():
            by_scaling.setdefault(scaling, []).append(f"{setting} s{','.join(map(str, sorted(seeds)))}")
        label = "; ".join(f"{scaling}: {', '.join(parts)}" for scaling, parts in by_scaling.items())
        drawn.append((trajectory, textwrap.fill(label, 70)))
    return drawn


def loss_scale_trajectories(runs: pd.DataFrame, title: str, directory: Path, name: str) -> list[Path]:
    fig, ax = plt.subplots(figsize=(7, 4))
    styles = ["-", "--", "-.", ":"]
    for k, ((steps, scales), label) in enumerate(trajectory_groups(runs)):
        ax.step(steps, scales, where="post", lw=1.2, ls=styles[k // 10 % len(styles)], label=label)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("step")
    ax.set_ylabel("loss scale")
    ax.set_title(f"{title}: loss-scale trajectories (static and dynamic; identical runs share a line)", fontsize=9)
    return _save(fig, directory, f"{name}_loss_scale")


def metric_vs_bits(part: pd.DataFrame, title: str, directory: Path, name: str,
                   block_rows: list[BlockRow]) -> list[Path]:
    """block_formats: the metric (mean, 95% t interval) against bits per element (the preset's declared rows, log
    scale); filled markers round gradients to nearest, hollow ones stochastically."""
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    # one colour per format and recipe, both roundings
    formats = list(dict.fromkeys((r.setting, r.scaling, r.options) for r in block_rows))
    for block_row in block_rows:
        setting, scaling, options = block_row.setting, block_row.scaling, block_row.options
        rounding, label, bits = block_row.rounding, block_row.label, block_row.bits
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
