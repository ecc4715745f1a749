"""A run's identity, in one home: where its record goes (`cell_path`), what it is (`run_id`), and the ids that
aggregation pairs runs by (`comparison_ids`). Each word has one meaning:

- a *run* is one configuration and seed; its `run_id` hashes the config's semantic part (`semantic_config`: what
  changes what the run computes), so a sweep resumed elsewhere or records of two checkouts find the same runs;
- a *cell* is a run's place under results_dir, `<experiment>/<model>/<format>-<mode>/<scaling>/seed<k>`, then
  its *overrides*: every other semantic key set on the command line or by a sweep, `,key=value` (`cell_path`);
- aggregation groups runs over seeds by `config_id` (the configuration without its seed), finds a configuration's
  32-true baseline by `baseline_id` (without seed and format) and a format x scaling layout's columns by
  `design_id` (without seed, format, scaling and NUMERIC_CHOICES). A table's *variant*
  (bench/reporting/aggregate.py) is what a cell does differently from its experiment's usual runs, for the reader.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from typing import Sequence

from omegaconf import DictConfig, ListConfig, OmegaConf

from bench.data import DATA_DIR
from bench.numerics.plan import FORMAT_DEFAULTS
from bench.numerics.unit import POST_NORM_TAU

# Config keys that do not change what a run computes: they never enter its identity.
NON_SEMANTIC = ("results_dir", "cell", "logger", "retry_failed", "fail_fast", "device", "plugins")
NON_SEMANTIC_TRAIN = ("log_every", "checkpoint_every", "keep_checkpoint")
NON_SEMANTIC_MODEL = ("task",)  # the model's declaration (bench/tasks/base.py TaskSpec): how to read it, not what runs
NON_SEMANTIC_SCALING = ("_target_",)  # the class that runs the method its name (in the identity) names
# Keys whose named default means what null means (and what runs made before the key existed did), per section.
# Tuples, not sets: a value may be a list (format.keep_high_precision), which `in` then compares without hashing.
SPELLINGS_OF_NULL = {"train": (("compile", "auto"), ("eval_precision", "trained"), ("master_weights", "fp32")),
                     "scaling": (("post_norm_tau", POST_NORM_TAU),),
                     "format": (("elsewhere", "fp32"), *((key, FORMAT_DEFAULTS[key]) for key in
                                                         ("rht", "weight_blocks", "pad_weights", "scale_rule",
                                                          "accumulation")),
                                ("keep_high_precision", [])),
                     "model": (("optimizer.state_format", "fp32"),),
                     "parallel": (("name", "none"), ("world_size", 1), ("param_dtype", "fp32"),
                                  ("reduce_dtype", "fp32"), ("gradient_compression", "none"),
                                  ("fp8_all_gather", False))}


def _identity_form(value):
    """`value` as a run's identity sees it: shipped data by name, unset options left out.

    - A path to a file shipped in bench/data, of this checkout or any other, becomes `bench_data:<relative path>`.
      Configs hold such paths resolved (`${bench_data:vocab.txt}`), and a run's identity must not depend on where
      the repository was cloned: a sweep resumed from another checkout, or records of two checkouts aggregated
      together, are the same runs.
    - A key whose value is null is left out, as if absent: null means "unset" throughout the config, so a new
      option added with a null default leaves the identity of every run made before it unchanged (their records
      resume and pair with new ones)."""
    if isinstance(value, dict):
        return {k: _identity_form(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_identity_form(v) for v in value]
    if (relative := _shipped(value)) is not None:
        return f"bench_data:{relative}"
    return value


def _shipped(value) -> str | None:
    """A file shipped in bench/data that `value` names, in this checkout or any other: its path there."""
    if isinstance(value, str) and f"{os.sep}bench{os.sep}data{os.sep}" in value:
        relative = value.rsplit(f"{os.sep}bench{os.sep}data{os.sep}", 1)[1]
        if (DATA_DIR / relative).is_file():
            return relative
    return None


def with_shipped_data_here(value):
    """`value` (a config, or any part of one) with each path to a file shipped in bench/data, of whichever checkout
    made it, pointing into this checkout's: a record made elsewhere, traced here, reads the same files."""
    if isinstance(value, dict):
        return {k: with_shipped_data_here(v) for k, v in value.items()}
    if isinstance(value, list):
        return [with_shipped_data_here(v) for v in value]
    relative = _shipped(value)
    return str(DATA_DIR / relative) if relative is not None else value


def semantic_config(config: dict) -> dict:
    """The part of a config that changes what a run computes (not output paths, logging or checkpoint knobs), in
    its identity form (`_identity_form`)."""
    semantic = _identity_form({k: v for k, v in config.items() if k not in NON_SEMANTIC})
    if "train" in semantic:
        semantic["train"] = {k: v for k, v in semantic["train"].items() if k not in NON_SEMANTIC_TRAIN}
    for section, spellings in SPELLINGS_OF_NULL.items():
        if isinstance(semantic.get(section), dict):
            semantic[section] = _without_null_spellings(semantic[section], spellings)
    if semantic.get("parallel") == {}:
        del semantic["parallel"]  # one device, as every run made before the section existed
    if isinstance(semantic.get("model"), dict):
        semantic["model"] = {k: v for k, v in semantic["model"].items() if k not in NON_SEMANTIC_MODEL}
    if isinstance(semantic.get("scaling"), dict):
        semantic["scaling"] = {k: v for k, v in semantic["scaling"].items() if k not in NON_SEMANTIC_SCALING}
    return semantic


def _without_null_spellings(section: dict, spellings: tuple, prefix: str = "") -> dict:
    """`section` less the keys (dotted below it: `optimizer.state_format`) whose value spells null."""
    return {k: _without_null_spellings(v, spellings, f"{prefix}{k}.") if isinstance(v, dict) else v
            for k, v in section.items() if (f"{prefix}{k}", v) not in spellings}


def config_hash(config: dict) -> str:
    return hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:16]


def run_id(config: dict) -> str:
    """A run's identity: a hash of its semantic config."""
    return config_hash(semantic_config(config))


# Keys a cell's path already spells out; with the non-semantic keys, never among its overrides.
PATH_KEYS = ("experiment_name", "seed", "format.name", "format.mode")
# Keys spelt among a cell's overrides whenever set (not null nor a spelling of it), from a yaml default too: a
# default that changed what runs (fp8 and the block formats went from FP32 to BF16 elsewhere in 0.2.0) must not
# put its new runs where the records of the old default are.
# So are NVIDIA's NVFP4 switches: format=nvfp4_recipe turns them on in its yaml, and `format.rht=false` (a spelling of
# null, so absent from the path as an override) must not put "the recipe less RHT" where the whole recipe's runs are.
ALWAYS_IN_PATH = ("format.elsewhere", "format.rht", "format.rht_seed", "format.weight_blocks", "format.pad_weights",
                  "format.keep_high_precision", "format.scale_rule", "format.sr_bits", "format.accumulation",
                  *(f"parallel.{key}" for key, _ in SPELLINGS_OF_NULL["parallel"]))  # a group the path does not spell
OVERRIDES_MAX = 120  # characters of `key=value,...` before a path's overrides are shortened to keys and a hash


def spells_null(key: str, value) -> bool:
    """Whether dotted `key` at `value` means what null means (SPELLINGS_OF_NULL)."""
    section, _, name = key.partition(".")
    return (name, value) in SPELLINGS_OF_NULL.get(section, ())


def cell_path(cfg: DictConfig, choices: dict | None = None, overrides: Sequence[str] = ()) -> str:
    """Where a cell's record goes under results_dir:
    `<experiment>/<model option>/<format>-<mode>/<scaling option>/seed<k>[,<key>=<value>,...]`.

    The options are the config-group choices as typed (`bert_tiny`, `mindspore_fixed`), falling back to
    the config's names where Hydra's choices are not at hand. Every other semantic key overridden on the
    command line or by a sweep (`format.backend=native`, `model.optimizer.lr=1e-3`) is appended with its
    resolved value, sorted, as Hydra's override_dirname does: each swept value gets its own directory; so is
    every key of ALWAYS_IN_PATH that is set.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser

    choices = choices or {}
    excluded = set(PATH_KEYS) | set(NON_SEMANTIC) | {f"train.{k}" for k in NON_SEMANTIC_TRAIN}
    excluded_trees = {*NON_SEMANTIC, *(f"model.{k}" for k in NON_SEMANTIC_MODEL)}
    overridden = {}
    for override in OverridesParser.create().parse_overrides(list(overrides)):
        key = override.key_or_group
        if key in choices or key in excluded or override.is_delete() \
                or any(key == tree or key.startswith(tree + ".") for tree in excluded_trees):
            continue  # a group (spelled out by the path) or a key that does not change what the run computes
        value = OmegaConf.select(cfg, key, default=None)
        if spells_null(key, value):
            continue  # the same run as null, so the same place (`train.compile=auto`, `format.elsewhere=fp32`)
        overridden[key] = OmegaConf.to_container(value, resolve=True) if isinstance(value, (DictConfig, ListConfig)) \
            else value
    for key in ALWAYS_IN_PATH:
        value = OmegaConf.select(cfg, key, default=None)
        if value is not None and not spells_null(key, value):
            overridden[key] = OmegaConf.to_container(value, resolve=True) if isinstance(value, ListConfig) else value
    path = (f"{cfg.experiment_name}/{choices.get('model', cfg.model.name)}"
            f"/{cfg.format.name}-{str(cfg.format.mode).lower()}/{choices.get('scaling', cfg.scaling.name)}"
            f"/seed{cfg.seed}")
    if not overridden:
        return path
    text = ",".join(f"{k}={json.dumps(v) if isinstance(v, (dict, list)) else v}" for k, v in sorted(overridden.items()))
    text = text.replace("/", "%2F").replace(" ", "")
    if len(text) > OVERRIDES_MAX:
        text = ",".join(sorted(overridden)) + ",hash=" + hashlib.sha256(text.encode()).hexdigest()[:8]
    return f"{path},{text}"


def overridden_keys(cell: str) -> set[str]:
    """The keys a cell's place names after its seed (`cell_path`: each `key=value`, or past OVERRIDES_MAX the keys
    alone): what its command line set, and the ALWAYS_IN_PATH keys it sets."""
    _, _, named = cell.rpartition("/")[2].partition(",")
    return set(re.findall(r"(?:^|,)([A-Za-z_][\w.]*)(?=[=,]|$)", named)) - {"hash"}


# Numeric choices outside the format: like the format and the scaling method, columns of a design, not designs
# (a distributed cell's parallel keys too: the precision of its communication is one more numeric choice)
NUMERIC_CHOICES = ("model.optimizer.state_format", "train.master_weights",
                   *(f"parallel.{key}" for key, _ in SPELLINGS_OF_NULL["parallel"]))


def _without(config: dict, dotted: str) -> dict:
    head, _, rest = dotted.partition(".")
    if head not in config:
        return config
    if not rest:
        return {k: v for k, v in config.items() if k != head}
    inner = config[head]
    return config | {head: _without(inner, rest)} if isinstance(inner, dict) else config


def comparison_ids(semantic: dict) -> dict[str, str]:
    """The ids aggregation pairs a run by, from its semantic config (with the device it ran on). A design's columns
    are its numeric choices: the format, the scaling method and NUMERIC_CHOICES."""
    design = {k: v for k, v in semantic.items() if k not in ("seed", "format", "scaling")}
    for dotted in NUMERIC_CHOICES:
        design = _without(design, dotted)
    if design.get("parallel") == {}:  # a section of numeric choices only
        del design["parallel"]
    return {"config_id": config_hash({k: v for k, v in semantic.items() if k != "seed"}),
            "baseline_id": config_hash({k: v for k, v in semantic.items() if k not in ("seed", "format")}),
            "design_id": config_hash(design)}
