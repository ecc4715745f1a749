"""The speed model's predictions for recorded cells (bench/speed/model.py): a record's own (`predicted`, which the
runner writes from the step it traced, used while the speed model that made them is this one), or, for a record made
before records held them, by another speed model or for a GPU profile it does not name, computed from its
configuration (bench/speed/trace.py `trace_cell`: the step traced on the meta device, nothing retrained) and cached,
in this process and on disk (~/.cache/precision-bench/predictions/), keyed by what the prediction reads: the
configuration's structure (not its seed, learning rate or format), the profile and the speed model (`fingerprint`:
its code, constants and shipped profiles)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path

from omegaconf import OmegaConf

from bench.running.identity import semantic_config, with_shipped_data_here
from bench.speed.profiles import GPU, shipped_gpus

DEFAULT_GPUS = ("H100",)  # the tables' predicted columns, unless `--predict-for` names others
# Optimiser keys that change no op of a step (its values), left out of what a trace is cached by.
VALUES_ONLY = ("lr", "min_lr", "warmup_steps", "schedule", "grad_clip", "momentum", "beta2")


def _cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "precision-bench" / "predictions"


def trace_key(config: dict) -> dict:
    """What a cell's traced step depends on: its model (but the optimiser's values) and scaling method, and what it
    stores beyond the trace (its master weights; the state format is the optimiser's)."""
    semantic = semantic_config(config)
    model = dict(semantic.get("model", {}))
    model["optimizer"] = {k: v for k, v in (model.get("optimizer") or {}).items() if k not in VALUES_ONLY}
    master = (semantic.get("train") or {}).get("master_weights")
    return {"model": model, "scaling": semantic.get("scaling")} | ({"master_weights": master} if master else {})


_TRACES: dict = {}  # trace_key (as JSON) -> its traced step, for this process


def _trace(config: dict):
    from bench.speed.trace import trace_cell

    key = json.dumps(trace_key(config), sort_keys=True, default=str)
    if key not in _TRACES:
        _TRACES[key] = trace_cell(OmegaConf.create(with_shipped_data_here(config)))  # a record made elsewhere
    return _TRACES[key]


def _computed(config: dict, target: GPU) -> dict:
    """One GPU's prediction for a recorded config, from the disk cache or a fresh trace."""
    from bench.speed.model import NoNativePath, fingerprint, predict, recipe_on

    key = json.dumps({"trace": trace_key(config), "format": semantic_config(config).get("format"),
                      "gpu": dataclasses.asdict(target), "model": fingerprint()}, sort_keys=True, default=str)
    path = _cache_dir() / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.json"
    if path.is_file():
        return json.loads(path.read_text())
    cfg = OmegaConf.create(config)
    try:
        trace = _trace(config)
    except Exception as e:  # a model not buildable here (its data, its module): said, not raised
        return {"no_prediction": "its step could not be traced here "
                                 f"({type(e).__name__}: {str(e).splitlines()[0][:120]})"}
    recipe = recipe_on(cfg, trace, target)
    result = {"no_native_path": recipe.why} if isinstance(recipe, NoNativePath) else {
        mode: predict(trace, recipe, target, mode == "compiled").as_dict() for mode in ("compiled", "eager")} | (
        {"note": recipe.note} if recipe.note else {})
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    tmp.replace(path)
    return result


def predicted(record: dict, gpus: tuple[GPU, ...]) -> dict[str, dict]:
    """Per GPU of `gpus`, the record's prediction: its own where it holds one for that profile made by this speed
    model (`predicted_by`), else computed."""
    from bench.speed.model import fingerprint  # (the speed model imports torch._dynamo: seconds, when it is needed)

    own = (record.get("predicted") or {}) if record.get("predicted_by") == fingerprint() else {}
    shipped = shipped_gpus()
    return {g.name: _as_computed(own[g.name]) if g.name in own and shipped.get(g.name) == g
            else _computed(record["config"], g) for g in gpus}


def _as_computed(prediction: dict) -> dict:
    """A record's own prediction in the key order `_computed` writes one (Prediction.as_dict's): an archive stores
    records with sorted keys, and a table regenerated from its records must not change with whether they were
    reused or recomputed (a later speed model recomputes them)."""
    from bench.speed.model import Prediction

    order = list(Prediction(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0).as_dict())
    return {mode: {k: part[k] for k in sorted(part, key=lambda k: order.index(k) if k in order else len(order))}
            if isinstance(part, dict) else part
            for mode, part in sorted(prediction.items(), key=lambda item: item[0] not in ("compiled", "eager"))}
