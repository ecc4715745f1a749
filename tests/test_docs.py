"""Docs are code: every path, make target and `python -m` module the README, docs/ and the config and results
references name exists, every relative link resolves, and the README stays short enough to stay true."""

import functools
import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "conf" / "README.md", ROOT / "results" / "README.md",
        *sorted((ROOT / "docs").glob("*.md"))]
TOP = ("bench/", "conf/", "results/", "tests/", "docs/", "hydra_plugins/", ".ci/")
TARGETS = set(re.findall(r"^([a-z][a-z-]*):", (ROOT / "Makefile").read_text(), re.M))


def _named_paths(text: str) -> set[str]:
    """Repository paths in backticks or bare, cut at the first character a path here never has."""
    found = set()
    for token in re.findall(r"(?<![\w./-])((?:bench|conf|results|tests|docs|hydra_plugins|\.ci)/[\w./-]*)", text):
        token = token.rstrip(".,:;")
        if token.endswith("/"):
            token = token[:-1]
        found.add(token)
    return found


def _placeholder(path: str, text: str) -> bool:
    """A path written as a pattern (`results/tables/<experiment>/`, `bench.tools.<name>`) or under a folder that
    runs create (results/runs, results/local)."""
    return path.startswith(("results/runs", "results/local")) or f"{path}<" in text or f"{path}/<" in text


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_path_the_docs_name_exists(doc):
    text = doc.read_text()
    missing = sorted(p for p in _named_paths(text) if not (ROOT / p).exists() and not _placeholder(p, text))
    assert missing == []


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(doc):
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text())
    missing = [link for link in links if not link.startswith(("http://", "https://"))
               and not (doc.parent / link).exists()]
    assert missing == []


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_make_target_and_module_the_docs_name_exists(doc):
    text = doc.read_text()
    targets = set(re.findall(r"`make ([a-z][a-z-]*)", text)) | set(re.findall(r"^make ([a-z][a-z-]*)", text, re.M))
    assert sorted(targets - TARGETS) == []
    modules = {m.rstrip(".") for m in re.findall(r"python -m ([\w.]+)", text)} - {"pytest", "pip", "venv"}
    assert sorted(m for m in modules if importlib.util.find_spec(m) is None) == []


def test_the_readme_is_short_and_links_every_docs_page():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    assert [p.name for p in sorted((ROOT / "docs").glob("*.md")) if f"docs/{p.name}" not in readme] == []


def test_every_config_key_is_documented_in_conf_readme():
    """Every field of every schema (bench/running/config.py, and the model declaration TaskSpec) is named in
    backticks in conf/README.md, as the README promises."""
    import dataclasses

    from bench.running import config
    from bench.tasks.base import TaskSpec

    text = (ROOT / "conf" / "README.md").read_text()
    documented = set(re.findall(r"\w+", " ".join(re.findall(r"`([^`]*)`", text))))
    schemas = [TaskSpec, *(v for v in vars(config).values()
                           if dataclasses.is_dataclass(v) and v.__module__ == config.__name__)]
    missing = [f"{s.__name__}.{f.name}" for s in schemas for f in dataclasses.fields(s) if f.name not in documented]
    assert len(schemas) > 10 and missing == []


def test_one_version_named_by_the_package_the_changelog_and_the_citation():
    import bench

    citation = (ROOT / "CITATION.cff").read_text()
    assert f"\nversion: {bench.__version__}\n" in citation and "license: Apache-2.0" in citation
    assert f"\n## {bench.__version__} (" in (ROOT / "CHANGELOG.md").read_text()
    assert "Apache License" in (ROOT / "LICENSE").read_text() and 'attr = "bench.__version__"' in \
        (ROOT / "pyproject.toml").read_text()


def _markdown_rows(text: str) -> list[dict]:
    """The rows of every pipe table in `text`, as {header: cell}."""
    rows, header = [], None
    for line in text.splitlines():
        if not line.startswith("|"):
            header = None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if header is None:
            header = cells
        elif not set("".join(cells)) <= set(":- "):
            rows.append(dict(zip(header, cells)))
    return rows


@pytest.mark.parametrize("doc, table, count", [("README.md", "precision", 5), ("docs/results.md", "precision", 5),
                                               ("docs/results.md", "scaling_grid", 6)])
def test_the_default_tables_the_docs_quote_are_the_committed_ones(doc, table, count):
    """Every cell of the LeNet rows a doc quotes from results/tables/default/<table>.md is that table's, so a remake or
    a changed column cannot leave the docs telling older figures."""
    key = "scaling" if table == "precision" else "metric"
    committed = {(r["setting"], r[key]): r
                 for r in _markdown_rows((ROOT / "results" / "tables" / "default" / f"{table}.md").read_text())}
    quoted = [r for r in _markdown_rows((ROOT / doc).read_text())
              if r.get("model") == "lenet (digits)" and key in r and ("train time (s)" in r) == (table == "precision")]
    assert len(quoted) == count
    for row in quoted:
        assert row == {k: committed[(row["setting"], row[key])][k] for k in row}, row["setting"]


def test_the_readme_names_every_option_of_every_config_group():
    """The README's "Config groups:" paragraph lists each group's options (a newcomer found three models, umup and
    the parallel group missing, 2026-11-30)."""
    readme = (ROOT / "README.md").read_text()
    paragraph = readme[readme.index("Config groups:"):].split("\n\n")[0]
    listed = {group: set(re.findall(r"[\w-]+", options))
              for group, options in re.findall(r"`(\w+)`\s+\(([^`]*?)\)(?:,|\.)", paragraph)}
    groups = ("model", "format", "scaling", "parallel", "logger")
    missing = {g: sorted(p.stem for p in (ROOT / "conf" / g).glob("*.yaml") if p.stem not in listed.get(g, set()))
               for g in groups}
    assert set(groups) <= set(listed) and not any(missing.values()), (listed.keys(), missing)


def test_every_key_of_a_fresh_record_is_named_in_the_record_schema(tmp_path):
    """results/README.md names each key a run writes, down to env's, env.precision's, env.compile's, timing's and
    numerics' own (a newcomer found `predicted_by`, `env.precision.accumulation` and
    `env.compile.recompile_limit_hit_by` in a record and nowhere in the schema, 2026-11-30)."""
    from hydra import compose, initialize_config_dir

    from bench.running.run import run_cell

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[f"results_dir={tmp_path}", "train.max_steps=2", "format=fp8"])
    record = run_cell(cfg)
    text = (ROOT / "results" / "README.md").read_text()
    named = {word for quoted in re.findall(r"`([^`]*)`", text) for word in re.findall(r"\w+", quoted)}
    nested = ("env", "env.precision", "env.compile", "timing", "numerics", "memory")
    keys = [*record, *(f"{where}.{key}" for where in nested
                       for key in functools.reduce(lambda d, k: d[k], where.split("."), record))]
    assert [key for key in keys if key.rsplit(".", 1)[-1] not in named] == []
