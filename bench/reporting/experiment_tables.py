"""The tables an experiment preset declares (`hydra.sweeper.table` in its yaml, checked before a sweep starts), one
registry entry each (`DECLARED_TABLES`): the Unit Scaling paper's char-LM layout, block formats by bits per
element, u-μP's learning-rate transfer, a preset's labelled rows, an ablation."""

from __future__ import annotations

import functools
import math
import re
from typing import NamedTuple

import pandas as pd
import yaml
from omegaconf import OmegaConf

from bench.errors import ConfigError
from bench.numerics.scaling_methods import NO_SCALING, SCALING_METHODS, scaling_order
from bench.numerics.specs import FORMAT_SPECS
from bench.reporting.aggregate import RECIPE_OPTIONS, format_options, numeric_choices
from bench.reporting.statistics import (
    Unit,
)
from bench.reporting.table_cells import (
    EMULATED,
    FP32,
    Table,
    cell_unit,
    evaluated_mark,
    fmt_stat,
    is_cell,
    layout,
    metric_text,
    paired_text,
    published_rows,
    setting_label,
    status_note,
)
from bench.running.config import CONF_DIR, preset_sweeper

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
                ours[heading] = (text + evaluated_mark(c) + (f" {EMULATED}" if c["backend"] == "emulated" else "")
                                 + (f" [{note}]" if note else ""))
                runs_here = here[is_cell(here, setting, scaling)]
                differences = [v - reference[s] for v, s in zip(runs_here["value"], runs_here["seed"])
                               if s in reference.index]
                ours_delta[heading] = paired_text(differences, BITS, baseline=(setting, scaling) == (FP32, NO_SCALING))
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
    against: str = ""  # an ablation row's second reference: the label of another row it is paired with too

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
    sweeper = preset_sweeper(experiment) or {}
    if not sweeper.get("table"):
        return None
    rows = [_row(setting) for setting in sweeper.get("settings") or []
            if hasattr(setting, "keys") and "label" in setting]
    labels = [row.label for row in rows]
    for row in rows:
        if row.against and row.against not in labels:
            raise ConfigError(f"conf/experiment/{experiment}.yaml: setting {row.label!r} is paired against "
                              f"{row.against!r}, which labels no setting; valid: {', '.join(labels)}")
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
                    overrides.get("scaling", NO_SCALING),
                    overrides.get("format.rounding", defaults.get("rounding", "nearest")),
                    setting["label"],
                    float(setting.get("bits") or "nan"),
                    format_options(fmt, numeric_choices(overrides)),
                    str(setting.get("against") or ""))


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
                         "bits / element": f"{block_row.bits:g}", "metric": metric, "mean ± std": metric_text(c),
                         "Δ vs FP32": paired_text(differences, cell_unit(c), block_row.setting == "32-true"),
                         "gradients rel. MSE":
                             "–" if pd.isna(c["gradients_rel_mse"]) else f"{c['gradients_rel_mse']:.2e}",
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


WIDTH = r"×\d+"  # a model label's width (4L×128)


def lr_shift(best: pd.DataFrame, scaling: str) -> float | None:
    """How far the best learning rate moved from the narrowest model of the sweep to the widest, in factors of 2;
    None where the models do not differ in width alone (a post-norm and a pre-norm model of one width)."""
    rows = best[best["scaling"].astype(str) == scaling] if not best.empty else best
    if len(rows) < 2 or rows["model_label"].str.replace(WIDTH, "", regex=True).nunique() > 1 \
            or rows["model_label"].nunique() < 2:
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
            "best lr": f"{r['best']['lr']:.3g}", f"{metric} at best": metric_text(r["best"]),
            "at the lr below": "–" if r["below"] is None else f"{metric_text(r['below'])} (lr {r['below']['lr']:.3g})",
            "at the lr above": "–" if r["above"] is None else f"{metric_text(r['above'])} (lr {r['above']['lr']:.3g})",
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
                rows.append({"model": label, "cell": row.label, "setting": setting_label(c), "lr": f"{c['lr']:.3g}",
                             "mean ± std": metric_text(c),
                             "Δ vs its 32-true": paired_text(differences, cell_unit(c),
                                                              str(c["setting"]) == "32-true")})
    return pd.DataFrame(rows)


def ablation_table(runs: pd.DataFrame, cells: pd.DataFrame, labelled: list[BlockRow]) -> pd.DataFrame:
    """An ablation: the cells a preset labels, in its order, each beside the first (its baseline: BF16 in the NVFP4
    recipe's): the metric (mean ± std over seeds), the runs that finished, and the paired difference to the
    baseline, seed by seed, with a 95% t interval; and, for a row that names another as `against` (the full recipe
    less one part), its paired difference to that row too, in a column of its own."""
    ok = runs[(runs["status"] == "ok") & runs["value"].notna()]
    by_label = {row.label: row for row in labelled}
    second = list(dict.fromkeys(row.against for row in labelled if row.against))
    rows = []
    for (label, design), part in cells.groupby(["model_label", "design_id"], sort=False):
        here = ok[ok["design_id"] == design]

        def values(row: BlockRow) -> pd.Series:
            return here[row.selects(here)].drop_duplicates("seed").set_index("seed")["value"]

        def paired_against(mine: pd.Series, reference: pd.Series) -> list[float]:
            return [v - reference[s] for s, v in mine.items() if s in reference.index]

        for row in labelled:
            for _, c in part[row.selects(part)].iterrows():
                mine = values(row)
                text = {f"Δ vs {labelled[0].label}": paired_text(paired_against(mine, values(labelled[0])),
                                                                  cell_unit(c), row == labelled[0])}
                for reference in second:
                    text[f"Δ vs {reference}"] = (
                        paired_text(paired_against(mine, values(by_label[reference])), cell_unit(c), False)
                        if row.against == reference else "baseline" if row.label == reference else "–")
                rows.append({"model": label, "cell": row.label, "setting": setting_label(c),
                             "options": c["format_options"] or "–", "gradients rounded": row.rounding,
                             "runs ok": f"{int(c['ok'])}/{int(c['runs'])}", "mean ± std": metric_text(c), **text})
    return pd.DataFrame(rows)


# The tables a preset may declare (`hydra.sweeper.table` in its yaml, checked before a sweep starts): name ->
# (runs, cells, the preset's labelled rows) -> the table, or None where its cells are not there.
DECLARED_TABLES = {
    "unit_scaling_charlm": Table(
        lambda runs, cells, rows: unit_scaling_charlm_table(runs, cells) if (cells["metric"] == "val_loss").any()
        else None,
        "Validation bits per character in the Unit Scaling paper's char-LM layout, beside the paper's WikiText-103 "
        "figures (a different dataset and model size: compare the pattern of differences to FP32 regular, not the "
        "values)", ("charlm",)),
    "block_formats": Table(
        lambda runs, cells, rows: block_formats_table(runs, cells, rows),
        "The primary metric per model by bits per element (scales included): FP8 tensorwise, rowwise and block "
        "scaling, MX and NVFP4, with and without stochastic rounding of the gradients", ("block_formats",)),
    "lr_transfer": Table(
        lambda runs, cells, rows: lr_transfer_table(cells),
        "The best learning rate per width and parametrisation, with the metric at it and at the learning rates "
        "either side (the u-μP paper's learning-rate transfer, as a table)"),
    "labelled_rows": Table(
        labelled_rows_table,
        "The cells the preset names, and each one's paired difference to the 32-true cell of its own learning rate "
        "and scaling method (SP's FP32 for per-tensor scaling)"),
    "ablation": Table(
        ablation_table,
        "An ablation: each cell the preset names beside its first (the baseline), the paired difference seed by seed "
        "with a 95% t interval; a cell the preset pairs against another (`against`) has that difference too, in a "
        "column of its own"),
}
