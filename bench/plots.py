"""Plots beside the tables (PNG and SVG): metric vs train time, format x scaling heatmap, loss curves and
loss-scale trajectories. Emulated cells are drawn hollow: their time is the emulation's, not the format's."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from bench.aggregate import SCALING_ORDER  # noqa: E402

MARKERS = dict(zip(SCALING_ORDER, "os^Dv"))


def _save(fig, directory: Path, name: str) -> list[Path]:
    for ax in fig.axes:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6, ncol=3)
    paths = [directory / f"{name}.png", directory / f"{name}.svg"]
    for path in paths:
        fig.savefig(path, bbox_inches="tight", dpi=120)
    plt.close(fig)
    return paths


def metric_vs_time(cells: pd.DataFrame, model: str, directory: Path) -> list[Path]:
    part = cells[cells["model"] == model]
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    settings = list(dict.fromkeys(part["setting"].astype(str)))
    colours = dict(zip(settings, plt.cm.tab10.colors))
    for _, c in part.iterrows():
        emulated = c["backend"] == "emulated"
        colour = colours[str(c["setting"])]
        ax.scatter(c["train_s"], c["value"], marker=MARKERS.get(str(c["scaling"]), "o"), s=60,
                   facecolors="none" if emulated else colour, edgecolors=colour, linewidths=1.5)
    for setting in settings:
        ax.scatter([], [], color=colours[setting], label=setting)
    for scaling in dict.fromkeys(part["scaling"].astype(str)):
        ax.scatter([], [], marker=MARKERS.get(scaling, "o"), facecolors="none", edgecolors="grey", label=scaling)
    ax.set_xlabel("train time (s); hollow = emulated")
    ax.set_ylabel(part["metric"].iloc[0])
    ax.set_title(f"{model}: {part['metric'].iloc[0]} vs train time")
    return _save(fig, directory, f"{model}_metric_vs_time")


def heatmap(cells: pd.DataFrame, model: str, directory: Path) -> list[Path]:
    part = cells[cells["model"] == model]
    labels = [f"{s}{' †' if b == 'emulated' else ''}" for s, b in
              dict.fromkeys(zip(part["setting"].astype(str), part["backend"]))]
    rows = list(dict.fromkeys(zip(part["setting"].astype(str), part["backend"])))
    columns = [s for s in SCALING_ORDER if s in set(part["scaling"].astype(str))]
    grid = np.full((len(rows), len(columns)), np.nan)
    for _, c in part.iterrows():
        grid[rows.index((str(c["setting"]), c["backend"])), columns.index(str(c["scaling"]))] = c["value"]
    fig, ax = plt.subplots(figsize=(1.4 * len(columns) + 2, 0.5 * len(rows) + 1.5))
    image = ax.imshow(grid, cmap="viridis", aspect="auto")
    ax.set_xticks(range(len(columns)), columns)
    ax.set_yticks(range(len(rows)), labels)
    for (i, j), v in np.ndenumerate(grid):
        ax.text(j, i, "–" if np.isnan(v) else f"{v:.3g}", ha="center", va="center", color="w", fontsize=8)
    fig.colorbar(image, ax=ax, label=part["metric"].iloc[0])
    ax.set_title(f"{model}: {part['metric'].iloc[0]} by format and scaling")
    return _save(fig, directory, f"{model}_heatmap")


def _losses(run_dir: str | None) -> tuple[list[int], list[float]]:
    steps, losses = [], []
    path = Path(run_dir) / "metrics.jsonl" if run_dir else None
    if path is None or not path.exists():
        return steps, losses
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # a torn last line after a kill
            continue
        if isinstance(row.get("loss"), (int, float)):
            steps.append(row["step"])
            losses.append(row["loss"])
    return steps, losses


def loss_curves(runs: pd.DataFrame, model: str, directory: Path) -> list[Path]:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for _, r in runs[runs["model"] == model].iterrows():
        steps, losses = _losses(r["dir"])
        if steps:
            ax.plot(steps, losses, lw=1, label=f"{r['setting']}/{r['scaling']}/s{r['seed']}")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title(f"{model}: training loss per cell")
    return _save(fig, directory, f"{model}_loss_curves")


def loss_scale_trajectories(runs: pd.DataFrame, model: str, directory: Path) -> list[Path]:
    fig, ax = plt.subplots(figsize=(7, 4))
    for _, r in runs[runs["model"] == model].iterrows():
        history = r["loss_scale_history"]
        if history and str(r["scaling"]) in ("static", "dynamic"):
            steps = [h[0] for h in history] + [r["steps"]]  # hold the last scale to the end of the run
            scales = [h[1] for h in history] + [history[-1][1]]
            ax.step(steps, scales, where="post", lw=1, label=f"{r['setting']}/{r['scaling']}/s{r['seed']}")
    ax.set_yscale("log", base=2)
    ax.set_xlabel("step")
    ax.set_ylabel("loss scale")
    ax.set_title(f"{model}: loss-scale trajectories (static and dynamic)")
    return _save(fig, directory, f"{model}_loss_scale")


def write_all(runs: pd.DataFrame, cells: pd.DataFrame, directory: Path) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for model in dict.fromkeys(runs["model"]):
        paths += metric_vs_time(cells, model, directory)
        paths += heatmap(cells, model, directory)
        paths += loss_curves(runs, model, directory)
        paths += loss_scale_trajectories(runs, model, directory)
    return paths
