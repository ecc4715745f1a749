"""Records -> one DataFrame per run, one summary per cell: what the tables and plots are made from.

Records come from a results directory (every result.json below it, and every committed records.jsonl.gz:
bench/reporting/archive.py), an archive, or wandb://entity/project[/group] (the runs' summaries, which hold the
same records, pulled through wandb.Api). A corrupt, partial or malformed record
is reported by name and skipped; a record found twice (the same run_id) counts once.

A cell is one configuration over seeds: runs that differ in anything that changes what they compute
(steps, learning rate, data, model size, a format or scaling knob) are never averaged together, and a
speed-up compares a cell only with the 32-true cell of otherwise the same configuration. Means and spreads
are over the runs that finished (status ok); diverged and failed runs are counted beside them.

Seeds are paired: the same seed gives every cell the same initial weights and data order, so a cell's
difference to its 32-true cell is the mean of per-seed differences, with a 95% confidence interval from
Student's t over those paired seeds (n - 1 degrees of freedom); an interval that excludes 0 is a difference
the seeds can tell apart from noise.
"""

from __future__ import annotations

import functools
import json
import pydoc
import re
from pathlib import Path

import numpy as np
import pandas as pd

from bench.errors import ConfigError
from bench.numerics.plan import FORMAT_DEFAULTS
from bench.numerics.scaling_methods import scaling_order
from bench.numerics.specs import FORMAT_SPECS, settings_in_order
from bench.numerics.telemetry import TENSOR_CLASSES
from bench.reporting import archive
from bench.reporting.quality import near_chance, targets
from bench.reporting.recorded_predictions import DEFAULT_GPUS, predicted
from bench.reporting.statistics import paired, t_interval, unit
from bench.running.config import check_declared, task_spec
from bench.running.identity import (
    NUMERIC_CHOICES,
    SPELLINGS_OF_NULL,
    comparison_ids,
    config_hash,
    overridden_keys,
    semantic_config,
    spells_null,
)
from bench.running.learning import learning_of, stalled_verdict
from bench.running.record import (
    RECORD_KEYS,
    RecordError,
    check_record,
    logged_losses,
    read_record,
)
from bench.speed.profiles import GPU, gpu
from bench.tasks.base import describe as generic_describe

CELL_KEYS = ["experiment", "model", "task", "model_label", "setting", "scaling", "backend", "variant"]
# Keys a cell's row already names (setting, scaling, model) or that never differ between its runs (seed).
LABELLED = {"experiment_name", "seed", "format.name", "format.mode", "format.backend", "scaling.name", "model.name"}
QUANT_FIELDS = ("underflow", "subnormal", "overflow")
# block-scaled operands' statistics (bench.numerics.telemetry.BLOCK_FIELDS), as <class>_<column>
BLOCK_COLUMNS = {"clipped_blocks": "clipped_block_fraction", "flushed": "flushed_fraction", "rel_mse": "relative_mse"}
# Averaged over a cell's finished runs (train time is its median instead: see summarise).
AVERAGED = ["value", "exact_match", "f1", "step_median_s", "samples_per_s", "peak_bytes", "step_bytes", "tflop_per_s",
          "skipped_steps", "overflow_steps",
          "final_loss_scale", *(f"{c}_{f}" for c in TENSOR_CLASSES for f in (*QUANT_FIELDS, *BLOCK_COLUMNS))]


def load_directory(root: Path) -> tuple[list[dict], list[str]]:
    """All valid records under `root`, each with its directory under "_dir" and its training curve under
    "_losses", those of committed archives (records.jsonl.gz, bench/reporting/archive.py) too; and one message per
    bad one."""
    records, problems = [], []
    for path in sorted(Path(root).rglob("result.json")):
        try:
            records.append(read_record(path) | {"_dir": str(path.parent), "_losses": logged_losses(path.parent)})
        except RecordError as e:
            problems.append(str(e))
    for path in sorted(Path(root).rglob(archive.ARCHIVE)):
        found, bad = archive.read(path)
        records += found
        problems += bad
    return records, problems


def _flatten(config: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in config.items():
        if isinstance(value, dict) and value:
            flat |= _flatten(value, f"{prefix}{key}.")
        else:
            flat[f"{prefix}{key}"] = json.dumps(value, sort_keys=True) if isinstance(value, (dict, list)) else value
    return flat


def describe(model_cfg: dict) -> tuple[str, str]:
    """(dataset, label) of a recorded model, by its declaration's `describe` (bench/tasks/base.py TaskSpec): the
    dataset published figures match on (fixtures and digits never match), and the model as configured (name, size
    or checkpoint, data) for tables and plots. Where that function cannot be imported here (a user's model whose
    module is not on this machine's PYTHONPATH), the generic `<name> (<data source>)`."""
    return _describer(task_spec(model_cfg)["describe"])(model_cfg)


@functools.lru_cache(maxsize=None)
def _describer(path: str):
    """The function at `path`, or the generic one where it cannot be imported (pydoc's lookup: Hydra's logs an
    error first, which read as a failure where the tables are fine)."""
    try:
        return pydoc.locate(path) or generic_describe
    except pydoc.ErrorDuringImport:
        return generic_describe


def _unset(value) -> bool:
    return not isinstance(value, (list, dict, str)) and pd.isna(value)


def _unset_text(column: str) -> str:
    """What a key a run leaves unset means: its named spelling of null where it has one (format.accumulation=exact,
    format.elsewhere=fp32), else null."""
    section, _, key = column.partition(".")
    named = dict(SPELLINGS_OF_NULL.get(section, ()))
    return _option_text(named[key]) if key in named else "null"


def variants(frame: pd.DataFrame, usual_from: pd.DataFrame | None = None) -> pd.Series:
    """For each run, the settings in which it differs from its experiment's usual runs, as `key=value, ...`.

    Keys under format and scaling are compared among runs of the same setting and scaling method; all
    others among every run of the same experiment and model. The usual value of a key is the one most
    runs have; where values tie there is none, and every run shows its own.

    usual_from: other runs (a committed folder's, for bench.compare) whose usual values a group of frame's runs is
    read against where they have that group, so that a run is labelled as those runs' tables label theirs whatever
    else sits beside it; the device is not compared then, nor a key those runs lack (null in them, or added since)
    unless a run's command line set it (its cell names it: `identity.overridden_keys`).
    """
    labels = pd.Series("", index=frame.index)
    for keys, part in frame.groupby(["experiment", "model_label"], sort=False):
        for within, group in [((), part), *(((s, c), g) for (s, c), g in
                                            part.groupby(["setting", "scaling"], observed=True, sort=False))]:
            reference = _same_group(usual_from, (*keys, *within)) if usual_from is not None else None
            per_run = pd.DataFrame(list(frame["settings"][group.index]), index=group.index, dtype=object)
            if reference is None:
                usual_of = per_run
            else:
                usual_of = pd.DataFrame(list(reference["settings"]), index=reference.index, dtype=object)
                # a key the reference runs lack is null in all of them (a run's identity leaves null out), or newer
                # than they are: compared where a run's command line set it (train.max_steps=50 beside full runs)
                named = set().union(*map(overridden_keys, frame.loc[group.index, "cell"]))
                usual_of = usual_of.reindex(columns=[*usual_of.columns, *(c for c in per_run.columns
                                                                          if c in named and c not in usual_of.columns)])
                per_run = per_run.reindex(columns=[c for c in usual_of.columns if c != "device_name"])
            compares_format_and_scaling = bool(within)  # those keys only among runs of one setting/scaling
            own = [c for c in per_run.columns if c not in LABELLED
                   and (c.split(".")[0] in ("format", "scaling")) == compares_format_and_scaling]
            for column in own:
                values, counts = _spelt(per_run[column]), _spelt(usual_of[column]).value_counts()
                if reference is None and len(counts) < 2:
                    continue
                usual = counts.index[0] if len(counts) == 1 or counts.iloc[0] > counts.iloc[1] else None
                for index in values.index[values != usual]:
                    value = per_run.at[index, column]
                    # a key a run leaves unset (null, so out of its identity: e.g. grad_clip under scaling=umup)
                    item = f"{column}={_unset_text(column) if _unset(value) else value}"
                    labels[index] = f"{labels[index]}, {item}" if labels[index] else item
    return labels


def canonical_variant(label: str | float) -> str:
    """A variant label with its items in key order ("" for none: a csv's empty cell reads as NaN). `variants` writes
    them in the order its runs' settings first name the keys, which is that of the records it was given, so two
    folders label one configuration alike only up to order (bench.compare pairs cells by this)."""
    if not isinstance(label, str) or not label:
        return ""
    return ", ".join(sorted(re.split(r", (?=[A-Za-z_][\w.]*=)", label)))


def _spelt(values: pd.Series) -> pd.Series:
    """Settings' values as comparable text (a key a run leaves unset, missing or null, spelt as null)."""
    return values.map(lambda v: "null" if _unset(v) else json.dumps(v, default=str))


def _same_group(runs: pd.DataFrame, keys: tuple) -> pd.DataFrame | None:
    """runs of the group `keys` names (experiment, model_label[, setting, scaling]), or None where it has none."""
    columns = ["experiment", "model_label", "setting", "scaling"][:len(keys)]
    chosen = runs[np.logical_and.reduce([runs[c].astype(str) == str(k) for c, k in zip(columns, keys)])]
    return chosen if len(chosen) else None


def load_wandb(source: str, api=None) -> tuple[list[dict], list[str]]:
    """wandb://entity/project[/group]: each run's summary is the record its cell wrote (bench/running/logger.py)."""
    parts = source.removeprefix("wandb://").strip("/").split("/")
    if len(parts) not in (2, 3):
        raise ValueError(f"{source}: expected wandb://entity/project[/group]")
    if api is None:
        import wandb

        try:
            api = wandb.Api()
        except wandb.errors.UsageError as e:  # no API key: a set-up problem, said in one line
            raise ConfigError(f"{source}: W&B refused: {str(e).splitlines()[0]} (set WANDB_API_KEY, or aggregate "
                              "the local results directory instead)") from None
    filters = {"group": parts[2]} if len(parts) == 3 else {}
    records, problems = [], []
    for run in api.runs(f"{parts[0]}/{parts[1]}", filters=filters):
        try:
            summary = check_record(dict(run.summary), f"{source}: run {run.id}")
        except RecordError as e:
            problems.append(str(e))
            continue
        records.append({k: summary[k] for k in (*RECORD_KEYS, "traceback") if k in summary} | {"_dir": None})
    return records, problems


def load_sources(sources: list[str], api=None) -> tuple[list[dict], list[str]]:
    """The records of every source, and the problems found reading them; ConfigError for a record whose format, model
    or scaling method no module here declares (bench.running.config.check_declared)."""
    records, problems = [], []
    for source in sources:
        if str(source).startswith("wandb://"):
            found, bad = load_wandb(str(source), api)
        elif Path(source).is_dir():
            found, bad = load_directory(Path(source))
        elif Path(source).name == archive.ARCHIVE and Path(source).is_file():
            found, bad = archive.read(Path(source))
        else:
            found, bad = [], [f"{source}: not a directory, {archive.ARCHIVE} or wandb:// source"]
        records += found
        problems += bad
    check_declared(records)  # a record whose format, model or scaling method is not declared here: ConfigError
    return records, problems


def _number(value):
    """Record values as floats (non-finite values are stored as strings in strict JSON)."""
    if isinstance(value, str) and value in ("nan", "inf", "-inf"):
        return float(value)
    return np.nan if value is None else value


# Format options that make another recipe of a block format, and their defaults (the format's own recipe).
RECIPE_OPTIONS = {key: FORMAT_DEFAULTS[key] for key in ("gradients", "scale_mode", "elsewhere", "rht", "rht_seed",
                                                         "weight_blocks", "pad_weights", "keep_high_precision",
                                                         "scale_rule", "sr_bits", "accumulation")} \
    | {"elsewhere": "fp32"}  # null and fp32 both: FP32 outside the GEMMs


def format_options(fmt: dict, choices: dict | None = None) -> str:
    """The recipe options a run's format departs from its defaults in, then its numeric choices outside the format
    (`choices`: `numeric_choices`), as "key=value, ..." ("" for none)."""
    options = [f"{k}={_option_text(fmt.get(k))}" for k, default in RECIPE_OPTIONS.items()
               if fmt.get(k) is not None and fmt.get(k) != default]
    return ", ".join(options + [f"{k}={v}" for k, v in (choices or {}).items() if v is not None])


def numeric_choices(flat: dict) -> dict:
    """The NUMERIC_CHOICES (the optimiser's state format, the master weights, a distributed cell's parallel keys) of
    a config as dotted keys (a run's `settings`, a preset's overrides) that it sets to other than null's spellings,
    by their last key (parallel.name as `parallel`)."""
    return {("parallel" if dotted == "parallel.name" else dotted.rsplit(".", 1)[1]): flat.get(dotted)
            for dotted in NUMERIC_CHOICES if flat.get(dotted) is not None and not spells_null(dotted, flat.get(dotted))}


def _option_text(value) -> str:
    return "[" + ",".join(map(str, value)) + "]" if isinstance(value, (list, tuple)) else str(value)


# A record made before evaluation ran in the trained precision (`metrics.evaluated_in`, 0.3.0) by a cell that trained
# under autocast was evaluated without it: what its GEMMs outside the format (native 16-bit: all of them) computed in.
EVALUATED_WITHOUT_AUTOCAST = "without its autocast (recorded before evaluation ran in the trained precision)"


def evaluated_in(record: dict) -> str | None:
    """The setting a record's metrics were computed in: `metrics.evaluated_in`, or for a record made before it was
    recorded, its training setting, unless the cell trained under autocast (native 16-bit mixed, or BF16 outside an
    FP8 or block format's GEMMs): then EVALUATED_WITHOUT_AUTOCAST, for those records evaluated outside it."""
    if "evaluated_in" in record["metrics"]:
        return record["metrics"]["evaluated_in"]
    precision = record["env"].get("precision") or {}
    spec = FORMAT_SPECS.get(precision.get("format"))
    native_autocast = (precision.get("backend") == "native" and precision.get("mode") == "mixed" and spec is not None
                       and spec.native_path == "torch" and spec.torch_dtype is not None)  # 16-bit mixed, natively
    if native_autocast or precision.get("elsewhere") == "bf16":
        return EVALUATED_WITHOUT_AUTOCAST
    return precision.get("label")


def _first_of_each_run(records: list[dict]):
    """(record, its semantic config) for the first record of each run on each device: its run_id, recomputed as a
    resumed sweep does, and the device."""
    seen = set()
    for r in records:
        semantic = semantic_config(r["config"])
        identity = (config_hash(semantic), r["env"].get("device_name"))
        if identity not in seen:
            seen.add(identity)
            yield r, semantic


def machine(env: dict) -> str | None:
    """What ran a record, as its tables name it: the device, and on a CPU its 16-bit units (which decide whether
    bf16 and fp16 ran natively, and how fast: env.cpu_16bit_units)."""
    device, units = env.get("device_name"), env.get("cpu_16bit_units")
    if env.get("device_type") != "cpu" or units is None:
        return device
    return f"{device} ({'16-bit units: ' + ', '.join(units) if units else 'no 16-bit units'})"


def unique(records: list[dict]) -> list[dict]:
    """The first record of each run on each device (the records to_frame makes rows of)."""
    return [r for r, _ in _first_of_each_run(records)]


def to_frame(records: list[dict], gpus: tuple[GPU, ...] | None = None,
             usual_from: pd.DataFrame | None = None) -> pd.DataFrame:
    """One row per record (the first of several with the same run_id on the same device), with the speed model's
    prediction on each of `gpus` (default: DEFAULT_GPUS; bench/reporting/recorded_predictions.py), its quality curve
    and the steps it took to reach its target (bench/reporting/quality.py); its variant read against `usual_from`'s
    runs where given (`variants`).

    The device is part of what a run is here: the same config run on a CPU and on an H100 (or on two GPU types
    of one cluster) makes two cells, labelled `device_name=...`, each paired with its own device's FP32, since their
    times cannot be averaged and their numerics need not agree."""
    gpus = gpus or tuple(gpu(name) for name in DEFAULT_GPUS)
    rows = []
    for r, semantic in _first_of_each_run(records):
        cfg, env, numerics, metrics = r["config"], r["env"], r["numerics"], r["metrics"]
        device = env.get("device_name")
        precision = env.get("precision", {})
        model = cfg["model"]["name"]
        spec = task_spec(cfg["model"])
        metric = spec["metric"]
        dataset, label = describe(cfg["model"])
        quant = numerics.get("quantisation") or {}
        pretrained = cfg["model"].get("pretrained", True)
        semantic |= {"device_name": device}
        settings = _flatten(semantic)
        row = {
            "experiment": cfg["experiment_name"], "model": model, "model_label": label,
            "task": dataset + ("" if pretrained else "_scratch"),
            **comparison_ids(semantic),  # config_id, baseline_id, design_id (bench/running/identity.py)
            "settings": settings,  # its semantic config as dotted keys: variants, published_table
            "setting": precision.get("setting"), "scaling": cfg["scaling"]["name"], "seed": cfg["seed"],
            "rounding": cfg["format"].get("rounding", "nearest"),  # of the gradient operands (fp8, block formats)
            "format_options": format_options(cfg["format"], numeric_choices(settings)),
            "backend": precision.get("backend"), "device": device, "machine": machine(env), "status": r["status"],
            "reason": r.get("reason"), "diverged_at_step": _number(numerics.get("diverged_at_step")),
            "metric": metric, "unit": spec["unit"], "higher_is_better": spec["higher_is_better"],
            "chance": _number(spec.get("chance")),
            "value": _number(metrics.get(metric)), "evaluated_in": evaluated_in(r),
            # of a learning-rate sweep (bench.reporting.tables.lr_transfer_table)
            "lr": _number((cfg["model"].get("optimizer") or {}).get("lr")),
            "exact_match": _number(metrics.get("exact_match")), "f1": _number(metrics.get("f1")),
            "steps": _number(r["timing"].get("steps")),
            "final_train_loss": _number(metrics.get("final_train_loss")),  # at `steps`: where a loss curve ends
            # the training loop without the steps that compiled (timing.compile), which are counted apart: a
            # speed-up compares steady steps, and an eager run's two times are one
            "train_s": _number(r["timing"].get("train_s_without_compile", r["timing"].get("train_s"))),
            "compile_s": _number((r["timing"].get("compile") or {}).get("seconds", 0.0)),
            "compiled": bool((env.get("compile") or {}).get("compiled")),
            "disturbed": bool((r["timing"].get("conditions") or {}).get("disturbed")),
            "step_median_s": _number(r["timing"].get("step_median_s")),
            "samples_per_s": _number(r["timing"].get("samples_per_s")),
            "peak_bytes": _number(r["memory"].get("peak_bytes")),
            "step_bytes": _number((r["memory"].get("step") or {}).get("total")),
            "tflop_per_s": _number(r["timing"].get("tflop_per_s")),
            "skipped_steps": _number(numerics.get("skipped_steps")),
            "overflow_steps": _number(numerics.get("overflow_steps")),
            "final_loss_scale": _number(numerics.get("final_loss_scale")),
            "loss_scale_history": (numerics.get("loss_scale") or {}).get("history"),
            "loss_scaling": numerics.get("loss_scaling"),
            "dir": r.get("_dir"), "cell": cfg.get("cell") or "",  # its place: the keys its command line set
            "losses": r.get("_losses") or [], "learning": learning_of(r),
            # a record made before records held their quality curve has none: no steps to target are read off it
            "curve": (metrics.get("curve") or {}).get("points") or [],
            "predicted": predicted(r, gpus),
        }
        for c in TENSOR_CLASSES:
            for f in QUANT_FIELDS:
                row[f"{c}_{f}"] = _number((quant.get(c) or {}).get(f"{f}_fraction"))
            for column, field in BLOCK_COLUMNS.items():
                row[f"{c}_{column}"] = _number(((quant.get(c) or {}).get("blocks") or {}).get(field))
        rows.append(row)
    frame = pd.DataFrame(rows)
    if frame.empty:
        return frame
    frame["setting"] = pd.Categorical(frame["setting"], settings_in_order(), ordered=True)  # the registry's order
    frame["scaling"] = pd.Categorical(frame["scaling"], scaling_order(frame["scaling"]), ordered=True)
    frame["variant"] = variants(frame, usual_from)
    frame["stalled"] = _stalled(frame)
    frame = frame.join(targets(frame))
    frame.attrs["gpus"] = [g.name for g in gpus]
    return frame.sort_values([*CELL_KEYS, "seed"]).reset_index(drop=True)


def _stalled(frame: pd.DataFrame) -> pd.Series:
    """Per run, bench.running.learning's verdict against its siblings (the cell's other finished seeds): True,
    False, or None where it cannot be decided (no curve, fewer than two siblings, not finished)."""
    verdicts = pd.Series(None, index=frame.index, dtype=object)
    for _, runs in frame[frame["status"] == "ok"].groupby("config_id", sort=False):
        for i in runs.index:
            verdict = stalled_verdict(runs.at[i, "learning"], [runs.at[j, "learning"] for j in runs.index if j != i])
            verdicts[i] = None if verdict is None else verdict["stalled"]
    return verdicts


def summarise(frame: pd.DataFrame) -> pd.DataFrame:
    """One row per cell (one configuration over seeds): mean, std (sample, ddof=1), n and the mean's 95% t interval
    over the runs that finished, status counts over all of them, ratios to 32-true, and the paired difference
    to 32-true (paired_differences).

    Ratios compare median train time and mean peak memory with the 32-true cell of the same configuration apart
    from the format (same experiment, model, data, steps, scaling method and its knobs, on the same device),
    the published tables' convention; a cell without such a baseline gets none.
    """
    keys = [*CELL_KEYS, "config_id"]
    groups = frame.groupby(keys, observed=True, sort=True)
    finished = frame[frame["status"] == "ok"].groupby(keys, observed=True, sort=True)
    cells = finished[AVERAGED].mean().reindex(groups.size().index)
    for column in ("value", "train_s", "peak_bytes", "exact_match", "f1"):
        cells[f"{column}_std"] = finished[column].std(ddof=1)
        cells[f"{column}_n"] = finished[column].count().reindex(cells.index, fill_value=0)
    # a time is the median over seeds, with its range: one slow, disturbed seed does not move it
    cells["train_s"] = finished["train_s"].median()
    cells["train_s_min"], cells["train_s_max"] = finished["train_s"].min(), finished["train_s"].max()
    cells["disturbed"] = groups["disturbed"].any()
    cells["compiled"] = groups["compiled"].any()
    cells["compile_s"] = finished["compile_s"].median()
    cells["metric"] = groups["metric"].first()
    cells["higher_is_better"] = groups["higher_is_better"].first()
    cells["chance"] = groups["chance"].first()
    cells["lr"] = groups["lr"].first()
    cells["settings"] = groups["settings"].first()  # the same for every seed but in `seed`
    cells["runs"] = groups.size()
    for status in ("ok", "diverged", "failed"):
        cells[status] = groups["status"].apply(lambda s, st=status: int((s == st).sum()))
    cells["device"] = groups["device"].first()
    cells["machine"] = groups["machine"].first()
    cells["baseline_id"] = groups["baseline_id"].first()
    cells["design_id"] = groups["design_id"].first()
    cells["rounding"] = groups["rounding"].first()
    cells["format_options"] = groups["format_options"].first()
    cells["unit"] = groups["unit"].first()
    values = finished["value"].apply(list).reindex(cells.index, fill_value=[])
    intervals = [t_interval(v, unit(u).bounds) for v, u in zip(values, cells["unit"])]
    cells["value_ci_lo"] = [i.lo for i in intervals]
    cells["value_ci_hi"] = [i.hi for i in intervals]
    cells["value_ci_clipped"] = [i.clipped for i in intervals]
    # the runs bench.running.learning's rule found stalled, and the cell's statistics without them
    cells["stalled"] = groups["stalled"].apply(lambda s: int(s.eq(True).sum()))
    kept = frame[frame["status"].eq("ok") & ~frame["stalled"].eq(True)].groupby(keys, observed=True, sort=True)
    cells["value_without_stalled"] = kept["value"].mean()
    cells["value_without_stalled_std"] = kept["value"].std(ddof=1)
    cells["value_without_stalled_n"] = kept["value"].count().reindex(cells.index, fill_value=0)
    evaluated = finished["evaluated_in"].apply(lambda s: "; ".join(sorted({str(v) for v in s.dropna()})))
    cells["evaluated_in"] = evaluated.reindex(cells.index, fill_value="")
    _time_to_target(cells, groups, finished)
    for name in frame.attrs.get("gpus", []):
        _predicted_columns(cells, groups, finished, name)
    cells = cells.reset_index()
    base = cells[cells["setting"] == "32-true"][["baseline_id", "train_s", "peak_bytes", "step_bytes", "value"]]
    base = base.rename(columns={"train_s": "fp32_train_s", "peak_bytes": "fp32_peak_bytes",
                                "step_bytes": "fp32_step_bytes", "value": "fp32_value"})
    base = base.groupby("baseline_id").first().reset_index()  # native and emulated fp32 are one thing
    cells = cells.merge(base, on="baseline_id", how="left")
    cells["speedup_vs_fp32"] = cells["fp32_train_s"] / cells["train_s"]
    cells["memory_ratio_vs_fp32"] = cells["peak_bytes"] / cells["fp32_peak_bytes"]
    cells["step_memory_ratio_vs_fp32"] = cells["step_bytes"] / cells["fp32_step_bytes"]
    # a 32-true cell that learned nothing is no baseline: its differences and targets say so (bench.reporting.quality)
    cells["baseline_near_chance"] = [
        False if pd.isna(h) else near_chance(v, c, bool(h), unit(u).bounds[1 if h else 0])
        for v, c, h, u in zip(cells["fp32_value"], cells["chance"], cells["higher_is_better"], cells["unit"])]
    for name in frame.attrs.get("gpus", []):  # a predicted speed-up: against the 32-true cell's prediction there
        column = f"predicted_{name}_compiled_s"
        fp32 = cells[cells["setting"] == "32-true"].groupby("baseline_id")[column].first()
        cells[f"predicted_{name}_speedup"] = cells["baseline_id"].map(fp32) / cells[column]
    cells = cells.merge(paired_differences(frame), on="config_id", how="left")
    without = paired_differences(frame[~frame["stalled"].eq(True)])  # a pair with a stalled run is left out
    cells = cells.merge(without.rename(columns={c: f"{c}_without_stalled" for c in DIFFERENCE_COLUMNS}),
                        on="config_id", how="left")
    return cells.drop(columns=["fp32_train_s", "fp32_peak_bytes", "fp32_step_bytes", "baseline_id", "config_id"])


def _time_to_target(cells: pd.DataFrame, groups, finished) -> None:
    """A cell's steps to its target (bench/reporting/quality.py) over the seeds that reached it: mean, 95% interval
    (clipped at 0), how many reached it of how many could be judged, and the target (the same for every seed where a
    preset declares it; the 32-true seeds' mean otherwise)."""
    cells["target"] = finished["target"].mean()
    cells["target_judged"] = finished["reached"].apply(lambda s: int(s.notna().sum())).reindex(cells.index,
                                                                                               fill_value=0)
    cells["target_reached"] = finished["reached"].apply(lambda s: int(s.eq(True).sum())).reindex(cells.index,
                                                                                                 fill_value=0)
    cells["steps_to_target"] = finished["steps_to_target"].mean()
    steps = finished["steps_to_target"].apply(list).reindex(cells.index, fill_value=[])
    intervals = [t_interval(v, (0.0, np.inf)) for v in steps]
    cells["steps_to_target_lo"], cells["steps_to_target_hi"] = [i.lo for i in intervals], [i.hi for i in intervals]


def _predicted_columns(cells: pd.DataFrame, groups, finished, name: str) -> None:
    """The speed model's step on GPU `name`, compiled and eager (the same for every seed: one configuration), or why
    there is none; its steps to target, in predicted seconds; and, for a cell that ran natively on that GPU, the
    prediction's error against its own measured step (compiled against compiled, eager against eager)."""
    first = groups["predicted"].first()
    cells[f"predicted_{name}_compiled_s"] = first.map(lambda p: (p[name].get("compiled") or {}).get("step_s"))
    cells[f"predicted_{name}_eager_s"] = first.map(lambda p: (p[name].get("eager") or {}).get("step_s"))
    cells[f"predicted_{name}_why"] = first.map(lambda p: p[name].get("no_native_path") or p[name].get("no_prediction"))
    cells[f"predicted_{name}_to_target_s"] = cells["steps_to_target"] * cells[f"predicted_{name}_compiled_s"]
    profile = gpu(name)
    measured = finished["step_median_s"].mean().reindex(cells.index)
    here = cells["device"].astype(str).str.startswith(profile.device_name) & (cells.index.get_level_values(
        "backend") == "native")
    mode = np.where(cells["compiled"], cells[f"predicted_{name}_compiled_s"], cells[f"predicted_{name}_eager_s"])
    cells[f"predicted_{name}_error"] = np.where(here, mode / measured - 1, np.nan)


DIFFERENCE_COLUMNS = ["value_vs_fp32", "value_vs_fp32_n", "value_vs_fp32_lo", "value_vs_fp32_hi",
                      "value_vs_fp32_significant", "value_vs_fp32_clipped"]


def paired_differences(frame: pd.DataFrame) -> pd.DataFrame:
    """Per cell (config_id): the mean over seeds of (this run's metric - the 32-true run's of the same seed and
    otherwise the same configuration), over the seeds where both finished; its 95% t interval, clipped to the
    differences the metric's unit allows (bench/reporting/statistics.py); whether that interval excludes 0, and
    whether it was clipped. A 32-true cell is its own baseline (every difference 0)."""
    ok = frame[(frame["status"] == "ok") & frame["value"].notna()]
    baseline = ok[ok["setting"] == "32-true"].drop_duplicates(["baseline_id", "seed"]) \
        .set_index(["baseline_id", "seed"])["value"]
    rows = []
    for config_id, runs in ok.groupby("config_id", sort=False):
        pairs = zip(runs["value"], zip(runs["baseline_id"], runs["seed"]))
        difference = paired([value - baseline[key] for value, key in pairs if key in baseline.index],
                            unit(runs["unit"].iloc[0]))
        rows.append([config_id, difference.mean, difference.n, difference.interval.lo, difference.interval.hi,
                     difference.significant, difference.interval.clipped])
    return pd.DataFrame(rows, columns=["config_id", *DIFFERENCE_COLUMNS])
