"""The command line's overrides, checked before Hydra composes them.

Hydra refuses an unknown option (`format=fp9`) or key (`train.max_stesp=5`) itself, with exit code 1 and, for a
key, advice that adds it (`+train.max_stesp=5`), which the schema then refuses anyway. Every other bad input
exits 2 with the valid choices (bench/running/config.py); so these are checked first, the same way: exit 2,
the valid options, and the nearest one as a suggestion. What Hydra alone can judge (sweep functions such as
`glob(...)`, the syntax itself, `hydra.*` keys) is left to it.
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

from bench.errors import ConfigError, suggestion
from bench.running.config import CONF_DIR, check_results_dir


def _search_path(overrides) -> list[Path]:
    """conf/ and every local directory added with `hydra.searchpath=[file://...]`."""
    paths = [CONF_DIR]
    for o in overrides:
        if o.key_or_group == "hydra.searchpath":
            paths += [Path(str(p).removeprefix("file://")) for p in (o.value() or []) if str(p).startswith("file://")]
    return paths


def _options(group: str, paths: list[Path]) -> list[str] | None:
    """The options of a config group across the search path (None: not a group)."""
    folders = [p / group for p in paths if (p / group).is_dir()]
    return sorted({f.stem for folder in folders for f in folder.glob("*.yaml")}) if folders else None


def _values(override) -> list[str] | None:
    """The values an override sets: one, or each of a comma-separated sweep (None: a sweep function, Hydra's)."""
    from hydra.core.override_parser.types import ValueType

    if override.value_type == ValueType.ELEMENT:
        return [str(override.value())]
    if override.value_type == ValueType.SIMPLE_CHOICE_SWEEP:
        return [str(v) for v in override.value().list]
    return None


def _has_key(cfg: DictConfig, key: str) -> bool:
    node = cfg
    for part in key.split("."):
        if not isinstance(node, DictConfig) or part not in node:
            return False
        node = node._get_node(part)
    return True


def _near_key(cfg: DictConfig, key: str) -> str:
    """The declared key nearest to `key`, among the keys of the deepest node that exists on its path."""
    node, prefix = cfg, ""
    for part in key.split(".")[:-1]:
        if not isinstance(node, DictConfig) or part not in node:
            break
        node, prefix = node._get_node(part), f"{prefix}{part}."
    known = [f"{prefix}{k}" for k in node.keys()] if isinstance(node, DictConfig) else []
    return suggestion(key, known)


def check_command_line(args: list[str]) -> None:
    """Raise ConfigError for an option no config group has, or a key (without `+`) the config does not have."""
    from hydra import compose, initialize_config_dir
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        overrides = OverridesParser.create().parse_overrides([a for a in args if not a.startswith("-")])
    except Exception:  # a syntax error: Hydra says where
        return
    paths = _search_path(overrides)
    keys, groups = [], []
    for o in overrides:
        key = o.key_or_group
        if key.startswith("hydra") or o.is_delete():
            continue
        options, values = _options(key, paths), _values(o)
        if key == "results_dir":  # Hydra makes the run's log directory under it before any check of ours
            for value in values or []:
                check_results_dir("" if value == "None" else value)
        if options is not None:
            for value in values or []:
                if value not in options:
                    raise ConfigError(f"{key}={value} is not an option; valid: {', '.join(options)}"
                                      f"{suggestion(value, options)}")
            if values:
                groups.append(f"{key}={values[0]}")
        elif not (o.is_add() or o.is_force_add()):
            keys.append(key)  # `+key=value` adds past the schema: config.check names it (unknown_keys)
    if not keys:
        return
    searchpath = [a for a in args if a.startswith("hydra.searchpath=")]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=groups + searchpath)
    for key in keys:
        if not _has_key(cfg, key):
            raise ConfigError(f"unknown config key {key}{_near_key(cfg, key)}; every key is documented in "
                              "conf/README.md")
