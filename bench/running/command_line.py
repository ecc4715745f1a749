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


def _shadowed(paths: list[Path]) -> list[str]:
    """Each yaml of a search-path directory that an earlier directory has at the same place (conf/ first): Hydra
    reads the first it finds, so the later one, a user's `format/fp8.yaml` say, would never be read."""
    seen, said = {}, []
    for path in dict.fromkeys(p.resolve() for p in paths):  # a directory named twice shadows nothing
        for yaml in sorted(path.rglob("*.yaml")) if path.is_dir() else ():
            where = yaml.relative_to(path)
            if where in seen:
                said.append(f"{yaml} is never read: Hydra takes {seen[where] / where} first (conf/ comes first on "
                            f"the search path); give yours another name, e.g. {where.parent}/my_{where.name}")
            else:
                seen[where] = path
    return said


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
    """Raise ConfigError for a yaml of `hydra.searchpath` that conf/ shadows, an option no config group has, or a key
    (without `+`) the config does not have: every such value of the command line in one message (a sweep's two
    typos, named at once)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        overrides = OverridesParser.create().parse_overrides([a for a in args if not a.startswith("-")])
    except Exception:  # a syntax error: Hydra says where
        return
    paths = _search_path(overrides)
    if len(paths) > 1 and (shadowed := _shadowed(paths)):  # conf/ alone shadows nothing
        raise ConfigError("; ".join(shadowed))
    keys, groups, refused, swept = [], [], [], {}
    for o in overrides:
        key = o.key_or_group
        if key.startswith("hydra") or o.is_delete():
            continue
        options, values = _options(key, paths), _values(o)
        if key == "results_dir":  # Hydra makes the run's log directory under it before any check of ours
            for value in values or []:
                check_results_dir("" if value == "None" else value)
        if options is not None:
            refused += [f"{key}={value} is not an option; valid: {', '.join(options)}{suggestion(value, options)}"
                        for value in values or [] if value not in options]
            if values:
                groups.append(f"{key}={values[0]}")
                swept[key] = values
        elif not (o.is_add() or o.is_force_add()):
            keys.append(key)  # `+key=value` adds past the schema: config.check names it (unknown_keys)
    if refused:
        raise ConfigError("; ".join(refused))
    if not keys:
        return
    searchpath = [a for a in args if a.startswith("hydra.searchpath=")]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        try:
            cfg = compose("config", overrides=groups + searchpath)
        except Exception as e:  # a typo in one of the yamls: said as check_yaml_files says it
            if (translated := composition_error(e)) is None:
                raise
            raise translated from None
        if unknown := [key for key in keys if not _has_key(cfg, key)]:
            said = [_method_option(key, swept.get("scaling", []), groups + searchpath, compose)
                    or f"unknown config key {key}{_near_key(cfg, key)}" for key in unknown]
            raise ConfigError(f"{'; '.join(said)}; every key is documented in conf/README.md")


def _method_option(key: str, methods: list[str], overrides: list[str], compose) -> str | None:
    """Where `key` is an option (scaling.options.*) of some of a sweep's scaling methods but not of its first (which
    the check composes): which have it, and that a method's options go with it alone (None otherwise)."""
    if not key.startswith("scaling.options.") or len(methods) < 2:
        return None
    others = [o for o in overrides if not o.startswith("scaling=")]
    having = [m for m in methods[1:] if _has_key(compose("config", overrides=[*others, f"scaling={m}"]), key)]
    return (f"{key} is an option of scaling={', '.join(having)} alone, and this sweep also has scaling="
            f"{', '.join(m for m in methods if m not in having)}: sweep them apart (a method's options go with it)"
            if having else None)


def composition_error(error: Exception) -> ConfigError | None:
    """Hydra's error composing a yaml the suite reads (a model, optimizer, format, scaling or experiment yaml, or an
    override), as a ConfigError saying what the command line says of a typo: the file, the key, the valid keys and
    the nearest one. None where the error is not of that kind."""
    import dataclasses
    import re

    from omegaconf.errors import ConfigKeyError, ValidationError

    cause = error
    while cause is not None and not isinstance(cause, (ConfigKeyError, ValidationError)):
        cause = cause.__cause__ or cause.__context__
    if cause is None or not getattr(cause, "full_key", None):
        return None
    where = re.match(r"In '([^']+)'", str(error))
    source = f"{where.group(1)}.yaml" if where else "the command line"
    prefix = cause.full_key.rsplit(".", 1)[0] + "." if "." in cause.full_key else ""
    if isinstance(cause, ConfigKeyError):
        schema = cause.object_type
        if dataclasses.is_dataclass(schema):
            known = [f.name for f in dataclasses.fields(schema)]
        else:  # a free-form node (a user's scaling.options, as its yaml set it): the keys it has
            known = [str(k) for k in cause.parent_node.keys()] if cause.parent_node is not None else []
        return ConfigError(f"{source}: unknown key {cause.full_key}{suggestion(str(cause.key), known, prefix=prefix)};"
                           f" valid keys there: {', '.join(known)} (every key is documented in conf/README.md)")
    return ConfigError(f"{source}: {cause.full_key}: {str(cause.msg).splitlines()[0]}")


def check_yaml_files(args: list[str]):
    """Compose the config as the command asks, and once more for every option of a swept config group (each option's
    yaml), so that a typo in any yaml is a ConfigError (exit 2) here, not Hydra's traceback later. Sweeps over keys
    compose their first value; an experiment's own sweep params are composed by the sweeper (the same check).
    Returns the config as the command asks (a sweep's: with the first value of each swept key), or None where Hydra
    alone can compose it (a sweep function, a syntax error, another composition problem)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        overrides = OverridesParser.create().parse_overrides([a for a in args if not a.startswith("-")])
    except Exception:  # a syntax error: Hydra says where
        return None
    paths = _search_path(overrides)
    base, per_option = [], []
    for o in overrides:
        values = _values(o)
        if o.key_or_group.startswith("hydra"):
            base.append(o.input_line) if o.key_or_group == "hydra.searchpath" else None
        elif values is None:
            return None  # a sweep function: Hydra's to expand
        elif o.value_type.name == "ELEMENT":
            base.append(o.input_line)
        else:
            prefix = "+" if o.is_add() else ""
            base.append(f"{prefix}{o.key_or_group}={values[0]}")
            if _options(o.key_or_group, paths) is not None:
                per_option += [f"{prefix}{o.key_or_group}={v}" for v in values[1:]]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        composed = []
        for extra in [None, *per_option]:
            try:
                composed.append(compose("config", overrides=base + ([extra] if extra else [])))
            except Exception as e:
                if (translated := composition_error(e)) is not None:
                    raise translated from None
                return None  # another composition problem: Hydra reports it as it always has
    return composed[0]
