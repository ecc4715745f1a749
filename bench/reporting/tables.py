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

import functools
import math
import re
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pandas as pd
import yaml
from omegaconf import OmegaConf

from bench.numerics.scaling_methods import NO_SCALING, SCALING_METHODS, scaling_order
from bench.numerics.specs import FORMAT_SPECS
from bench.numerics.telemetry import TENSOR_CLASSES
from bench.reporting.aggregate import EVALUATED_WITHOUT_AUTOCAST, RECIPE_OPTIONS, format_options
from bench.reporting.statistics import (
    CLIPPED,
    SIGNIFICANT,
    Interval,
    Paired,
    Unit,
    flag,
    format_paired,
    paired,
    unit,
)
from bench.running.config import CONF_DIR

PUBLISHED = Path(__file__).parent / "reference" / "published.yaml"
EMULATED = "†"
FP32 = "32-true"  # the setting every difference is taken against
DISTURBED = "‡"
STALLED = "¶"
EVALUATED_OUTSIDE = "°"
NOTES = {
    "predicted": "predicted step, speed-up and time to target: predicted, not measured: the speed model's step "
                 "time on that GPU (bench/speed/model.py), from this cell's own traced step, on the path the runner would take there (no native path: it would "
                 "emulate the format); compiled, as published FP8 figures are; speed-up against the 32-true cell's "
                 "prediction. How far off it has been: results/bench/speed_model_validation.md.",
    "time_to_target": "steps to target: the first evaluation at which a seed's quality curve (its validation metric) "
                      "reached the target: the final value of the 32-true run of the same seed and configuration (of the "
                      "unscaled one where no 32-true run has the cell's scaling method; the target column: their "
                      "mean over seeds), or the preset's own (hydra.sweeper.quality_target); mean over the seeds that "
                      "reached it [95% t interval, clipped at 0] (how many reached it of how many had a curve and a "
                      "target); a run is counted at the evaluation that first reached it, so the evaluation interval "
                      "bounds the resolution; predicted time to target: those steps at the predicted compiled step "
                      "(bench/reporting/quality.py).",
    "emulated": f"{EMULATED} emulated in FP32: time, speed-up and measured peak measure the emulation on this device, "
                "not the format (modelled memory counts the format's storage either way).",
    "disturbed": f"{DISTURBED} timing disturbed: other processes kept more cores busy than this run's threads left "
                 "free (timing.conditions in the record).",
    "stalled": f"{STALLED} stalled: a run that trained without a NaN but did not learn as its siblings (the cell's "
               "other seeds) did: its final training loss is above where they were a tenth of the way in, while they "
               "went on learning (bench/running/learning.py; numerics.stalled in its record). The cell's statistics "
               "are shown with it and, after `without:`, without it (and its paired differences without its pairs).",
    "clipped": f"{CLIPPED} the 95% t interval reached past the values the metric can take (an accuracy above 100%, a "
               "difference beyond ±100 points) and is clipped to them: with these few seeds and this spread it says "
               "little beyond that the seeds disagree.",
    "evaluated": f"{EVALUATED_OUTSIDE} evaluated without the autocast the cell trained under (native 16-bit mixed: in "
                 "FP32; FP8 or a block format with BF16 elsewhere: FP32 outside its GEMMs): a record made before "
                 "evaluation ran in the trained precision (metrics.evaluated_in).",
    "time": "train time: median over the seeds that finished [min–max] (n); speed-up: the 32-true median over this one.",
    "compiled": "compiled: the cell trained with train.compile (torch.compile); its time and speed-up leave out the "
                "steps during which it compiled, whose median seconds are shown beside it (timing.compile).",
    "std": "mean ± sample standard deviation over seeds (n runs with a value).",
    "difference": "Δ vs 32-true: mean of the per-seed differences to the 32-true cell of the same scaling, seed and "
                  "configuration (seeds are paired: same initial weights and data order) [95% confidence interval, "
                  f"Student's t over the n paired seeds]; {SIGNIFICANT} marks an interval that excludes 0, a "
                  "difference the seeds tell apart from noise; without the mark it is not distinguishable from 0.",
    "charlm": "Δ vs FP32 regular: mean over seeds of this run's BPC minus the FP32-regular run's of the same seed "
              f"and norm [95% t interval] (n paired seeds); {SIGNIFICANT} marks an interval that excludes 0. The paper's "
              "figures: medians of 3 seeds at each setting's best learning rate from a sweep; its 95% interval is "
              "about ±0.010.",
    "block_formats": "Δ vs FP32: mean over seeds of this run's metric minus the FP32 run's of the same seed and "
                     f"design [95% t interval] (n paired seeds); {SIGNIFICANT} marks an interval that excludes 0. "
                     "Bits per element count the element and its share of the scales (8.25 = 8 + 8/32 for MXFP8, 4.5 "
                     "= 4 + 8/16 for NVFP4; rowwise and 1x128 FP8 one FP32 scale per 128 elements); gradients rel. "
                     "MSE and clipped blocks: the block statistics of the record's telemetry (blocks whose largest "
                     "element saturated under the block's scale).",
    "native_fp8": "native fp8-mixed run eagerly (train.compile off): torchao's float8 training in eager mode: "
                  "its time includes torchao's per-op Python dispatch, which on an H100 made BERT-base's step 2.8x "
                  "slower than FP32 (docs/performance.md, 'On an H100'); it is not what FP8 hardware gains.",
    "memory": "modelled memory: the bytes one training step holds (parameters, gradients, optimiser state, low-"
              "precision weight copies, activations saved for backward) as the format stores them, counted on the "
              "run's first step (bench/numerics/memory.py), the same for native and emulated runs; measured peak: the "
              "process's peak resident set on CPU (mostly the Python/torch runtime), max_memory_allocated on CUDA; "
              "TFLOP/s: FLOPs of a step over its median time, native runs only.",
}
def cell_unit(cell) -> Unit:
    """The unit of a cell's (or run's) metric, as its model declares it (`model.task.unit`)."""
    return unit(cell.get("unit"))


def fmt_time(cell) -> str:
    """Median train time [min–max] (n); for a compiled cell, `compiled` and the median seconds its compiling steps
    took, which the time (and so the speed-up) leaves out."""
    n = cell["train_s_n"]
    if n == 0 or pd.isna(cell["train_s"]):
        return "–"
    spread = "" if n == 1 else f" [{cell['train_s_min']:.1f}–{cell['train_s_max']:.1f}]"
    compiled = f", compiled (+{cell['compile_s']:.1f} s compiling)" if cell.get("compiled") else ""
    return f"{cell['train_s']:.1f}{spread} (n={n}){compiled}{DISTURBED if cell['disturbed'] else ''}"


def fmt_stat(mean, std, n, digits: int = 2) -> str:
    if n == 0 or pd.isna(mean):
        return "–"
    if n == 1 or pd.isna(std):
        return f"{mean:.{digits}f} (n=1)"
    return f"{mean:.{digits}f} ± {std:.{digits}f} (n={n})"


def cell_difference(cell, suffix: str = "") -> Paired:
    """The cell's paired difference to 32-true as bench.reporting.aggregate.paired_differences left it in its columns
    (`suffix` "_without_stalled": without the stalled runs' pairs)."""
    n = cell[f"value_vs_fp32_n{suffix}"]
    return Paired(cell[f"value_vs_fp32{suffix}"], 0 if pd.isna(n) else int(n),
                  Interval(cell[f"value_vs_fp32_lo{suffix}"], cell[f"value_vs_fp32_hi{suffix}"],
                           flag(cell[f"value_vs_fp32_clipped{suffix}"])))


def fmt_difference(cell, with_n: bool = True) -> str:
    """The paired difference to 32-true (bench.reporting.statistics.format_paired), and where stalled runs took part
    in it, the same without their pairs."""
    if str(cell["setting"]) == "32-true":
        return "baseline"
    text = format_paired(cell_difference(cell), cell_unit(cell), with_n)
    without = cell_difference(cell, "_without_stalled")
    if without.n < cell_difference(cell).n:
        text += f"; without stalled runs: {format_paired(without, cell_unit(cell), with_n)}"
    return text


def fmt_mib(value) -> str:
    return "–" if pd.isna(value) else f"{value / 2**20:.3g}"


def status_note(cell) -> str:
    """Empty when every run was ok; otherwise the counts of the others."""
    parts = [f"{int(cell[s])} {s}" for s in ("diverged", "failed") if cell[s]]
    return ", ".join(parts)


def _metric_text(cell) -> str:
    """mean ± std (n) in the metric's shown units; the runs that did not finish, and the stalled ones with the cell's
    statistics without them; ° where the metric was evaluated without the autocast the cell trained under."""
    metric_unit = cell_unit(cell)
    text = fmt_stat(metric_unit.shown(cell["value"]), metric_unit.shown(cell["value_std"]), cell["value_n"],
                    metric_unit.digits)
    if cell["value_n"] and EVALUATED_WITHOUT_AUTOCAST in str(cell.get("evaluated_in") or ""):
        text += EVALUATED_OUTSIDE
    notes = [status_note(cell)] if status_note(cell) else []
    if cell.get("stalled"):
        without = fmt_stat(metric_unit.shown(cell["value_without_stalled"]),
                           metric_unit.shown(cell["value_without_stalled_std"]), cell["value_without_stalled_n"],
                           metric_unit.digits)
        notes.append(f"{int(cell['stalled'])} stalled{STALLED}; without: {without}")
    return f"{text} [{'; '.join(notes)}]" if notes else text


def _setting_label(cell) -> str:
    elsewhere = " (bf16 elsewhere)" if "elsewhere=bf16" in str(cell.get("format_options") or "") else ""
    return f"{cell['setting']}{elsewhere}{' ' + EMULATED if cell['backend'] == 'emulated' else ''}"


def _identity(cell, cells: pd.DataFrame) -> dict:
    """The columns that say which cell a row is: the model as configured and, where cells of the table differ
    in more than format and scaling, what this one does differently."""
    columns = {"model": cell["model_label"]}
    if cells["variant"].astype(bool).any():
        columns["settings"] = cell["variant"] or "usual"
    return columns


def predicted_gpus(cells: pd.DataFrame) -> list[str]:
    """The GPUs the cells carry the speed model's predictions for (bench.reporting.aggregate.summarise's columns)."""
    return [c[len("predicted_"):-len("_compiled_s")] for c in cells.columns
            if c.startswith("predicted_") and c.endswith("_compiled_s")]


def fmt_seconds(seconds) -> str:
    """A time in the unit that reads best: µs, ms, s, min or h."""
    if seconds is None or pd.isna(seconds):
        return "–"
    for limit, scale, unit_name in ((1e-3, 1e6, "µs"), (1.0, 1e3, "ms"), (120.0, 1.0, "s"), (7200.0, 1 / 60, "min")):
        if seconds < limit:
            return f"{seconds * scale:.3g} {unit_name}"
    return f"{seconds / 3600:.3g} h"


def _unpredicted(cell, name: str) -> str:
    """What stands where a cell has no prediction on GPU `name`: no native path (the runner would emulate it there),
    or nothing (its step could not be traced here)."""
    why = cell[f"predicted_{name}_why"]
    return "no native path" if isinstance(why, str) and not why.startswith("its step could not") else "–"


def _predicted(cell, name: str) -> dict:
    """The precision table's predicted columns for GPU `name`: its compiled step, the speed-up over 32-true there, and
    for a cell measured natively on that GPU, the prediction's error."""
    step = cell[f"predicted_{name}_compiled_s"]
    if pd.isna(step):
        return {f"predicted step ({name}, compiled)": _unpredicted(cell, name), f"predicted speed-up ({name})": "–"}
    columns = {f"predicted step ({name}, compiled)": fmt_seconds(step),
               f"predicted speed-up ({name})": "–" if pd.isna(cell[f"predicted_{name}_speedup"])
               else f"{cell[f'predicted_{name}_speedup']:.2f}×"}
    if not pd.isna(cell.get(f"predicted_{name}_error", np.nan)):
        columns[f"prediction error ({name})"] = f"{cell[f'predicted_{name}_error']:+.0%}"
    return columns


def precision_table(cells: pd.DataFrame) -> pd.DataFrame:
    rows = []
    for _, c in cells.iterrows():
        emulated = EMULATED if c["backend"] == "emulated" else ""
        rows.append({
            **_identity(c, cells), "setting": _setting_label(c), "scaling": c["scaling"],
            "train time (s)": fmt_time(c) + emulated,
            "speed-up vs 32-true": "–" if pd.isna(c["speedup_vs_fp32"]) else f"{c['speedup_vs_fp32']:.2f}×{emulated}",
            **{k: v for name in predicted_gpus(cells) for k, v in _predicted(c, name).items()},
            "modelled memory (MiB)": fmt_mib(c["step_bytes"]),
            "memory vs 32-true": "–" if pd.isna(c["step_memory_ratio_vs_fp32"])
            else f"{c['step_memory_ratio_vs_fp32']:.2f}",
            "measured peak (MiB)": "–" if pd.isna(c["peak_bytes"]) else f"{c['peak_bytes'] / 2**20:.0f}{emulated}",
            "TFLOP/s": "–" if pd.isna(c["tflop_per_s"]) else f"{c['tflop_per_s']:.3g}",
            (c["metric"] or "metric"): _metric_text(c),
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
        if not judged:
            steps = ("no target (no 32-true run with a quality curve)" if pd.isna(c["target"]) else
                     "no quality curve" if c["ok"] else "–")
        elif not reached:
            steps = f"not reached (0 of {judged})"
        else:
            spread = "" if pd.isna(c["steps_to_target_lo"]) else \
                f" [{c['steps_to_target_lo']:.0f}, {c['steps_to_target_hi']:.0f}]"
            steps = f"{c['steps_to_target']:.0f}{spread} ({reached} of {judged})"
        row = {**_identity(c, cells), "setting": _setting_label(c), "scaling": c["scaling"],
               "target": "–" if pd.isna(c["target"]) else f"{metric_unit.shown(c['target']):.{metric_unit.digits}f}",
               "steps to target": steps}
        for name in predicted_gpus(cells):
            seconds = c[f"predicted_{name}_to_target_s"]
            row[f"predicted time to target ({name})"] = (
                _unpredicted(c, name) if pd.isna(c[f"predicted_{name}_compiled_s"]) else
                fmt_seconds(seconds) + ("" if reached == judged else f" ({reached} of {judged} seeds)")
                if reached else "–")
        rows.append(row)
    return pd.DataFrame(rows)


def scaling_grid(cells: pd.DataFrame) -> pd.DataFrame:
    present = scaling_order(cells["scaling"].astype(str))
    rows = []
    for _, part in cells.groupby(["model_label", "variant", "setting", "backend"], observed=True, sort=True):
        row = {**_identity(part.iloc[0], cells), "setting": _setting_label(part.iloc[0]), "metric": part.iloc[0]["metric"]}
        by_scaling = {str(c["scaling"]): c for _, c in part.iterrows()}
        for scaling in present:
            row[scaling] = _metric_text(by_scaling[scaling]) if scaling in by_scaling else ""
        rows.append(row)
    return pd.DataFrame(rows)


def squad_table(cells: pd.DataFrame) -> pd.DataFrame:
    qa = cells[cells["metric"] == "f1"]
    present = scaling_order(qa["scaling"].astype(str))
    rows = []
    for _, part in qa.groupby(["model_label", "variant", "setting", "backend"], observed=True, sort=True):
        row = {**_identity(part.iloc[0], qa), "setting": _setting_label(part.iloc[0])}
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
        row = {**_identity(c, cells), "setting": _setting_label(c), "scaling": c["scaling"],
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


def published_rows() -> list[dict]:
    data = yaml.safe_load(PUBLISHED.read_text())
    return [r | {"citation": data["sources"][r["source"]]} for r in data["results"]]


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
        first, last = best.iloc[0], best.iloc[-1]
        return [base | {"our scaling": pub["scaling"], "ours": f"{shift:+.0f} (lr {first['best']['lr']:.3g} at "
                        f"{first['model_label']} → {last['best']['lr']:.3g} at {last['model_label']})",
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


def is_cell(frame: pd.DataFrame, setting: str, scaling: str, rounding: str | None = None,
            options: str | None = None) -> pd.Series:
    """Which rows of `frame` (runs or cells) have this setting and scaling (and rounding of the gradients, and
    recipe options: bench.reporting.aggregate.format_options, "" for the format's own recipe)."""
    match = (frame["setting"].astype(str) == setting) & (frame["scaling"].astype(str) == scaling)
    if rounding is not None:
        match &= frame["rounding"] == rounding
    return match if options is None else match & (frame["format_options"] == options)


def layout(name: str) -> list[tuple[str, str, str]]:
    """A paper's table layout (published.yaml `layouts`): its columns in its order, (setting, scaling, heading)."""
    return [(c["setting"], c["scaling"], c["heading"]) for c in yaml.safe_load(PUBLISHED.read_text())["layouts"][name]]


BPC_PER_NAT = 1 / math.log(2)
BITS = Unit("bits per character", BPC_PER_NAT, 3, (0.0, math.inf))  # a loss in nats, shown in bits


def _norm_of(model_label: str) -> str:
    """aggregate.model_label writes a charlm's norm as '<norm>-norm'."""
    return model_label.split("-norm")[0].rsplit(" ", 1)[-1]


def unit_scaling_charlm_table(runs: pd.DataFrame, cells: pd.DataFrame) -> pd.DataFrame:
    """Per norm, and per design within it (the same model, data and training apart from format and scaling, e.g.
    one learning rate of a sweep): our validation BPC (mean ± std over seeds) and its paired difference to FP32
    regular of that design (the mean over seeds of this run's BPC minus the FP32-regular run's of the same seed,
    with its 95% t interval); then once per norm the paper's WikiText-103 test BPC and its difference to its FP32
    regular: the data differ, the pattern compares."""
    lm = cells[cells["metric"] == "val_loss"]
    ok = runs[(runs["metric"] == "val_loss") & (runs["status"] == "ok") & runs["value"].notna()]
    paper = [r for r in published_rows() if r["task"] == "wikitext103_char"]
    columns = [c for c in layout("unit_scaling_charlm") if is_cell(lm, c[0], c[1]).any()]

    rows = []
    for norm, in_norm in lm.groupby(lm["model_label"].map(_norm_of), sort=True):
        for (label, design), part in in_norm.groupby(["model_label", "design_id"], sort=False):
            here = ok[ok["design_id"] == design]
            reference = here[is_cell(here, FP32, NO_SCALING)].drop_duplicates("seed").set_index("seed")["value"]
            labelled = part[is_cell(part, FP32, NO_SCALING)]
            variant = (labelled if not labelled.empty else part)["variant"].iloc[0]
            ours = {"norm": norm, "rows": f"ours: val BPC ({label}{f'; {variant}' if variant else ''})"}
            ours_delta = {"norm": norm, "rows": "ours: Δ vs FP32 regular"}
            for setting, scaling, heading in columns:
                match = part[is_cell(part, setting, scaling)]
                if match.empty:
                    ours[heading] = ours_delta[heading] = ""
                    continue
                c = match.iloc[0]
                note = status_note(c)
                text = fmt_stat(c["value"] * BPC_PER_NAT, c["value_std"] * BPC_PER_NAT, c["value_n"], 3)
                ours[heading] = text + (f" {EMULATED}" if c["backend"] == "emulated" else "") + (f" [{note}]" if note else "")
                runs_here = here[is_cell(here, setting, scaling)]
                differences = [v - reference[s] for v, s in zip(runs_here["value"], runs_here["seed"])
                               if s in reference.index]
                ours_delta[heading] = _paired_text(differences, BITS, baseline=(setting, scaling) == (FP32, NO_SCALING))
            rows += [ours, ours_delta]
        published = {(r["setting"], r["scaling"]): r["value"] for r in paper if r["norm"] == norm}
        base = published.get((FP32, NO_SCALING))
        theirs = {"norm": norm, "rows": "paper: test BPC (WikiText-103, 8 layers)"}
        theirs_delta = {"norm": norm, "rows": "paper: Δ vs FP32 regular"}
        for setting, scaling, heading in columns:
            value = published.get((setting, scaling))
            theirs[heading] = "–" if value is None else f"{value:.3f}"
            theirs_delta[heading] = "–" if value is None or base is None else (
                "baseline" if (setting, scaling) == (FP32, NO_SCALING) else f"{value - base:+.3f}")
        rows += [theirs, theirs_delta]
    return pd.DataFrame(rows)


class BlockRow(NamedTuple):
    """A row of the block_formats table: the cell (setting, scaling, rounding of the gradient operands, recipe
    options as bench.reporting.aggregate.format_options writes them) and how it is shown (label, bits per element)."""

    setting: str
    scaling: str
    rounding: str
    label: str
    bits: float
    options: str = ""

    def selects(self, frame: pd.DataFrame) -> pd.Series:
        """Which rows of `frame` (runs or cells) are this row's cell."""
        return is_cell(frame, self.setting, self.scaling, self.rounding, self.options)


def declared_table_of(cells: pd.DataFrame) -> tuple[str, list[BlockRow]] | None:
    """The table the experiment of `cells` declares (one experiment's cells, as bench.aggregate writes them)."""
    return declared_table(str(cells["experiment"].iloc[0])) if cells["experiment"].nunique() == 1 else None


@functools.lru_cache(maxsize=None)
def declared_table(experiment: str) -> tuple[str, list[BlockRow]] | None:
    """The table a preset declares for its records (`hydra.sweeper.table` in conf/experiment/<experiment>.yaml),
    found by their experiment_name, with its rows: the preset's settings that carry a `label` (and `bits`), each
    turned into the cell it selects. None where the experiment declares no table of its own."""
    path = CONF_DIR / "experiment" / f"{experiment}.yaml"
    sweeper = (OmegaConf.load(path).get("hydra") or {}).get("sweeper") or {} if path.is_file() else {}
    if not sweeper.get("table"):
        return None
    rows = [_row(setting) for setting in sweeper.get("settings") or [] if hasattr(setting, "keys") and "label" in setting]
    return sweeper["table"], rows


def _row(setting) -> BlockRow:
    """The cell a labelled setting selects: its format option's setting name (conf/format/<option>.yaml says the
    format and its mode), scaling method, rounding of the gradients and recipe options."""
    overrides = dict(item.split("=", 1) for item in str(setting["overrides"]).split())
    option = OmegaConf.load(CONF_DIR / "format" / f"{overrides['format']}.yaml")
    spec = FORMAT_SPECS[option.name]
    defaults = OmegaConf.to_container(option)
    fmt = {key: yaml.safe_load(overrides[f"format.{key}"]) if f"format.{key}" in overrides else defaults.get(key)
           for key in RECIPE_OPTIONS}  # an override's value as Hydra reads it: [last:3] a list, null None
    return BlockRow(spec.setting(overrides.get("format.mode", str(option.mode).lower())),
                    overrides.get("scaling", NO_SCALING), overrides.get("format.rounding", defaults.get("rounding", "nearest")),
                    setting["label"],
                    float(setting.get("bits") or "nan"), format_options(fmt))


def _differences_to_fp32(here: pd.DataFrame, mine: pd.DataFrame, scaling: str, metric: str) -> list[float]:
    """Seed by seed, `mine`'s metric minus the 32-true run's of the same design (`here`: that design's finished runs)
    and scaling method, or scaling `none` where FP32 has no run of that method (per-tensor, rowwise or block scaling
    do nothing in FP32)."""
    fp32 = here[here["setting"].astype(str) == "32-true"]
    same = fp32[fp32["scaling"].astype(str) == scaling]
    reference = (same if not same.empty else fp32[fp32["scaling"].astype(str) == NO_SCALING])
    reference = reference.drop_duplicates("seed").set_index("seed")["value"]
    return [v - reference[s] for v, s in zip(mine["value"], mine["seed"]) if s in reference.index]


def block_formats_table(runs: pd.DataFrame, cells: pd.DataFrame, block_rows: list[BlockRow]) -> pd.DataFrame:
    """Per model, one row per declared row present (the preset's order, by bits per element): the primary
    metric (mean ± std over seeds), its paired difference to FP32 of the same design, scaling and seed
    (_differences_to_fp32; 95% t interval),
    and what the block scales did to the gradients (relative MSE, blocks clipped)."""
    ok = runs[(runs["status"] == "ok") & runs["value"].notna()]
    rows = []
    for (label, design), part in cells.groupby(["model_label", "design_id"], sort=False):
        here = ok[ok["design_id"] == design]
        for block_row in block_rows:
            match = part[block_row.selects(part)]
            if match.empty:
                continue
            c = match.iloc[0]
            metric = c["metric"]
            differences = _differences_to_fp32(here, here[block_row.selects(here)], block_row.scaling, metric)
            rows.append({"model": label,
                         "format": block_row.label + (f" {EMULATED}" if c["backend"] == "emulated" else ""),
                         "bits / element": f"{block_row.bits:g}", "metric": metric, "mean ± std": _metric_text(c),
                         "Δ vs FP32": _paired_text(differences, cell_unit(c), block_row.setting == "32-true"),
                         "gradients rel. MSE": "–" if pd.isna(c["gradients_rel_mse"]) else f"{c['gradients_rel_mse']:.2e}",
                         "blocks clipped (act. / grad.)": " / ".join(
                             "–" if pd.isna(c[f"{tc}_clipped_blocks"]) else f"{100 * c[f'{tc}_clipped_blocks']:.2g}%"
                             for tc in ("activations", "gradients"))})
    return pd.DataFrame(rows)


def parametrisation(scaling: str) -> str:
    """What the tables call the model a scaling method trains (its `parametrisation`; a method not declared in this
    process by its name)."""
    return SCALING_METHODS[scaling].parametrisation if scaling in SCALING_METHODS else scaling


def _natural(text: str) -> list:
    """Sort key that orders the numbers in a label by value ("4L×64" before "4L×128")."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", text)]


def best_learning_rates(cells: pd.DataFrame) -> pd.DataFrame:
    """Per scaling method and model as configured (one width of a sweep), in width order: the learning rates swept,
    the best one (mean metric over the seeds that finished) and the metric there and at its neighbours in the sweep."""
    rows = []
    for (scaling, label), part in cells.groupby(["scaling", "model_label"], observed=True, sort=False):
        part = part.sort_values("lr")
        finished = part[part["value"].notna()]
        if finished.empty:
            continue
        best = finished["value"].idxmax() if part["higher_is_better"].iloc[0] else finished["value"].idxmin()
        position = list(part.index).index(best)
        neighbours = [part.iloc[i] if 0 <= i < len(part) else None for i in (position - 1, position + 1)]
        rows.append({"scaling": scaling, "model_label": label, "lrs": list(part["lr"]), "best": part.loc[best],
                     "below": neighbours[0], "above": neighbours[1]})
    order = scaling_order(str(r["scaling"]) for r in rows)
    rows.sort(key=lambda r: (order.index(str(r["scaling"])), _natural(r["model_label"])))
    return pd.DataFrame(rows)


def lr_shift(best: pd.DataFrame, scaling: str) -> float | None:
    """How far the best learning rate moved from the narrowest model of the sweep to the widest, in factors of 2."""
    rows = best[best["scaling"].astype(str) == scaling] if not best.empty else best
    if len(rows) < 2:
        return None
    return math.log2(rows["best"].iloc[-1]["lr"] / rows["best"].iloc[0]["lr"])


def lr_transfer_table(cells: pd.DataFrame) -> pd.DataFrame:
    """A learning-rate sweep per width and parametrisation (the u-μP paper's transfer plot as a table): per row the
    best learning rate, the metric there and at the learning rates either side (lr/2 and 2 lr in a sweep by factors
    of 2), and where the best sits relative to the narrowest model's, in factors of 2."""
    best = best_learning_rates(cells)
    rows = []
    for _, r in best.iterrows():
        narrowest = best[best["scaling"] == r["scaling"]].iloc[0]["best"]["lr"]
        metric = r["best"]["metric"]
        rows.append({
            "parametrisation": parametrisation(str(r["scaling"])), "model": r["model_label"],
            "learning rates swept": f"{min(r['lrs']):.3g} … {max(r['lrs']):.3g} ({len(r['lrs'])})",
            "best lr": f"{r['best']['lr']:.3g}", f"{metric} at best": _metric_text(r["best"]),
            "at the lr below": "–" if r["below"] is None else f"{_metric_text(r['below'])} (lr {r['below']['lr']:.3g})",
            "at the lr above": "–" if r["above"] is None else f"{_metric_text(r['above'])} (lr {r['above']['lr']:.3g})",
            "best vs narrowest (factors of 2)": f"{math.log2(r['best']['lr'] / narrowest):+.0f}",
        })
    return pd.DataFrame(rows)


def labelled_rows_table(runs: pd.DataFrame, cells: pd.DataFrame, labelled: list[BlockRow]) -> pd.DataFrame:
    """The cells a preset labels, in its order: the metric (mean ± std over seeds) and its paired difference, seed by
    seed with a 95% t interval, to the 32-true cell of the same design (everything but format and scaling: the same
    learning rate) and scaling method (_differences_to_fp32: SP's FP32 for per-tensor scaling)."""
    ok = runs[(runs["status"] == "ok") & runs["value"].notna()]
    rows = []
    for (label, design), part in cells.groupby(["model_label", "design_id"], sort=False):
        here = ok[ok["design_id"] == design]
        for row in labelled:
            for _, c in part[row.selects(part)].iterrows():
                differences = _differences_to_fp32(here, here[row.selects(here)], row.scaling, c["metric"])
                rows.append({"model": label, "cell": row.label, "setting": _setting_label(c), "lr": f"{c['lr']:.3g}",
                             "mean ± std": _metric_text(c),
                             "Δ vs its 32-true": _paired_text(differences, cell_unit(c),
                                                              str(c["setting"]) == "32-true")})
    return pd.DataFrame(rows)


def ablation_table(runs: pd.DataFrame, cells: pd.DataFrame, labelled: list[BlockRow]) -> pd.DataFrame:
    """An ablation: the cells a preset labels, in its order, each beside the first (its baseline: BF16 in the NVFP4
    recipe's): the metric (mean ± std over seeds), the runs that finished, and the paired difference to the
    baseline, seed by seed, with a 95% t interval."""
    ok = runs[(runs["status"] == "ok") & runs["value"].notna()]
    rows = []
    for (label, design), part in cells.groupby(["model_label", "design_id"], sort=False):
        here = ok[ok["design_id"] == design]
        baseline = here[labelled[0].selects(here)].drop_duplicates("seed").set_index("seed")["value"]
        for row in labelled:
            for _, c in part[row.selects(part)].iterrows():
                mine = here[row.selects(here)]
                differences = [v - baseline[s] for v, s in zip(mine["value"], mine["seed"]) if s in baseline.index]
                rows.append({"model": label, "cell": row.label, "setting": _setting_label(c),
                             "options": c["format_options"] or "–", "gradients rounded": row.rounding,
                             "runs ok": f"{int(c['ok'])}/{int(c['runs'])}",
                             "mean ± std": _metric_text(c),
                             f"Δ vs {labelled[0].label}": _paired_text(differences, cell_unit(c), row == labelled[0])})
    return pd.DataFrame(rows)


def _paired_text(differences: list[float], metric_unit: Unit, baseline: bool) -> str:
    """A table's paired difference (bench.reporting.statistics), or `baseline` for the reference cell itself."""
    return "baseline" if baseline else format_paired(paired(differences, metric_unit), metric_unit)


# The tables a preset may declare (`hydra.sweeper.table` in its yaml, checked before a sweep starts): name ->
# (runs, cells, the preset's labelled rows) -> the table, or None where its cells are not there.
DECLARED_TABLES = {
    "unit_scaling_charlm": lambda runs, cells, rows: unit_scaling_charlm_table(runs, cells)
    if (cells["metric"] == "val_loss").any() else None,
    "block_formats": block_formats_table,
    "lr_transfer": lambda runs, cells, rows: lr_transfer_table(cells),
    "labelled_rows": labelled_rows_table,
    "ablation": ablation_table,
}


_LATEX_ESCAPES = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_",
                  CLIPPED: r"\S{}", STALLED: r"\P{}", EVALUATED_OUTSIDE: r"$^\circ$", "µ": r"$\mu$",
                  "{": r"\{", "}": r"\}", "~": r"\textasciitilde{}", "^": r"\^{}", "±": r"$\pm$",
                  "×": r"$\times$", EMULATED: r"$^\dagger$", "–": "--"}


def _latex_cell(value) -> str:
    return "".join(_LATEX_ESCAPES.get(ch, ch) for ch in str(value))


def to_latex(table: pd.DataFrame, caption: str) -> str:
    """A booktabs table (pandas' Styler: \\toprule, \\midrule, \\bottomrule), every cell escaped, the caption below
    the tabular as the committed tables have it (Styler would put it above)."""
    styled = table.style.hide(axis="index").format(_latex_cell).format_index(_latex_cell, axis=1)
    styled = styled.set_table_styles([{"selector": "small", "props": ":;"}], overwrite=False)
    text = styled.to_latex(hrules=True, position="ht", position_float="centering",
                           column_format="l" * len(table.columns), environment="table")
    return text.replace("\\end{table}", "\\caption{" + _latex_cell(caption) + "}\n\\end{table}")


def to_markdown(table: pd.DataFrame, notes: list[str]) -> str:
    text = table.to_markdown(index=False, disable_numparse=True) if not table.empty else "(no matching cells)"
    return text + "".join(f"\n\n{n}" for n in notes)


CAPTIONS = {
    "precision": "Time, memory and the primary metric per precision setting",
    "scaling_grid": "Primary metric per format setting (rows) and scaling method (columns)",
    "squad": "SQuAD v1.1 exact match / F1 per model and setting (rows) and scaling method (columns)",
    "numerics": "Numerics health per cell: skipped steps, final loss scale, underflow / overflow fractions",
    "vs_published": "Ours beside the published figures for the same model, task and setting",
    "block_formats": "The primary metric per model by bits per element (scales included): FP8 tensorwise, rowwise "
                     "and block scaling, MX and NVFP4, with and without stochastic rounding of the gradients",
    "lr_transfer": "The best learning rate per width and parametrisation, with the metric at it and at the learning "
                   "rates either side (the u-μP paper's learning-rate transfer, as a table)",
    "labelled_rows": "The cells the preset names, and each one's paired difference to the 32-true cell of its own "
                     "learning rate and scaling method (SP's FP32 for per-tensor scaling)",
    "ablation": "An ablation: each cell the preset names beside its first (the baseline), the paired difference seed "
                "by seed with a 95% t interval",
    "time_to_target": "Steps to the quality target per cell, and the time they take on a GPU by the speed model's "
                      "prediction",
    "unit_scaling_charlm": "Validation bits per character in the Unit Scaling paper's char-LM layout, beside the "
                           "paper's WikiText-103 figures (a different dataset and model size: compare the pattern of "
                           "differences to FP32 regular, not the values)",
}


def write_all(runs: pd.DataFrame, cells: pd.DataFrame, directory: Path) -> dict[str, str]:
    """Write every table (md, tex, csv) plus runs.csv and cells.csv; return the Markdown per table."""
    directory.mkdir(parents=True, exist_ok=True)
    runs.drop(columns=["loss_scale_history", "losses", "settings", "learning"]).to_csv(directory / "runs.csv", index=False)
    cells.drop(columns="settings").to_csv(directory / "cells.csv", index=False)
    built = {"precision": precision_table(cells), "scaling_grid": scaling_grid(cells),
             "numerics": numerics_table(cells), "vs_published": published_table(cells),
             "time_to_target": time_to_target_table(cells)}
    if (cells["metric"] == "f1").any():
        built["squad"] = squad_table(cells)
    declared = declared_table_of(cells)
    if declared and declared[0] in DECLARED_TABLES \
            and (table := DECLARED_TABLES[declared[0]](runs, cells, declared[1])) is not None:
        built[declared[0]] = table
    notes = [NOTES["std"]] + ([NOTES["emulated"]] if (cells["backend"] == "emulated").any() else []) \
        + ([NOTES["stalled"]] if cells["stalled"].any() else []) \
        + ([NOTES["clipped"]] if cells[["value_ci_clipped", "value_vs_fp32_clipped"]].map(flag).any(axis=None) else []) \
        + ([NOTES["evaluated"]] if cells["evaluated_in"].str.contains(EVALUATED_WITHOUT_AUTOCAST, regex=False).any()
           else [])
    timing_notes = [NOTES["time"], NOTES["memory"], NOTES["difference"]] \
        + ([NOTES["disturbed"]] if cells["disturbed"].any() else []) \
        + ([NOTES["compiled"]] if cells["compiled"].astype(bool).any() else []) \
        + ([NOTES["native_fp8"]] if ((cells["setting"] == "fp8-mixed") & (cells["backend"] == "native")
                                     & ~cells["compiled"].astype(bool)).any() else [])
    markdown = {}
    for name, table in built.items():
        extra = timing_notes + [NOTES["predicted"]] if name == "precision" else [NOTES["charlm"]] \
            if name == "unit_scaling_charlm" else [NOTES["block_formats"]] if name == "block_formats" else \
            [NOTES["time_to_target"], NOTES["predicted"]] if name == "time_to_target" else []
        markdown[name] = to_markdown(table, notes + extra)
        (directory / f"{name}.md").write_text(f"# {CAPTIONS[name]}\n\n{markdown[name]}\n")
        (directory / f"{name}.tex").write_text(to_latex(table, CAPTIONS[name]))
        table.to_csv(directory / f"{name}.csv", index=False)
    return markdown

