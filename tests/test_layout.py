"""The package's shape: concerns in their own folders, no two modules importing each other, and the entry points
users type where they have always been."""

import ast
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"
LAYERS = ("numerics", "running", "reporting", "tools")


def _module(path: Path) -> str:
    parts = path.relative_to(BENCH.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, set[str]]:
    """bench module -> the bench modules it imports (at any depth of the file)."""
    modules = {_module(p): p for p in BENCH.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("bench"):
                found |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                          for a in node.names}
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names if a.name.startswith("bench")}
        graph[name] = found - {name}
    return graph


def test_no_two_modules_import_each_other():
    graph = _imports()
    mutual = sorted({tuple(sorted((a, b))) for a, deps in graph.items() for b in deps if a in graph.get(b, ())})
    assert not mutual


# The layers, bottom up: errors; numerics (what a format does to numbers) and data (what is shipped, the hub); tasks
# (models and their data); then running, reporting and tools.
def test_layers_import_only_the_layers_below_them_and_tools_are_imported_by_nothing():
    """No lower layer imports an upper one (tasks never import running: a model is built without the runner);
    no library module imports a tool."""
    graph = _imports()
    below = {"errors": set(), "numerics": {"errors"}, "data": {"errors"}, "tasks": {"errors", "numerics", "data"}}
    for name, deps in graph.items():
        layer = name.split(".")[1] if "." in name else None
        if layer in below:
            assert not [d for d in deps if d.split(".")[1] not in below[layer] | {layer}], name
        if not name.startswith("bench.tools"):
            assert not [d for d in deps if d.startswith("bench.tools")], name
    assert all((BENCH / layer / "__init__.py").is_file() for layer in LAYERS)


def test_the_entry_points_users_type_are_where_they_were():
    import bench.aggregate
    import bench.formats
    import bench.run
    from bench.numerics import formats
    from bench.reporting import report
    from bench.running import run

    assert bench.run.main is run.main and bench.aggregate.main is report.main
    assert bench.formats.quantise is formats.quantise


def _lists_naming(names: set[str], skip: set[Path] = frozenset()) -> list[str]:
    """Every tuple, list, set or dict literal in bench/ (but tools/, which pick what to measure, and `skip`) that
    names two or more of `names`: a registry written outside its one home."""
    found = []
    for path in BENCH.rglob("*.py"):
        if path.parent.name == "tools" or path in skip:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            items = node.keys if isinstance(node, ast.Dict) else getattr(node, "elts", None) \
                if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else None
            strings = {i.value for i in items or [] if isinstance(i, ast.Constant) and isinstance(i.value, str)}
            if len(strings & names) >= 2:
                found.append(f"{path.relative_to(BENCH)}:{node.lineno}: {sorted(strings & names)}")
    return found


def test_bench_lists_no_model_by_name():
    """Each model is declared once, in its yaml (model.task)."""
    from omegaconf import OmegaConf

    names = {OmegaConf.load(p).get("name") for p in (BENCH.parent / "conf" / "model").glob("*.yaml")} - {None}
    assert {"lenet", "charlm", "distilbert", "bert_base"} <= names and _lists_naming(names) == []


def test_bench_lists_no_format_by_name_outside_the_registry():
    """Each format is declared once, in bench/numerics/specs.py; besides it only the element formats' own table
    (formats.py: fp32 and bf16 are element formats too) and the speed model's bytes and peaks per element type name
    them."""
    from bench.numerics import specs

    names = set(specs.FORMAT_SPECS) | set(specs.settings_in_order())
    skip = {BENCH / "numerics" / "specs.py", BENCH / "numerics" / "formats.py", BENCH / "running" / "speed.py"}
    assert _lists_naming(names, skip) == []
