"""The package's shape: concerns in their own folders, no two modules importing each other, and the entry points
users type where they have always been."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
LAYERS = ("numerics", "speed", "running", "reporting", "tools")


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


# The layers, bottom up, each with the layers it may import: errors; plugins (importing a user's modules); numerics
# (what a format does to numbers) and data (what is shipped, the hub), apart; tasks (models and their data); speed
# (the speed model: the tracer and its pricing); running; reporting; tools (commands that measure or check); and the
# entry points at the top of the package (bench/run.py, bench/aggregate.py, ...).
MAY_IMPORT = {"errors": set(), "plugins": {"errors"}, "numerics": {"errors"}, "data": {"errors"},
              "tasks": {"errors", "numerics", "data"},
              "speed": {"errors", "numerics", "data", "tasks"},
              "running": {"errors", "plugins", "numerics", "data", "tasks", "speed"},
              "reporting": {"errors", "plugins", "numerics", "data", "tasks", "speed", "running"},
              "tools": {"errors", "plugins", "numerics", "data", "tasks", "speed", "running", "reporting"}}


def _layer(module: str) -> str:
    """`bench.<layer>...`; bench itself and the modules at the package's top are the entry layer."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and (len(parts) > 2 or parts[1] in MAY_IMPORT) else "entry"


def test_every_layer_imports_only_the_layers_below_it():
    """For every pair of layers, the upper may import the lower and never the other way (tasks never import
    running: a model is built without the runner; nothing but an entry point imports a tool or an entry point)."""
    wrong = [f"{name} imports {dep}" for name, deps in _imports().items() for dep in deps
             if dep != "bench" and _layer(name) != "entry" and _layer(dep) != _layer(name)  # (bench: its version)
             and _layer(dep) not in MAY_IMPORT[_layer(name)]]
    assert wrong == []
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


def test_no_module_changes_an_objects_class():
    """Module swaps go through bench/numerics/swap.py (a new object holding the old one's state), never by assigning
    `__class__`, which hides a class change from everything that saw the object before."""
    assigning = [f"{path.relative_to(BENCH.parent)}:{node.lineno}" for path in BENCH.rglob("*.py")
                 for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, (ast.Assign, ast.AugAssign))
                 for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
                 if isinstance(target, ast.Attribute) and target.attr == "__class__"]
    assert assigning == []


def test_bench_lists_no_model_by_name():
    """Each model is declared once, in its yaml (model.task)."""
    from omegaconf import OmegaConf

    names = {OmegaConf.load(p).get("name") for p in (BENCH.parent / "conf" / "model").glob("*.yaml")} - {None}
    assert {"lenet", "charlm", "distilbert", "bert_base"} <= names and _lists_naming(names) == []


def test_bench_lists_no_format_by_name_outside_the_registry():
    """Each format is declared once, in bench/numerics/specs.py; besides it only the element formats' own table
    (formats.py: fp32 and bf16 are element formats too), the speed model's bytes and peaks per element type, and the
    storage types of the optimiser's moments and of master weights (declared once each, in their homes) name them."""
    from bench.numerics import specs

    names = set(specs.FORMAT_SPECS) | set(specs.settings_in_order())
    skip = {BENCH / "numerics" / "specs.py", BENCH / "numerics" / "formats.py", BENCH / "speed" / "model.py",
            BENCH / "speed" / "gemm.py", BENCH / "tasks" / "optimizer.py", BENCH / "numerics" / "master_weights.py"}
    assert _lists_naming(names, skip) == []


def _decides_by_scaling_name(node: ast.AST, names: set[str]) -> bool:
    """A comparison of a scaling method's name (`cfg.scaling.name`, `row["scaling"]`, a variable `scaling`) with one
    of `names`, or with a literal collection of them: an if-chain on a scaling method outside its declaration."""
    if not isinstance(node, ast.Compare):
        return False

    def is_scaling(expr) -> bool:
        if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Name) and expr.func.id == "str" and expr.args:
            expr = expr.args[0]
        return (isinstance(expr, ast.Attribute) and (expr.attr == "scaling" or (
                    expr.attr == "name" and isinstance(expr.value, ast.Attribute) and expr.value.attr == "scaling")))\
            or (isinstance(expr, ast.Subscript) and isinstance(expr.slice, ast.Constant)
                and expr.slice.value == "scaling")\
            or (isinstance(expr, ast.Name) and expr.id == "scaling")

    def strings(expr) -> set[str]:
        items = expr.elts if isinstance(expr, (ast.Tuple, ast.List, ast.Set)) else [expr]
        return {i.value for i in items if isinstance(i, ast.Constant) and isinstance(i.value, str)}

    sides = [node.left, *node.comparators]
    return any(is_scaling(s) for s in sides) and any(strings(s) & names for s in sides)


def test_bench_names_no_scaling_method_outside_its_declaration():
    """Each scaling method is declared once, in bench/numerics/scaling_methods.py (its class, its name, what it asks
    of the precision plan, its transform, its loss scaler); nothing else in bench/ lists scaling methods or decides
    by one's name. bench/numerics/scaling.py's loss scalers speak of their own kinds (none, static, dynamic), and
    tools/ pick what to measure."""
    from bench.numerics.scaling_methods import SCALING_METHODS

    names = set(SCALING_METHODS)
    home = {BENCH / "numerics" / "scaling_methods.py", BENCH / "numerics" / "scaling.py"}
    deciding = []
    for path in BENCH.rglob("*.py"):
        if path.parent.name == "tools" or path in home:
            continue
        deciding += [f"{path.relative_to(BENCH)}:{node.lineno}" for node in ast.walk(ast.parse(path.read_text()))
                     if _decides_by_scaling_name(node, names)]
    assert _lists_naming(names, home) == [] and deciding == []
    assert {"none", "static", "dynamic", "per_tensor", "unit", "umup", "rowwise", "rowwise_with_gw_hp", "block"} \
        <= names  # the shipped methods, from their one home


# seconds of imports a refusal must not wait for (torch.distributed.tensor, with sympy: 0.8 s of bench.run's 2.6)
HEAVY = ("torch._dynamo", "torchao", "scipy.stats", "matplotlib", "torch.distributed.tensor")


@pytest.mark.parametrize("command, argv", [("bench.run", ["format=fp33"]), ("bench.predict", ["format=fp33"]),
                                           ("bench.aggregate", ["/nonexistent"])])
def test_a_refused_command_imports_nothing_heavy_before_it_refuses(command, argv):
    """A typo is refused before the speed model (torch._dynamo), torchao, scipy.stats, matplotlib or DTensor
    (bench.numerics.dtensors) is imported: a refusal costs about an `import torch` (make bench does not time it;
    these imports are what made it 2x)."""
    script = ("import runpy, sys\nsys.argv = [%r, *%r]\ntry:\n    runpy.run_module(%r, run_name='__main__')\n"
              "except SystemExit as e:\n    code = e.code\nprint(code, [m for m in %r if m in sys.modules])"
              % (command, argv, command, HEAVY))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=BENCH.parent, timeout=120)
    assert done.stdout.strip().splitlines()[-1] == "2 []", done.stdout + done.stderr
