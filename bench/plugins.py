"""Plug-ins: the modules that declare a user's formats, models and scaling methods, imported by every entry point.

A plug-in is a Python module that registers what it declares when it is imported (bench.formats.register_format,
bench.numerics.scaling_methods.register; a model needs no registry: its yaml names its builder). The suite finds
plug-ins two ways, as pytest and Hydra find theirs:
- the `plugins: [module, ...]` config key (in an experiment's yaml, or `plugins=[my_formats]` on the command line);
- installed packages' entry points in the group `precision_bench.plugins`, e.g. in a pyproject.toml:
  `[project.entry-points."precision_bench.plugins"] my_formats = "my_package.formats"`.

`bench.run` (each cell, and the sweep's check of every cell), `bench.predict`, `bench.aggregate`, `bench.compare` and
the dashboard import them before they read a format, model or scaling method by name; a record names the plug-in
modules its cell imported (`env.plugins`), so the reporting commands import those too.
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points

from bench.errors import ConfigError, first_line, where_raised

ENTRY_POINT_GROUP = "precision_bench.plugins"
_imported: dict[str, str] = {}  # module -> how it was named (config, entry point, record), in import order


def installed() -> dict[str, str]:
    """The modules installed packages declare in the entry-point group, each with its entry point's name."""
    return {ep.value.split(":", 1)[0]: ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)}


def load(modules=(), named_by: str = "plugins") -> list[str]:
    """Import the installed plug-ins and `modules` (idempotent); every plug-in module imported so far, in order.
    ConfigError naming the module, who named it and why it failed, where one cannot be imported."""
    wanted = {module: f"entry point {name!r} ({ENTRY_POINT_GROUP})" for module, name in installed().items()}
    wanted |= {str(module): named_by for module in modules or ()}
    for module, source in wanted.items():
        if module in _imported:
            continue
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name != module and not module.startswith(f"{e.name}."):  # found, but what it imports is missing
                raise ConfigError(f"plug-in module {module!r} (named by {source}) was found, but its own import "
                                  f"failed: {first_line(e)}") from None
            raise ConfigError(f"plug-in module {module!r} (named by {source}) cannot be imported: {first_line(e)}; "
                              "a plug-in must be importable (on PYTHONPATH, or installed): docs/extending.md") from None
        except Exception as e:  # the module's own error while it runs and registers
            raise ConfigError(f"plug-in module {module!r} (named by {source}) was found, but its own import failed"
                              f"{where_raised(e)}: {first_line(e)}") from None
        _imported[module] = source
    return list(_imported)


def imported() -> list[str]:
    """The plug-in modules imported in this process, in order."""
    return list(_imported)
