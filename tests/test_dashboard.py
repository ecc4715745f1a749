"""`make dashboard`: every key a panel reads is one the runner's records and rows really hold, and the W&B
objects carry those keys; offline the specs are written, with a key the stand-in for W&B is asked to save."""

import json
from pathlib import Path

import pytest

from bench.reporting import dashboard
from bench.running.record import read_record
from bench.running.run import run_cell


def _flatten(value, prefix="") -> dict:
    """Nested dicts as W&B shows them: dotted paths."""
    if not isinstance(value, dict):
        return {prefix: value}
    out = {}
    for key, inner in value.items():
        out |= _flatten(inner, f"{prefix}.{key}" if prefix else str(key))
    return out


@pytest.fixture(scope="module")
def logged(tmp_path_factory):
    """What W&B receives from three real cells (bench/running/logger.py): LeNet, emulated FP8 with dynamic loss scaling
    (telemetry, loss scale), the tiny BERT on SQuAD (exact match, F1), a tiny char-LM (validation loss and bits
    per character). Per source, the keys with values."""
    from hydra import compose, initialize_config_dir

    root = tmp_path_factory.mktemp("dashboard-runs")
    text = root / "text.txt"
    text.write_text("to be, or not to be: that is the question.\n" * 200)
    keys = {"config": set(), "summary": set(), "history": set()}
    for overrides in (["model=lenet", "format=fp8", "scaling=dynamic", "train.max_steps=12", "train.log_every=5"],
                      ["model=bert_tiny", "format=bf16", "train.max_steps=2", "train.log_every=1"],
                      ["model=charlm", "model.data.source=local", f"model.data.path={text}", "model.data.sha256=null",
                       "model.iterations=4", "model.arch.layers=1", "model.arch.embedding=16",
                       "model.arch.block_size=8"]):
        with initialize_config_dir(config_dir=str(Path(__file__).resolve().parents[1] / "conf"), version_base="1.3"):
            cfg = compose("config", overrides=[f"results_dir={root}", "experiment_name=dash", *overrides])
        run_cell(cfg)
        run_dir = root / cfg.cell
        record = read_record(run_dir / "result.json")
        assert record["status"] == "ok"
        config = record["config"] | {"precision": record["env"]["precision"]}  # the logger's W&B config
        for source, values in (("config", config), ("summary", record)):
            keys[source] |= {k for k, v in _flatten(values).items() if v is not None}
        for line in (run_dir / "metrics.jsonl").read_text().splitlines():
            keys["history"] |= {k for k, v in _flatten(json.loads(line)).items() if v is not None}
    return root, keys


def test_every_panel_key_is_one_the_runs_log(logged, tmp_path):
    root, keys = logged
    board = dashboard.build("dash", None, "p", root, [tmp_path])
    assert {p.kind for p in board.panels} == {"bar", "line", "parallel"}
    assert {k.name for p in board.panels for k in p.keys} >= {"metrics.test_accuracy", "metrics.exact_match",
                                                               "metrics.f1", "metrics.val_loss", "metrics.val_bpc",
                                                               "loss_scale", "skipped_steps"}
    assert _keys_not_logged(board, keys) == []


def _keys_not_logged(board: dashboard.Dashboard, keys: dict) -> list[str]:
    """The check: every key a panel reads, `source:name`, that no run logged."""
    return sorted(f"{k.source}:{k.name}" for k in board.keys() if k.name not in keys[k.source])


def test_a_renamed_record_key_breaks_the_check(logged, tmp_path, monkeypatch):
    """The same check, run on a board whose model declaration misspells its metric, names exactly that key."""
    root, keys = logged
    monkeypatch.setattr(dashboard, "reported_metrics", lambda model: ["test_acc"])  # a declaration with a typo
    board = dashboard.build("dash", None, "p", root, [tmp_path])
    assert _keys_not_logged(board, keys) == ["summary:metrics.test_acc"]


def _wandb_spellings(key: dashboard.Key) -> list[str]:
    """How a W&B view spells a key: config values sit under .value; summary keys under summary_metrics (charts)
    or summary: (parallel coordinates, whose accessors also prefix config:)."""
    if key.source == "config":
        head, _, rest = key.name.partition(".")
        name = f"{head}.value.{rest}" if rest else head
        return [f'"{name}"', f'"config:{name}"']
    if key.source == "summary":
        return [f'"summary_metrics.{key.name}"', f'"summary:{key.name}"']
    return [f'"{key.name}"']


def test_the_workspace_spec_carries_every_key_and_the_report_every_table(logged, tmp_path):
    root, _ = logged
    tables = tmp_path / "tables"
    (tables / "dash").mkdir(parents=True)
    (tables / "dash" / "precision.md").write_text("| setting | test_accuracy |\n|---|---|\n| 32-true | 98.5 |\n")
    assert dashboard.main(["dash", "--results", str(root), "--tables", str(tmp_path / "none"), "--tables", str(tables),
                           "--out", str(tmp_path / "out")]) == 0
    view = (tmp_path / "out" / "dash" / "workspace.json").read_text()
    board = dashboard.build("dash", None, "p", root, [tables])
    assert [k for k in board.keys() if not any(s in view for s in _wandb_spellings(k))] == []
    spec = json.loads((tmp_path / "out" / "dash" / "report.json").read_text())
    assert spec["tables"] == {"precision": (tables / "dash" / "precision.md").read_text()}
    assert spec["run_filter"] == {"config": "experiment_name", "equals": "dash"}
    assert len(spec["panels"]) == len(board.panels)


class StandInWandb:
    """Stands in for the W&B service: records what would be saved, returns the URL W&B would."""

    def __init__(self, fail: bool = False):
        self.saved, self.fail = [], fail

    def __call__(self, obj) -> str:
        if self.fail:
            raise ConnectionError("api.wandb.ai unreachable")
        self.saved.append(obj)
        return f"https://wandb.ai/me/p/{type(obj).__name__.lower()}"


def test_with_a_key_both_are_saved_and_their_urls_printed(logged, tmp_path, monkeypatch, capsys):
    root, _ = logged
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    wandb = StandInWandb()
    argv = ["dash", "--entity", "me", "--project", "p", "--results", str(root), "--out", str(tmp_path)]
    assert dashboard.main(argv, save=wandb) == 0
    workspace, report = wandb.saved
    assert type(workspace).__name__ == "Workspace" and type(report).__name__ == "Report"
    assert (workspace.entity, workspace.project, report.entity, report.project) == ("me", "p", "me", "p")
    assert [s.name for s in workspace.sections][0] == "Accuracy (the paper tables)"
    out = capsys.readouterr().out
    assert "workspace: https://wandb.ai/me/p/workspace" in out and "report: https://wandb.ai/me/p/report" in out


def test_offline_it_says_what_it_would_create_and_exits_0(logged, tmp_path, monkeypatch, capsys):
    root, _ = logged
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    wandb = StandInWandb()
    assert dashboard.main(["dash", "--results", str(root), "--out", str(tmp_path)], save=wandb) == 0
    assert wandb.saved == [] and "nothing created in W&B" in capsys.readouterr().out
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert dashboard.main(["dash", "--results", str(root), "--out", str(tmp_path)], save=StandInWandb(fail=True)) == 0
    assert "could not be reached" in capsys.readouterr().out
    assert (tmp_path / "dash" / "workspace.json").is_file()


def test_on_a_fresh_clone_without_records_it_builds_panels_for_every_shipped_model(tmp_path, monkeypatch, capsys):
    """`make dashboard` before any sweep: no local records, so the panels come from conf/model/, every model composed
    as Hydra composes it (distilbert_tiny takes its name and task from its defaults: a plain yaml load has neither)."""
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    empty = tmp_path / "runs"
    assert dashboard.main(["default", "--results", str(empty), "--tables", str(tmp_path / "none"),
                           "--out", str(tmp_path)], save=StandInWandb()) == 0
    metrics = dashboard.shipped_metrics()
    for metric in ("test_accuracy", "val_loss", "f1"):
        assert any(metric in m for m in metrics), (metric, metrics)
    assert (tmp_path / "default" / "workspace.json").is_file() and "nothing created in W&B" in capsys.readouterr().out


def test_the_committed_example_reports_the_committed_tables():
    """results/dashboards/default/ is the example docs/cluster.md points to; its report carried the default tables
    of before their 2026-11-25 remake until a newcomer compared them (2026-11-30)."""
    root = Path(__file__).resolve().parents[1]
    report = json.loads((root / "results" / "dashboards" / "default" / "report.json").read_text())
    assert report["tables"] == {name: (root / "results" / "tables" / "default" / f"{name}.md").read_text()
                                for name in dashboard.TABLES}


def test_an_experiment_that_is_nowhere_exits_2_with_the_nearest_and_writes_nothing(tmp_path, capsys):
    """`make dashboard EXPERIMENT=blok_formats` wrote specs of 31 panels and an empty report (a newcomer's typo,
    2026-11-30): a name that is no preset and has no records or tables here is refused, as `make sweep` refuses it."""
    tables = Path(__file__).resolve().parents[1] / "results" / "tables"
    assert dashboard.main(["blok_formats", "--results", str(tmp_path / "runs"), "--tables", str(tables),
                           "--out", str(tmp_path / "out")]) == 2
    assert "(did you mean block_formats?)" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
