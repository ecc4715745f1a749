"""A model and a format defined outside bench/ (tests/plugin: a module on PYTHONPATH, a yaml for each on Hydra's
search path) run through a sweep and its resumption, unit scaling, the tables, the plots and the dashboard with no
edit to bench/ (tests/test_layout.py checks that bench/ lists no model by name)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parents[1]
PLUGIN = ROOT / "tests" / "plugin"
SEARCHPATH = f"hydra.searchpath=[file://{PLUGIN / 'conf'}]"


def _bench(module: str, *args, cwd: Path) -> subprocess.CompletedProcess:
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(PLUGIN), str(ROOT)])}
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=600)


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    """The user's model swept over two formats (one the user's) and three scaling methods (one the user's), then the
    same sweep launched again."""
    tmp = tmp_path_factory.mktemp("plugin")
    args = ["-m", SEARCHPATH, "model=mlp", "format=fp32,fp8e3m4", "scaling=none,unit,channel_scale", "seed=0",
            f"results_dir={tmp / 'runs'}"]
    first, again = _bench("bench.run", *args, cwd=tmp), _bench("bench.run", *args, cwd=tmp)
    return tmp, first, again


@pytest.mark.slow  # ~30 s with its sweep; test_the_docs_plugin_commands_... sweeps, resumes and reports by default
def test_a_users_model_sweeps_and_resumes_without_editing_bench(swept):
    tmp, first, again = swept
    assert first.returncode == 0, first.stderr[-2000:]
    assert "sweep: 6 ok, 0 diverged, 0 failed (0 skipped" in first.stderr
    assert "(6 skipped as already recorded)" in again.stderr
    records = [json.loads(p.read_text()) for p in sorted((tmp / "runs").rglob("result.json"))]
    assert sorted(r["config"]["scaling"]["name"] for r in records) == \
        ["channel_scale"] * 2 + ["none"] * 2 + ["unit"] * 2
    assert sorted(r["env"]["precision"]["setting"] for r in records) == ["32-true"] * 3 + ["fp8e3m4-mixed"] * 3
    assert all(r["status"] == "ok" and r["config"]["model"]["task"]["_target_"] == "mlp_digits.mlp_task"
               for r in records)
    assert all(r["metrics"]["test_accuracy"] > 0 for r in records)
    # its validate() gives the quality curve: after each of the 2 epochs (the second, the final evaluation's value)
    steps = records[0]["timing"]["steps"]
    assert all(r["metrics"]["curve"]["metric"] == "val_accuracy" and [p[0] for p in r["metrics"]["curve"]["points"]]
               == [steps // 2, steps] for r in records)
    unit = next(r for r in records if r["config"]["scaling"]["name"] == "unit")
    assert unit["numerics"]["unit_conversion"]["why"].startswith("fresh unit-variance init")  # converted, from scratch
    # the user's scaling method scaled each weight row into E3M4's range: no weight fell below its normal range, where
    # unscaled the small ones did; activations and gradients it leaves alone (no scale recorded for them)
    fp8 = {r["config"]["scaling"]["name"]: r["numerics"]["quantisation"] for r in records
           if r["env"]["precision"]["setting"] == "fp8e3m4-mixed"}
    assert fp8["channel_scale"]["weights"]["subnormal_fraction"] < fp8["none"]["weights"]["subnormal_fraction"]
    assert fp8["channel_scale"]["weights"]["scale_max"] > 1 and "scale_max" not in fp8["channel_scale"]["gradients"]


@pytest.mark.slow  # ~30 s with its sweep; test_the_docs_plugin_commands_... sweeps, resumes and reports by default
def test_a_users_model_gets_tables_plots_and_a_dashboard(swept):
    tmp = swept[0]
    tables = _bench("bench.aggregate", str(tmp / "runs"), "--out", str(tmp / "tables"), cwd=tmp)
    assert tables.returncode == 0, tables.stderr[-2000:]
    precision = (tmp / "tables" / "default" / "precision.md").read_text()
    assert "mlp (32 hidden, digits)" in precision and "test_accuracy" in precision  # its describe() and metric
    assert "| fp8e3m4-mixed †" in precision  # the user's format, marked emulated
    grid = (tmp / "tables" / "default" / "scaling_grid.md").read_text().splitlines()[2]
    assert grid.split("|")[-2].strip() == "channel_scale"  # the user's scaling method: a column, after the built-ins'
    assert "channel_scale" in (tmp / "tables" / "default" / "mlp_heatmap.svg").read_text()
    to_target = pd.read_csv(tmp / "tables" / "default" / "time_to_target.csv")  # read from its curve
    fp32 = to_target[(to_target["setting"] == "32-true") & (to_target["scaling"] == "none")].iloc[0]
    steps, reached = fp32["steps to target"].split(" ", 1)  # the FP32 run reaches its own final value, by its end
    assert reached == "(1 of 1)" and int(steps) in (40, 80)
    assert (tmp / "tables" / "default" / "mlp_heatmap.png").is_file()
    board = _bench("bench.reporting.dashboard", "default", "--results", str(tmp / "runs"), "--tables",
                   str(tmp / "tables"), "--out", str(tmp / "dash"), cwd=tmp)
    assert board.returncode == 0, board.stderr[-2000:]
    assert "metrics.test_accuracy" in (tmp / "dash" / "default" / "workspace.json").read_text()


def test_a_users_model_check_refuses_a_bad_key_before_training(tmp_path):
    out = _bench("bench.run", SEARCHPATH, "model=mlp", "model.arch.hidden=0", f"results_dir={tmp_path / 'runs'}",
                 cwd=tmp_path)
    assert out.returncode == 2 and "model.arch.hidden=0 must be >= 1" in out.stderr
    assert not list(tmp_path.rglob("result.json"))


# --- plug-ins that travel: docs/extending.md's commands, as written, then every mistake a newcomer made ---

def _docs_block(heading: str) -> str:
    """The first ```sh block after `heading` in docs/extending.md."""
    text = (ROOT / "docs" / "extending.md").read_text()
    after = text[text.index(heading):]
    return after[after.index("```sh\n") + 6:after.index("```", after.index("```sh\n") + 6)]


@pytest.fixture(scope="module")
def travelled(tmp_path_factory):
    """docs/extending.md's plug-in commands run as written, from a directory laid out as the repository's root (its
    tests/ and .venv/ linked), then the sweep launched again; the tables' and records' folders it wrote."""
    tmp = tmp_path_factory.mktemp("travel")
    for name in ("tests", ".venv"):
        (tmp / name).symlink_to(ROOT / name)
    commands = _docs_block("# Plug-ins: declared once")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONPATH": str(ROOT)}
    run = subprocess.run(["bash", "-ec", commands], cwd=tmp, env=env, capture_output=True, text=True, timeout=900)
    sweep = commands.split("\n.venv/bin/python -m bench.aggregate")[0]
    again = subprocess.run(["bash", "-ec", sweep], cwd=tmp, env=env, capture_output=True, text=True, timeout=600)
    return tmp, run, again


def test_the_docs_plugin_commands_train_table_and_compare_a_users_format_and_model(travelled):
    tmp, run, again = travelled
    assert run.returncode == 0, run.stderr[-3000:]
    assert "sweep: 8 ok, 0 diverged, 0 failed (0 skipped" in run.stderr
    assert "(8 skipped as already recorded)" in again.stderr  # resumption finds the plug-in's cells
    records = [json.loads(p.read_text()) for p in (tmp / "results/local/plugins").rglob("result.json")]
    fnuz = [r for r in records if r["config"]["format"]["name"] == "fp8fnuz"]
    assert {r["config"]["model"]["name"] for r in fnuz} == {"lenet", "vit"} and len(fnuz) == 4
    assert all(r["status"] == "ok" and r["env"]["precision"]["element_formats"] == ["fp8_e4m3fnuz", "fp8_e5m2fnuz"]
               for r in fnuz)
    assert all(r["env"]["plugins"]["modules"] == ["amd_fp8"] and r["env"]["plugins"]["format"] == "amd_fp8"
               for r in fnuz)  # the record names its plug-ins
    vit_unit = next(r for r in records if r["config"]["model"]["name"] == "vit" and r["config"]["scaling"]["name"]
                    == "unit")
    assert vit_unit["env"]["plugins"]["model"] == "vit_digits"
    precision = (tmp / "results/local/plugins-tables/default/precision.md").read_text()
    assert precision.count("fp8fnuz-mixed (bf16 elsewhere) †") == 4  # both models, both scalings: none dropped
    cells = pd.read_csv(tmp / "results/local/plugins-tables/default/cells.csv")
    assert len(cells) == 8 and cells["setting"].notna().all()
    assert "fp8fnuz-mixed" in run.stdout and "8 cells paired" in run.stdout  # bench.compare found every cell


def test_the_dashboard_imports_the_plugins_its_records_name(travelled):
    tmp = travelled[0]
    board = _bench("bench.reporting.dashboard", "default", "--results", str(tmp / "results/local/plugins"), "--tables",
                   str(tmp / "results/local/plugins-tables"), "--out", str(tmp / "dash"), cwd=tmp)
    assert board.returncode == 0, board.stderr[-2000:]


def _without_plugins(module: str, *args, cwd: Path) -> subprocess.CompletedProcess:
    """A command run where the plug-ins are not importable (only the suite on PYTHONPATH)."""
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=600)


def test_reporting_records_of_a_format_not_declared_here_exits_2_naming_it_and_its_module(travelled, tmp_path):
    runs = travelled[0] / "results/local/plugins"
    for module, args in (("bench.aggregate", [str(runs), "--out", str(tmp_path / "tables")]),
                         ("bench.compare", [str(runs), "--against",
                                            str(travelled[0] / "results/local/plugins-tables/default")]),
                         ("bench.reporting.dashboard", ["default", "--results", str(runs), "--out",
                                                        str(tmp_path / "dash")])):
        out = _without_plugins(module, *args, cwd=tmp_path)
        assert out.returncode == 2, (module, out.stderr[-1500:])
        assert "format 'fp8fnuz' is not declared in this process; its record says module 'amd_fp8' declared it, " \
               "which cannot be imported here (ModuleNotFoundError" in out.stderr, (module, out.stderr)
    assert not list(tmp_path.iterdir())  # nothing written


def test_an_installed_plugin_is_found_through_its_entry_point(tmp_path):
    """A package that declares amd_fp8 in the entry-point group: format=fp8fnuz works with no plugins: key."""
    dist = tmp_path / "site" / "amd_fp8_plugin-1.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: amd-fp8-plugin\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[precision_bench.plugins]\namd_fp8 = amd_fp8\n")
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), str(PLUGIN), str(ROOT)])}
    out = subprocess.run([sys.executable, "-m", "bench.run", f"{SEARCHPATH}", "format=fp8fnuz", "train.max_steps=2",
                          f"results_dir={tmp_path / 'runs'}"], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    record = json.loads(next((tmp_path / "runs").rglob("result.json")).read_text())
    assert record["env"]["plugins"]["modules"] == ["amd_fp8"] and record["status"] == "ok"


def _refused(tmp_path: Path, *args: str, searchpath: str = SEARCHPATH) -> str:
    """Run bench.run with `args`; assert exit 2 and that nothing was written under results_dir; its stderr."""
    flags = [a for a in args if a.startswith("-")]
    out = _bench("bench.run", *flags, searchpath, *[a for a in args if a not in flags],
                 f"results_dir={tmp_path / 'runs'}", cwd=tmp_path)
    assert out.returncode == 2, out.stderr[-2000:]
    assert not (tmp_path / "runs").exists() and not list(tmp_path.rglob("multirun.yaml")), "something was written"
    assert "Traceback" not in out.stderr
    return out.stderr


def test_a_plugins_format_without_its_plugin_and_a_plugin_that_cannot_be_imported(tmp_path):
    forgot = _refused(tmp_path, "format=fp8fnuz")  # its yaml is on the search path, its module not named
    assert "format='fp8fnuz' is not valid; valid: fp32" in forgot and "name it with plugins=[<module>]" in forgot
    said = _refused(tmp_path, "plugins=[amd_fp9]", "format=fp8fnuz")
    assert "plug-in module 'amd_fp9' (named by the plugins: config key) cannot be imported: ModuleNotFoundError" in said


def test_a_typo_in_a_user_methods_options_exits_2_naming_its_options(tmp_path):
    """Its options are its `Options` dataclass's fields (tests/plugin/channel_scaling.py), checked as the schema is:
    the command line's typo (Hydra's check, the keys its yaml set), and a yaml's (past Hydra: options are free-form to
    it)."""
    said = _refused(tmp_path, "plugins=[channel_scaling]", "model=mlp", "scaling=channel_scale",
                    "scaling.options.margn=1")
    assert "unknown config key scaling.options.margn (did you mean scaling.options.margin?)" in said
    (tmp_path / "conf" / "scaling").mkdir(parents=True)
    (tmp_path / "conf" / "scaling" / "margins.yaml").write_text(
        "name: channel_scale\n_target_: channel_scaling.PerChannelWeightScale\noptions: {margn: 1}\n")
    said = _refused(tmp_path, "model=mlp", "scaling=margins",
                    searchpath=f"hydra.searchpath=[file://{PLUGIN / 'conf'},file://{tmp_path / 'conf'}]")
    assert ("unknown key scaling.options.margn (did you mean scaling.options.margin?); scaling=channel_scale's "
            "options: margin") in said


def test_a_sweep_giving_one_methods_option_to_all_of_its_methods_is_told_whose_it_is(tmp_path):
    """`scaling=none,channel_scale scaling.options.margin=2` was refused as an unknown key, naming neither method (the
    check reads the sweep's first; a newcomer's trial, 2026-11-30)."""
    said = _refused(tmp_path, "-m", "plugins=[channel_scaling]", "model=mlp", "scaling=none,channel_scale",
                    "scaling.options.margin=2")
    assert ("scaling.options.margin is an option of scaling=channel_scale alone, and this sweep also has scaling=none: "
            "sweep them apart") in said, said


def test_a_users_yaml_named_like_a_built_in_one_is_refused_not_silently_unread(tmp_path):
    """Hydra reads the first `format/fp8.yaml` on its search path, conf/'s: a user's own `fp8.yaml` trained the
    built-in format without a word (a newcomer's trial, 2026-11-30)."""
    (tmp_path / "conf" / "format").mkdir(parents=True)
    (tmp_path / "conf" / "format" / "fp8.yaml").write_text("name: fp8\nmode: mixed\nelsewhere: fp32\n")
    said = _refused(tmp_path, "format=bf16",
                    searchpath=f"hydra.searchpath=[file://{PLUGIN / 'conf'},file://{tmp_path / 'conf'}]")
    mine, built_in = tmp_path / "conf" / "format" / "fp8.yaml", ROOT / "conf" / "format" / "fp8.yaml"
    assert f"{mine} is never read: Hydra takes {built_in} first" in said and "e.g. format/my_fp8.yaml" in said, said


def test_a_users_site_scaler_without_scale_for_is_refused_before_training(tmp_path):
    """A method whose `site_scale` returns an object without `scale_for` trained until its first forward pass, then
    failed with a record (exit 1; a newcomer's trial, 2026-11-30)."""
    (tmp_path / "no_scale_for.py").write_text(
        "from bench.numerics.scaling_methods import ScalingMethod, register\n\n\n"
        "@register('no_scale_for')\nclass NoScaleFor(ScalingMethod):\n    site_scales = True\n\n"
        "    def site_scale(self, tensor_class, element, observe):\n        return 2.0\n")
    (tmp_path / "conf" / "scaling").mkdir(parents=True)
    (tmp_path / "conf" / "scaling" / "no_scale_for.yaml").write_text(
        "name: no_scale_for\n_target_: no_scale_for.NoScaleFor\n")
    said = _refused(tmp_path, "plugins=[no_scale_for]", "model=lenet", "format=fp8", "scaling=no_scale_for",
                    searchpath=f"hydra.searchpath=[file://{tmp_path / 'conf'}]")
    assert ("scaling=no_scale_for: NoScaleFor.site_scale returned a float, which has no scale_for(x)" in said
            and "docs/extending.md" in said), said


TYPOS = {  # a yaml of each kind with a misspelt key: (folder, file, text, the message's key and suggestion)
    "model": ("model", "mlp_typo.yaml", "defaults: [/model_schema@_here_, _self_]\nname: mlp\n"
              "task: {_target_: mlp_digits.mlp_task, metric: test_accuracy, data_sources: [digits]}\nbatchsize: 16\n",
              "model/mlp_typo.yaml: unknown key model.batchsize (did you mean model.batch_size?)"),
    "optimizer": ("model", "mlp_typo.yaml", "defaults: [/model_schema@_here_, _self_]\nname: mlp\n"
                  "task: {_target_: mlp_digits.mlp_task, metric: test_accuracy, data_sources: [digits]}\n"
                  "optimizer: {name: sgd, weight_decy: 0.1}\n",
                  "unknown key model.optimizer.weight_decy (did you mean model.optimizer.weight_decay?)"),
    "format": ("format", "typo.yaml", "name: fp8\nmode: mixed\nelsewere: bf16\n",
               "format/typo.yaml: unknown key format.elsewere (did you mean format.elsewhere?)"),
    "scaling": ("scaling", "typo.yaml", "name: none\nloss_scalng: dynamic\n",
                "scaling/typo.yaml: unknown key scaling.loss_scalng (did you mean scaling.loss_scaling?)"),
    "experiment": ("experiment", "typo.yaml", "# @package _global_\nexperiment_name: typo\ntrain: {max_step: 3}\n",
                   "experiment/typo.yaml: unknown key train.max_step (did you mean train.max_steps?)"),
}


@pytest.mark.parametrize("kind", TYPOS)
def test_a_typo_in_any_yaml_exits_2_with_the_valid_keys_and_a_did_you_mean(tmp_path, kind):
    folder, name, text, message = TYPOS[kind]
    (tmp_path / "conf" / folder).mkdir(parents=True)
    (tmp_path / "conf" / folder / name).write_text(text)
    searchpath = f"hydra.searchpath=[file://{PLUGIN / 'conf'},file://{tmp_path / 'conf'}]"
    option = f"{folder}={name.removesuffix('.yaml')}"
    said = _refused(tmp_path, option, searchpath=searchpath)
    assert message in said and "valid keys there:" in said
    if kind == "model":  # a sweep over the option, the misspelt yaml second: composed and refused before the first
        assert message in _refused(tmp_path, "-m", f"model=mlp,{name.removesuffix('.yaml')}", searchpath=searchpath)


@pytest.mark.parametrize("args, message", [
    (["-m", "model=lenet", "scaling=none,umup"], "config error in cell [model=lenet scaling=umup"),
    (["-m", "model=vit", "model.arch.attention=ops,inline", "scaling=unit"],
     "scaling=unit has no rule for attention computed inside a module: blocks.0.attn (SelfAttention) calls "
     "F.scaled_dot_product_attention; blocks.1.attn (SelfAttention) calls F.scaled_dot_product_attention. Compute it "
     "with bench.numerics.ops.Attention (bidirectional) or CausalAttention"),
    (["model=vit", "model.arch.attention=inline", "scaling=umup"], "scaling=umup has no rule for attention computed"),
    (["-m", "model=vit", "model.arch.pool=mean,none"],
     "outputs of shape (32, 16, 10), targets of shape (32,); the loss is cross-entropy over (batch, classes) logits"
     " and (batch,) class indices, or (batch, classes, ...) and (batch, ...). The model is vit_digits.ViT"),
])
def test_every_cell_is_checked_before_the_first_trains_and_a_refused_command_writes_nothing(tmp_path, args, message):
    """The cell that would be refused comes after one that would train: nothing trains, nothing is written."""
    assert message in _refused(tmp_path, *args)


def test_a_metric_outside_its_declared_unit_fails_the_run_naming_the_unit_that_fits(tmp_path):
    out = _bench("bench.run", SEARCHPATH, "model=vit", "model.arch.percent=true", "train.max_steps=2",
                 f"results_dir={tmp_path / 'runs'}", cwd=tmp_path)
    record = json.loads(next((tmp_path / "runs").rglob("result.json")).read_text())
    assert out.returncode == 1 and record["status"] == "failed"
    assert record["reason"].startswith("MetricOutOfRange: metric test_accuracy=") and \
        "outside [0, 1], the range of its declared unit model.task.unit=fraction: declare unit: percent" in \
        record["reason"]


def test_a_run_whose_evaluation_returns_no_declared_metric_fails_naming_what_it_returned(make_cfg):
    """A model whose evaluate() lacks its declared metric (here LeNet declared `top5`) was recorded ok, its tables
    showing "–" as if it had run (a newcomer's trial): now the run is recorded failed, naming what came back."""
    from bench.running.run import run_cell

    record = run_cell(make_cfg("model.task.metric=top5", "train.max_steps=2"))
    assert record["status"] == "failed"
    assert record["reason"] == ("MetricOutOfRange: evaluate() returned no top5 (model.task.metric); it returned: "
                                "test_accuracy, test_examples, val_accuracy, val_examples")


def test_a_plugin_whose_own_import_fails_is_named_with_its_inner_error_only(tmp_path, monkeypatch):
    """A module that is found but fails while importing (its own error, or a module it imports that is missing) is
    named with that error and where it happened; only a module that is not there at all points to PYTHONPATH."""
    from bench import plugins
    from bench.errors import ConfigError

    (tmp_path / "broken_plugin.py").write_text("x = 1\nraise RuntimeError('boom while registering')\n")
    (tmp_path / "needy_plugin.py").write_text("import nonexistent_dependency_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError) as broken:
        plugins.load(["broken_plugin"], named_by="the plugins: config key")
    said = str(broken.value)
    assert "'broken_plugin' (named by the plugins: config key) was found, but its own import failed at" in said
    assert "broken_plugin.py:2: RuntimeError: boom while registering" in said and "PYTHONPATH" not in said
    with pytest.raises(ConfigError) as needy:
        plugins.load(["needy_plugin"])
    assert ("its own import failed: ModuleNotFoundError: No module named 'nonexistent_dependency_xyz'"
            in str(needy.value))
    assert "PYTHONPATH" not in str(needy.value)
    with pytest.raises(ConfigError, match="cannot be imported: ModuleNotFoundError.*must be importable"):
        plugins.load(["absent_plugin_xyz"])


@pytest.mark.parametrize("key, kind", [("model.task._target_", "a model's module"),
                                       ("scaling._target_", "a scaling method's module")])
def test_a_models_or_methods_module_that_fails_to_import_is_named_with_its_error_and_place(make_cfg, tmp_path,
                                                                                          monkeypatch, caplog, key,
                                                                                          kind):
    """Hydra's lookup said only "Error loading '<path>':" and logged a guess that the module was not installed (a
    newcomer's trial, 2026-11-30: it was on PYTHONPATH; its import of a misspelt name failed). The error and its
    place are said, a syntax error's at its own line, and nothing is logged."""
    from bench.errors import ConfigError
    from bench.running.config import check

    (tmp_path / "misspelt_import.py").write_text("x = 1\nfrom bench.tasks.lenet import load_digitz\n")
    (tmp_path / "bad_syntax.py").write_text("def builder(cfg)\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for module, said in (("misspelt_import", "misspelt_import.py:2: ImportError: cannot import name 'load_digitz'"),
                         ("bad_syntax", "bad_syntax.py:1: SyntaxError: expected ':'")):
        with pytest.raises(ConfigError) as refused:
            check(make_cfg(f"{key}={module}.builder", *(["scaling=per_tensor"] if key.startswith("scaling") else [])))
        assert f"{key}={module}.builder cannot be imported at " in str(refused.value), str(refused.value)
        assert said in str(refused.value) and f"{kind} must be importable" in str(refused.value)
    assert not [r for r in caplog.records if "Error loading" in r.getMessage() or "installed" in r.getMessage()]
