"""Every config option composes; bad input fails before training, naming the valid choices."""

import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from bench.running.config import ConfigError, check
from tests.conftest import CONF

GROUPS = {g: sorted(p.stem for p in (CONF / g).glob("*.yaml"))
          for g in ("model", "format", "scaling", "logger", "experiment")}


# Options that extend another one (a tiny model, a Lightning-style format alias, MindSpore's scalers).
ALIASES = {"distilbert_tiny": "distilbert", "bert_tiny": "bert_base", "fp16-true": "fp16", "bf16-true": "bf16",
           "mindspore_fixed": "static", "mindspore_dynamic": "dynamic"}


@pytest.mark.parametrize("group,option", [(g, o) for g, opts in GROUPS.items() for o in opts])
def test_every_group_option_composes(make_cfg, group, option):
    fp8_recipe = option in ("rowwise", "rowwise_with_gw_hp", "block")
    cfg = make_cfg(f"{group}={option}", *(["format=fp8"] if fp8_recipe else []))
    if group == "experiment":
        assert cfg.experiment_name == option
    else:
        assert cfg[group].name == ALIASES.get(option, option)
    check(cfg)


@pytest.mark.parametrize("mode_override", ["format.mode=true", "format.mode=mixed"])
def test_mode_true_is_accepted_despite_yaml_booleans(make_cfg, mode_override):
    cfg = make_cfg("format=bf16", mode_override)
    check(cfg)
    assert cfg.format.mode == mode_override.split("=")[1]
    assert cfg.cell.endswith(f"bf16-{cfg.format.mode}/none/seed0")


@pytest.mark.parametrize("overrides,message", [
    (["format=fp8", "format.mode=true"], r"format=fp8.*valid: mixed"),
    (["format=fp32", "format.mode=mixed"], r"format=fp32.*valid: true"),
    (["format.overflow=wrap"], "saturate, inf, nan"),
    (["format.backend=fast"], "auto, native, emulated"),
    (["device=tpu"], "auto, cpu, cuda, xla"),
    (["train.max_steps=0"], ">= 1"),
    (["model=bert_tiny", "model.doc_stride=60"], "doc_stride"),
    (["model=distilbert_tiny", "model.data.split=[0.5,0.5]"], "3 fractions"),
    (["model=distilbert_tiny", "model.data.source=digits"], "hub, local"),
    (["model.data.source=local"], "digits, hub"),
])
def test_bad_choices_and_combinations_name_the_valid_ones(make_cfg, overrides, message):
    with pytest.raises(ConfigError, match=message):
        check(make_cfg(*overrides))


def test_an_unknown_setting_of_when_fused_graphs_are_made_names_the_valid_ones(make_cfg, monkeypatch):
    from bench.numerics import fused

    monkeypatch.setenv(fused.COMPILE_WHEN, "sometimes")
    with pytest.raises(ConfigError, match="PRECISION_BENCH_FUSED_COMPILE='sometimes'.*valid: when-paid, at-once"):
        check(make_cfg())


def _bench(tmp_path, *args):
    return subprocess.run([sys.executable, "-m", "bench.run", *args, f"results_dir={tmp_path}"],
                          capture_output=True, text=True, cwd=CONF.parent, timeout=120)


@pytest.mark.parametrize("args,valid", [
    (["format=fp12"], ["bf16", "fp16", "fp32", "fp8", "tf32"]),
    (["scaling=magic"], ["dynamic", "none", "static"]),
    (["format.nosuchkey=1"], ["nosuchkey"]),
    (["model.doc_stride=64"], ["doc_stride"]),  # a BERT-only key on LeNet
])
def test_unknown_options_exit_nonzero_and_write_nothing(tmp_path, args, valid):
    out = _bench(tmp_path, *args)
    assert out.returncode != 0
    assert all(v in out.stderr for v in valid), out.stderr[-2000:]
    assert not list(Path(tmp_path).rglob("result.json"))


def test_sweep_checks_every_cell_before_training_any(tmp_path):
    out = _bench(tmp_path, "-m", "format=fp32,tf32", "format.backend=native", "device=cpu", "train.max_steps=2")
    assert out.returncode == 2, out.stderr[-2000:]
    assert "format=tf32" in out.stderr and "valid here: format.backend=auto or emulated" in out.stderr
    assert not list(Path(tmp_path).rglob("result.json"))


def test_existing_records_survive_a_rejected_run(tmp_path):
    ok = _bench(tmp_path, "train.max_steps=2")
    assert ok.returncode == 0, ok.stderr[-2000:]
    record = next(Path(tmp_path).rglob("result.json"))
    # a single run says where its record went and its verdict, on one line, once (its log said it again)
    said = ok.stdout.strip().splitlines()[-1]
    assert said.endswith(f"record: {record}") and ": ok: " in said and "test_accuracy " in said, ok.stdout
    assert (ok.stdout + ok.stderr).count(f"record: {record}") == 1, ok.stdout
    before = record.read_bytes()
    assert _bench(tmp_path, "train.max_steps=2", "format.overflow=wrap").returncode == 2
    assert record.read_bytes() == before


def test_every_swept_value_gets_its_own_cell_and_a_rerun_skips_them_all(tmp_path):
    """Keys outside the path (the learning rate) and options that share a method name (mindspore_fixed is a
    static scaler) used to land in one directory, and the second cell aborted the sweep."""
    grid = ["-m", "scaling=static,mindspore_fixed", "model.optimizer.lr=0.01,0.001", "train.max_steps=2"]
    first = _bench(tmp_path, *grid)
    assert first.returncode == 0, first.stderr[-2000:]
    cells = sorted(str(p.parent.relative_to(tmp_path)) for p in Path(tmp_path).rglob("result.json"))
    assert cells == [f"default/lenet/fp32-true/{s}/seed0,model.optimizer.lr={lr},train.max_steps=2"
                     for s in ("mindspore_fixed", "static") for lr in ("0.001", "0.01")]
    again = _bench(tmp_path, *grid)
    assert again.returncode == 0 and "(4 skipped as already recorded)" in again.stderr, again.stderr[-2000:]


def test_a_sweep_ends_by_writing_each_runs_stalled_verdict_into_its_record(tmp_path):
    """Three seeds of one cell: each judged against the other two (bench/running/learning.py), and the verdict, with
    its numbers, written into its record; nothing here stalled, so the summary names no run."""
    from bench.running.record import read_record

    out = _bench(tmp_path, "-m", "seed=0,1,2", "train.max_steps=20", "train.log_every=2")
    assert out.returncode == 0 and "stalled" not in out.stderr, out.stderr[-2000:]
    verdicts = [read_record(p)["numerics"]["stalled"] for p in sorted(Path(tmp_path).rglob("result.json"))]
    assert len(verdicts) == 3 and all(v["stalled"] is False and v["siblings"] == 2 for v in verdicts)


def test_cells_that_would_share_a_place_stop_the_sweep_before_any_trains(tmp_path):
    out = _bench(tmp_path, "-m", "format=fp32,fp16", "cell=one/place", "train.max_steps=2")
    assert out.returncode == 2 and "would write to the same place (one/place)" in out.stderr, out.stderr[-2000:]
    assert not list(Path(tmp_path).rglob("result.json"))


def test_the_same_configuration_spelled_twice_runs_once(tmp_path):
    out = _bench(tmp_path, "-m", "format=fp16-true,fp16", "format.mode=true", "train.max_steps=2")
    assert out.returncode == 0 and "the same configuration as" in out.stdout + out.stderr, out.stderr[-2000:]
    assert len(list(Path(tmp_path).rglob("result.json"))) == 1


@pytest.mark.parametrize("args", [["-m", "experiment=smok"], ["experiment=smok"]])
def test_an_unknown_preset_is_an_error_naming_the_valid_ones(tmp_path, args):
    out = _bench(tmp_path, *args)
    assert out.returncode != 0 and all(name in out.stderr for name in GROUPS["experiment"]), out.stderr[-2000:]
    assert not list(Path(tmp_path).rglob("result.json"))


@pytest.mark.parametrize("args,message", [
    (["+train.max_step=5"], "train.max_step (did you mean train.max_steps?)"),
    (["+model.foo=1"], "unknown config key: model.foo"),
    (["-m", "+format.dither=true"], "unknown config key: format.dither"),
])
def test_keys_that_no_schema_declares_are_rejected_however_they_are_added(tmp_path, args, message):
    out = _bench(tmp_path, *args)
    assert out.returncode == 2 and message in out.stderr, out.stderr[-2000:]
    assert not list(Path(tmp_path).rglob("result.json"))


def test_help_lists_only_real_models_and_schemas_are_not_choices(tmp_path):
    shown = subprocess.run([sys.executable, "-m", "bench.run", "--help"], cwd=CONF.parent, capture_output=True,
                           text=True).stdout
    assert ("model: bert_base, bert_mlm, bert_mlm_tiny, bert_tiny, charlm, distilbert, distilbert_mlm_tiny, "
            "distilbert_tiny, lenet\n") in shown and "schema" not in shown
    out = _bench(tmp_path, "model=lenet_schema")
    assert out.returncode == 2
    assert "model=lenet_schema is not an option; valid: bert_base, bert_mlm, bert_mlm_tiny, bert_tiny" in out.stderr


def test_an_unusable_results_dir_stops_a_sweep_before_anything_starts(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    out = subprocess.run([sys.executable, "-m", "bench.run", "-m", "format=fp32,fp16", f"results_dir={blocker}/runs"],
                         capture_output=True, text=True, cwd=CONF.parent, timeout=120)
    assert out.returncode == 2 and f"results_dir={blocker}/runs: {blocker} is not a directory" in out.stderr


# run_ids and cell paths computed by the code before models declared `model.task` (c94ab73): the declaration is
# not part of a run's identity, so existing records stay the runs a resumed sweep finds. Records of fp8 and the
# block formats made before 0.2.0 ran FP32 elsewhere: `format.elsewhere=fp32` finds them.
KNOWN_IDS = [
    (["model=lenet", "format=fp32", "scaling=none"], "2d7e73f0ab5244d0", "default/lenet/fp32-true/none/seed0"),
    (["model=lenet", "format=bf16", "scaling=dynamic", "seed=2"], "0c38239560a8266b",
     "default/lenet/bf16-mixed/dynamic/seed2"),
    (["model=charlm", "format=fp8", "scaling=per_tensor", "format.elsewhere=fp32"], "3f917ca44e1eb5e5",
     "default/charlm/fp8-mixed/per_tensor/seed0"),
    (["model=bert_tiny", "format=mxfp8", "scaling=none", "format.elsewhere=fp32"], "45c3475f8564e03c",
     "default/bert_base/mxfp8-mixed/none/seed0"),
    (["model=distilbert_tiny", "format=fp16-true", "scaling=static", "model.optimizer.lr=0.01"], "22fa6c19b1bb2f62",
     "default/distilbert/fp16-true/static/seed0"),
    (["experiment=unit_scaling_charlm", "scaling=unit"], "551160a8d0281025",
     "unit_scaling_charlm/charlm/fp32-true/unit/seed0"),
    (["experiment=block_formats", "format=nvfp4", "format.elsewhere=fp32"], "93400bba97180de0",
     "block_formats/lenet/nvfp4-mixed/none/seed0"),
    # since 0.2.0 fp8 and the block formats default to BF16 elsewhere: new runs, in places of their own
    (["model=charlm", "format=fp8", "scaling=per_tensor"], "65a913c8d47a1515",
     "default/charlm/fp8-mixed/per_tensor/seed0,format.elsewhere=bf16"),
    (["experiment=block_formats", "format=nvfp4"], "e0db67f28a19a3ac",
     "block_formats/lenet/nvfp4-mixed/none/seed0,format.elsewhere=bf16"),
]


@pytest.mark.parametrize("overrides, known_id, known_cell", KNOWN_IDS)
def test_run_ids_and_cells_of_existing_records_are_unchanged(overrides, known_id, known_cell):
    from hydra import compose, initialize_config_dir

    from bench.running.identity import run_id

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    assert (run_id(OmegaConf.to_container(cfg, resolve=True)), cfg.cell) == (known_id, known_cell)
    assert cfg.model.task._target_  # every shipped model declares itself
