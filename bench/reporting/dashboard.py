"""`make dashboard`: one experiment's W&B workspace and report, built as code from the keys its runs log.

    python -m bench.reporting.dashboard EXPERIMENT [--entity E] [--project P] [--results DIR] [--tables DIR ...]
                              [--out results/local/dashboards]

Every cell logs one W&B run (bench/running/logger.py): config = the resolved config plus `precision` (the record's
env.precision), history = the metrics.jsonl rows, summary = the record. The panels below read those keys
and nothing else; `PANELS` names each key with where it lives, so a test can check every one against
records the runner wrote. The workspace mirrors the paper tables (metric by setting and by scaling, time
and memory per setting with emulated runs labelled, format -> scaling -> metric), then the curves (loss,
loss scale, skipped steps, underflow/overflow per tensor class). The report puts the aggregator's tables
(`make tables`: precision, scaling grid, vs published, numerics) above the same panels, on the
experiment's runs.

Without WANDB_API_KEY, or when W&B cannot be reached, the command prints what it would create and writes
the specs to <out>/<experiment>/ (workspace.json: W&B's saved-view model; report.json: the report's
blocks, run filter and panels), exit 0. With a key it saves both and prints their URLs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from bench.errors import ConfigError, suggestion
from bench.numerics.telemetry import TENSOR_CLASSES
from bench.running.config import CONF_DIR, check_declared, task_spec

TABLES = ("precision", "scaling_grid", "vs_published", "numerics")  # the aggregator's Markdown tables


@dataclass(frozen=True)
class Key:
    """A key a panel reads: `source` is config, summary (the record) or history (the logged rows)."""

    source: str
    name: str


@dataclass(frozen=True)
class Panel:
    section: str
    kind: str  # bar | line | parallel
    title: str
    keys: tuple[Key, ...]  # bar: summary metrics; line: history series; parallel: the columns in order
    groupby: Key | None = None
    log_y: bool = False


@dataclass
class Dashboard:
    experiment: str
    entity: str | None
    project: str
    panels: list[Panel]
    tables: dict[str, str] = field(default_factory=dict)  # table name -> its Markdown

    def keys(self) -> set[Key]:
        return {k for p in self.panels for k in (*p.keys, *([p.groupby] if p.groupby else []))} | {RUN_FILTER}


RUN_FILTER = Key("config", "experiment_name")  # the experiment's runs (also their W&B group)
SETTING = Key("config", "precision.setting")
LABEL = Key("config", "precision.label")  # the setting, "(emulated)" where it was: emulated times are not native
SCALING = Key("config", "scaling.name")


def reported_metrics(model_cfg: dict) -> list[str]:
    """The metrics a model's declaration asks the dashboard to chart (`task.report`, else its primary metric)."""
    spec = task_spec(model_cfg)
    return list(spec.get("report") or [spec["metric"]])


def panels_for(metrics: list[str]) -> list[Panel]:
    """The workspace's panels for an experiment whose models report `metrics`."""
    metrics = list(dict.fromkeys(metrics))
    panels = []
    for metric in metrics:
        key = Key("summary", f"metrics.{metric}")
        panels += [Panel("Accuracy (the paper tables)", "bar", f"{metric} by precision setting (mean, std over seeds)",
                         (key,), SETTING),
                   Panel("Accuracy (the paper tables)", "bar", f"{metric} by scaling method (mean, std over seeds)",
                         (key,), SCALING),
                   Panel("Accuracy (the paper tables)", "parallel", f"format -> scaling -> {metric}",
                         (Key("config", "format.name"), SCALING, key))]
    for name, title in (("timing.train_s", "train time (s)"), ("timing.step_median_s", "median step time (s)"),
                        ("memory.step.total", "modelled step memory (bytes, as the format stores it)"),
                        ("memory.peak_bytes", "measured peak memory (bytes)")):
        panels.append(Panel("Time and memory (emulated settings labelled)", "bar", f"{title} by setting",
                            (Key("summary", name),), LABEL))
    panels += [Panel("Training curves", "line", "training loss by setting", (Key("history", "loss"),), SETTING),
               Panel("Loss scaling", "line", "loss scale by scaling method", (Key("history", "loss_scale"),), SCALING,
                     log_y=True),
               Panel("Loss scaling", "line", "skipped steps (cumulative) by scaling method",
                     (Key("history", "skipped_steps"),), SCALING)]
    for tensor_class in TENSOR_CLASSES:
        panels.append(Panel("Numerics: underflow and overflow per tensor class", "line",
                            f"{tensor_class}: fraction underflowing / subnormal / overflowing",
                            tuple(Key("history", f"quantisation.{tensor_class}.{what}")
                                  for what in ("underflow", "subnormal", "overflow")), SETTING))
    return panels


def experiment_metrics(results: Path, experiment: str) -> list[str]:
    """The metrics the models of the experiment's local records report (empty when there are none here)."""
    records = []
    for path in (results / experiment).glob("**/result.json") if (results / experiment).is_dir() else []:
        try:
            record = json.loads(path.read_text())
            records.append({"config": record["config"], "env": record["env"], "_dir": str(path.parent)})
        except (OSError, ValueError, KeyError, TypeError):
            continue
    check_declared(records)  # each record's format, model and scaling method, declared here (ConfigError if not)
    models = {r["config"]["model"]["name"]: r["config"]["model"] for r in records}
    return [m for _, model in sorted(models.items()) for m in reported_metrics(model)]


def shipped_metrics() -> list[str]:
    """The metrics of every model declared in conf/model/ (a dashboard for an experiment not run here), each model
    composed as `model=<name>` composes it (a yaml that takes its name and task from its defaults included)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        specs = [OmegaConf.to_container(compose("config", overrides=[f"model={p.stem}"]).model, resolve=False)
                 for p in sorted((CONF_DIR / "model").glob("*.yaml"))]
    return [m for spec in specs if "task" in spec for m in reported_metrics(spec)]


def build(experiment: str, entity: str | None, project: str, results: Path, tables: list[Path]) -> Dashboard:
    """`tables`: the aggregator's output directories, in order of preference (the first holding the experiment).
    An experiment that is no preset and has no records or tables here is refused (a typo made empty specs)."""
    known = {"default", *(p.stem for p in (CONF_DIR / "experiment").glob("*.yaml")),
             *(p.name for folder in (results, *tables) if folder.is_dir() for p in folder.iterdir() if p.is_dir())}
    if experiment not in known:
        raise ConfigError(f"experiment {experiment!r} is no preset and has no records under {results} or tables "
                          f"under {', '.join(map(str, tables))}{suggestion(experiment, known)}; valid: "
                          f"{', '.join(sorted(known))}")
    metrics = experiment_metrics(results, experiment) or shipped_metrics()
    directory = next((t / experiment for t in tables if (t / experiment).is_dir()), None)
    found = {name: (directory / f"{name}.md").read_text() for name in TABLES
             if directory is not None and (directory / f"{name}.md").is_file()}
    return Dashboard(experiment, entity, project, panels_for(metrics), found)


# --- W&B objects (wandb-workspaces) -----------------------------------------------------------------------

def _wandb_key(key: Key):
    import wandb_workspaces.reports.v2 as wr

    return {"config": wr.Config, "summary": wr.SummaryMetric, "history": wr.Metric}[key.source](key.name)


def _wandb_panel(panel: Panel):
    import wandb_workspaces.reports.v2 as wr

    group = _wandb_key(panel.groupby) if panel.groupby else None
    if panel.kind == "bar":
        return wr.BarPlot(title=panel.title, metrics=[_wandb_key(k) for k in panel.keys], groupby=group,
                          groupby_aggfunc="mean", groupby_rangefunc="stddev")
    if panel.kind == "line":
        return wr.LinePlot(title=panel.title, x="Step", y=[_wandb_key(k) for k in panel.keys], groupby=group,
                           groupby_aggfunc="mean", groupby_rangefunc="minmax", log_y=panel.log_y or None)
    return wr.ParallelCoordinatesPlot(title=panel.title, columns=[wr.ParallelCoordinatesPlotColumn(metric=_wandb_key(k))
                                                                  for k in panel.keys])


def _run_filter(dashboard: Dashboard):
    from wandb_workspaces import expr

    return [expr.Config(RUN_FILTER.name) == dashboard.experiment]


def workspace(dashboard: Dashboard):
    import wandb_workspaces.workspaces as ws

    sections = {}
    for panel in dashboard.panels:
        sections.setdefault(panel.section, []).append(_wandb_panel(panel))
    return ws.Workspace(entity=dashboard.entity or "", project=dashboard.project,
                        name=f"precision-bench: {dashboard.experiment}",
                        sections=[ws.Section(name=name, panels=panels, is_open=True)
                                  for name, panels in sections.items()],
                        runset_settings=ws.RunsetSettings(filters=_run_filter(dashboard)))


def report(dashboard: Dashboard):
    import wandb_workspaces.reports.v2 as wr

    blocks = [wr.H1(f"precision-bench: {dashboard.experiment}"),
              wr.P("Tables from `make tables` (mean ± std over seeds; † marks emulated settings, whose times are "
                   "not the format's), then the panels of the experiment's runs.")]
    for name, markdown in dashboard.tables.items():
        blocks += [wr.H2(name.replace("_", " ")), wr.MarkdownBlock(markdown)]
    runset = wr.Runset(entity=dashboard.entity or "", project=dashboard.project, name=dashboard.experiment,
                       filters=_run_filter(dashboard))
    blocks.append(wr.PanelGrid(runsets=[runset], panels=[_wandb_panel(p) for p in dashboard.panels]))
    return wr.Report(project=dashboard.project, entity=dashboard.entity or "",
                     title=f"precision-bench: {dashboard.experiment}", blocks=blocks)


def write_specs(dashboard: Dashboard, out: Path) -> list[Path]:
    """workspace.json (the saved view W&B would store, built offline) and report.json (our spec of the report:
    W&B builds its own model of a report's run set only when logged in)."""
    out.mkdir(parents=True, exist_ok=True)
    view = workspace(dashboard)._to_model().model_dump(by_alias=True, exclude_none=True, mode="json")
    spec = {"experiment": dashboard.experiment, "entity": dashboard.entity, "project": dashboard.project,
            "title": f"precision-bench: {dashboard.experiment}",
            "run_filter": {"config": RUN_FILTER.name, "equals": dashboard.experiment},
            "tables": dashboard.tables, "panels": [asdict(p) for p in dashboard.panels]}
    paths = [out / "workspace.json", out / "report.json"]
    paths[0].write_text(json.dumps(view, indent=1) + "\n")
    paths[1].write_text(json.dumps(spec, indent=1) + "\n")
    return paths


def save_to_wandb(obj) -> str:
    """Create or update `obj` (a Workspace or Report) in W&B; its URL."""
    obj.save()
    return obj.url


def describe(dashboard: Dashboard) -> str:
    sections: dict[str, int] = {}
    for panel in dashboard.panels:
        sections[panel.section] = sections.get(panel.section, 0) + 1
    lines = [f"workspace 'precision-bench: {dashboard.experiment}' in {dashboard.entity or '<default entity>'}/"
             f"{dashboard.project}, runs with config.{RUN_FILTER.name} = {dashboard.experiment!r}:"]
    lines += [f"  section {name!r}: {n} panel{'s' * (n != 1)}" for name, n in sections.items()]
    lines.append(f"report with tables: {', '.join(dashboard.tables) or 'none found (run make tables first)'}, "
                 f"and the same {len(dashboard.panels)} panels")
    return "\n".join(lines)


def main(argv: list[str] | None = None, save: Callable = save_to_wandb) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.reporting.dashboard", description=__doc__.splitlines()[0])
    parser.add_argument("experiment", help="the experiment_name (W&B group) to build the dashboard for")
    parser.add_argument("--entity", default=os.environ.get("WANDB_ENTITY"))
    parser.add_argument("--project", default=os.environ.get("WANDB_PROJECT", "precision-bench"))
    parser.add_argument("--results", type=Path, default=Path("results/runs"),
                        help="local records: which models the experiment trained (else panels for every task)")
    parser.add_argument("--tables", type=Path, action="append",
                        help="the aggregator's output directory (repeatable: the first holding the experiment is used; "
                             "default results/tables)")
    parser.add_argument("--out", type=Path, default=Path("results/local/dashboards"))
    args = parser.parse_args(argv)
    try:
        dashboard = build(args.experiment, args.entity, args.project, args.results,
                          args.tables or [Path("results/tables")])
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    print(describe(dashboard))
    paths = write_specs(dashboard, args.out / args.experiment)
    print("specs written: " + ", ".join(map(str, paths)))
    if not os.environ.get("WANDB_API_KEY"):
        print("WANDB_API_KEY is not set: nothing created in W&B (set it and run again to create both)")
        return 0
    try:
        for name, obj in (("workspace", workspace(dashboard)), ("report", report(dashboard))):
            print(f"{name}: {save(obj)}")
    except Exception as e:  # offline or refused: the specs are written, say why nothing was created
        print(f"W&B could not be reached or refused ({type(e).__name__}: {e}); nothing created there")
    return 0


if __name__ == "__main__":
    sys.exit(main())
