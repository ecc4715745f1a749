"""What every table shares (bench/reporting/tables.py, bench/reporting/experiment_tables.py): the markers and
notes, a cell's values as text, picking cells by setting, and Markdown and LaTeX rendering."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import pandas as pd
import yaml

from bench.reporting.aggregate import EVALUATED_WITHOUT_AUTOCAST
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

PUBLISHED = Path(__file__).parent / "reference" / "published.yaml"
EMULATED = "†"
FP32 = "32-true"  # the setting every difference is taken against
DISTURBED = "‡"
STALLED = "¶"
EVALUATED_OUTSIDE = "°"
ROW_MARKS = (EMULATED, DISTURBED, STALLED, CLIPPED, EVALUATED_OUTSIDE)  # a note opening with one explains it
NOTES = {
    "predicted": "predicted step, speed-up and time to target: predicted, not measured: the speed model's step time on "
                 "that GPU (bench/speed/model.py), from this cell's own traced step, on the path the runner would take "
                 "there (no native path: it would emulate the format); compiled, as published FP8 figures are; "
                 "speed-up against the 32-true cell's prediction. How far off it has been: "
                 "results/bench/speed_model_validation.md.",
    "predicted_distributed": "a distributed cell's (parallel=ddp or fsdp2) predicted step is one device's step of "
                             "the whole batch, as its record holds it: `bench.predict` on the cell gives a rank's step "
                             "of its share with the collectives it leaves exposed, and a rank's memory.",
    "time_to_target": "steps to target: the first evaluation at which a seed's quality curve (its validation metric) "
                      "reached the target: the final value of the 32-true run of the same seed and configuration (of "
                      "the unscaled one where no 32-true run has the cell's scaling method; the target column: their "
                      "mean over seeds), or the preset's own (hydra.sweeper.quality_target); mean over the seeds that "
                      "reached it [95% t interval, clipped at 0] (how many reached it of how many had a curve and a "
                      "target); a run is counted at the evaluation that first reached it, so the evaluation interval "
                      "bounds the resolution; predicted time to target: those steps at the predicted compiled step "
                      "(bench/reporting/quality.py).",
    "emulated": f"{EMULATED} emulated in FP32: time, speed-up and measured peak measure the emulation on this device, "
                "not the format (modelled memory counts the format's storage either way, but for the inputs a block "
                "format's emulated GEMM saves for its backward, counted in FP32 as the emulation holds them: "
                "docs/memory.md).",
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
    "time": "train time: median over the seeds that finished [min–max] (n); speed-up: the 32-true median over "
            "this one.",
    "compiled": "compiled: the cell trained with train.compile (torch.compile); its time and speed-up leave out the "
                "steps during which it compiled, whose median seconds are shown beside it (timing.compile).",
    "fused_graphs": "making fused graphs: the emulated cell's quantisers and ops compiled a graph for each new "
                    "layout on its first call (bench/numerics/fused.py; seconds each, a minute on an empty inductor "
                    "cache); its time and speed-up leave out the steps that did, whose median seconds are shown "
                    "beside it with what its validations spent on it (timing.compile).",
    "std": "mean ± sample standard deviation over seeds (n runs with a value).",
    "difference": "Δ vs 32-true: mean of the per-seed differences to the 32-true cell of the same scaling, seed and "
                  "configuration (seeds are paired: same initial weights and data order) [95% confidence interval, "
                  f"Student's t over the n paired seeds]; {SIGNIFICANT} marks an interval that excludes 0, a "
                  "difference the seeds tell apart from noise; without the mark it is not distinguishable from 0.",
    "charlm": "Δ vs FP32 regular: mean over seeds of this run's BPC minus the FP32-regular run's of the same seed and "
              f"norm [95% t interval] (n paired seeds); {SIGNIFICANT} marks an interval that excludes 0. The paper's "
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
              "run's first step (bench/numerics/memory.py), the same for native and emulated runs (but a block "
              "format's emulated GEMM inputs, saved in FP32); measured peak: the process's peak resident set on "
              "CPU (mostly the Python/torch runtime), max_memory_allocated on CUDA; "
              "TFLOP/s: FLOPs of a step over its median time, native runs only.",
}
def cell_unit(cell) -> Unit:
    """The unit of a cell's (or run's) metric, as its model declares it (`model.task.unit`)."""
    return unit(cell.get("unit"))


def fmt_time(cell) -> str:
    """Median train time [min–max] (n); for a compiled cell, `compiled` and the median seconds its compiling steps
    took, which the time (and so the speed-up) leaves out; for another that made fused graphs, those seconds."""
    n = cell["train_s_n"]
    if n == 0 or pd.isna(cell["train_s"]):
        return "–"
    spread = "" if n == 1 else f" [{cell['train_s_min']:.1f}–{cell['train_s_max']:.1f}]"
    compiled = f", compiled (+{cell['compile_s']:.1f} s compiling)" if cell.get("compiled") else \
        f", +{cell['compile_s']:.1f} s making fused graphs" if made_fused_graphs(cell) else ""
    return f"{cell['train_s']:.1f}{spread} (n={n}){compiled}{DISTURBED if cell['disturbed'] else ''}"


def made_fused_graphs(cell) -> bool:
    """Whether a cell trained without torch.compile left out making fused graphs (0.05 s or more: 0.1 shown)."""
    return not cell.get("compiled") and not pd.isna(cell.get("compile_s")) and cell["compile_s"] >= 0.05


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
    baseline = str(cell["setting"]) == "32-true"
    if flag(cell.get("baseline_near_chance")):
        return f"baseline {near_chance_note(cell)}" if baseline else f"– ({near_chance_note(cell)})"
    if baseline:
        return "baseline"
    text = format_paired(cell_difference(cell), cell_unit(cell), with_n)
    without = cell_difference(cell, "_without_stalled")
    if without.n < cell_difference(cell).n:
        text += f"; without stalled runs: {format_paired(without, cell_unit(cell), with_n)}"
    return text


def near_chance_note(cell) -> str:
    """What a table says where the cell's 32-true baseline learned nothing (bench.reporting.quality.near_chance)."""
    metric_unit = cell_unit(cell)
    shown = lambda v: f"{metric_unit.shown(v):.{metric_unit.digits}f}"  # noqa: E731
    return (f"32-true at {shown(cell['fp32_value'])}, near chance ({shown(cell['chance'])}): nothing learned to "
            "compare against")


def fmt_mib(value) -> str:
    return "–" if pd.isna(value) else f"{value / 2**20:.3g}"


def status_note(cell) -> str:
    """Empty when every run was ok; otherwise the counts of the others."""
    parts = [f"{int(cell[s])} {s}" for s in ("diverged", "failed") if cell[s]]
    return ", ".join(parts)


def evaluated_mark(cell) -> str:
    """° where the cell's metric was evaluated without the autocast it trained under, else nothing."""
    return EVALUATED_OUTSIDE if cell["value_n"] and EVALUATED_WITHOUT_AUTOCAST in str(cell.get("evaluated_in") or "") \
        else ""


def metric_text(cell) -> str:
    """mean ± std (n) in the metric's shown units; the runs that did not finish, and the stalled ones with the cell's
    statistics without them; ° where the metric was evaluated without the autocast the cell trained under."""
    metric_unit = cell_unit(cell)
    text = fmt_stat(metric_unit.shown(cell["value"]), metric_unit.shown(cell["value_std"]), cell["value_n"],
                    metric_unit.digits)
    text += evaluated_mark(cell)
    notes = [status_note(cell)] if status_note(cell) else []
    if cell.get("stalled"):
        without = fmt_stat(metric_unit.shown(cell["value_without_stalled"]),
                           metric_unit.shown(cell["value_without_stalled_std"]), cell["value_without_stalled_n"],
                           metric_unit.digits)
        notes.append(f"{int(cell['stalled'])} stalled{STALLED}; without: {without}")
    return f"{text} [{'; '.join(notes)}]" if notes else text


def setting_label(cell) -> str:
    elsewhere = " (bf16 elsewhere)" if "elsewhere=bf16" in str(cell.get("format_options") or "") else ""
    return f"{cell['setting']}{elsewhere}{' ' + EMULATED if cell['backend'] == 'emulated' else ''}"


def cell_identity(cell, cells: pd.DataFrame) -> dict:
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


def unpredicted(cell, name: str) -> str:
    """What stands where a cell has no prediction on GPU `name`: no native path (the runner would emulate it there),
    or nothing (its step could not be traced here)."""
    why = cell[f"predicted_{name}_why"]
    return "no native path" if isinstance(why, str) and not why.startswith("its step could not") else "–"


def predicted_cells(cell, name: str) -> dict:
    """The precision table's predicted columns for GPU `name`: its compiled step, the speed-up over 32-true there, and
    for a cell measured natively on that GPU, the prediction's error."""
    step = cell[f"predicted_{name}_compiled_s"]
    if pd.isna(step):
        return {f"predicted step ({name}, compiled)": unpredicted(cell, name), f"predicted speed-up ({name})": "–"}
    columns = {f"predicted step ({name}, compiled)": fmt_seconds(step),
               f"predicted speed-up ({name})": "–" if pd.isna(cell[f"predicted_{name}_speedup"])
               else f"{cell[f'predicted_{name}_speedup']:.2f}×"}
    if not pd.isna(cell.get(f"predicted_{name}_error", np.nan)):
        columns[f"prediction error ({name})"] = f"{cell[f'predicted_{name}_error']:+.0%}"
    return columns


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


def paired_text(differences: list[float], metric_unit: Unit, baseline: bool) -> str:
    """A table's paired difference (bench.reporting.statistics), or `baseline` for the reference cell itself."""
    return "baseline" if baseline else format_paired(paired(differences, metric_unit), metric_unit)


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


def published_rows() -> list[dict]:
    data = yaml.safe_load(PUBLISHED.read_text())
    return [r | {"citation": data["sources"][r["source"]]} for r in data["results"]]


@dataclass(frozen=True)
class Table:
    """One table, as the registry knows it: how it is built from the per-run frame, the per-cell summary and a
    preset's labelled rows (None where its cells are not there), its caption, and the notes (NOTES keys) it adds
    to the ones every table carries."""

    build: Callable[[pd.DataFrame, pd.DataFrame, list], pd.DataFrame | None]
    caption: str
    notes: tuple[str, ...] = ()
