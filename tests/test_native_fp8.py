"""The native FP8 code path (torchao float8 training) on CPU, through torchao's own emulate=True mode: conversion,
module filter, optimiser, checkpoint/resume and the record run here as they would on an H100."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch

import bench.precision
from bench.device import NativeSupport
from bench.run import run_cell

pytest.importorskip("torchao.float8")


@pytest.fixture
def torchao_on_cpu(monkeypatch):
    """FP8 counts as native on this CPU, and torchao's recipes run with emulate=True."""
    recipe = bench.precision.torchao_float8_config
    monkeypatch.setattr(bench.precision, "torchao_float8_config",
                        lambda name="tensorwise": dataclasses.replace(recipe(name), emulate=True))
    support = bench.precision.native_support
    monkeypatch.setattr(bench.precision, "native_support", lambda fmt, device: NativeSupport(
        True, True, "test: torchao float8 with emulate=True on CPU") if fmt == "fp8" else support(fmt, device))


def _record(cfg) -> dict:
    run_cell(cfg)
    return json.loads((Path(cfg.results_dir) / cfg.cell / "result.json").read_text())


def test_a_transformer_trains_through_torchao_and_the_record_says_what_was_converted(make_cfg, torchao_on_cpu):
    record = _record(make_cfg("model=bert_tiny", "format=fp8", "scaling=per_tensor", "train.max_steps=4"))
    assert record["status"] == "ok", record.get("traceback")
    precision = record["env"]["precision"]
    assert precision["backend"] == "native" and precision["native_recipe"].startswith("torchao float8 tensorwise")
    modules = precision["fp8_modules"]
    assert len(modules["converted"]) == 12  # 2 layers x (query, key, value, output, intermediate, output)
    assert modules["kept_in_high_precision"] == ["qa_outputs"]  # 64 -> 2: not a multiple of 16
    assert 0.5 < modules["converted_flop_share"] < 1


def test_lenet_native_fp8_is_shown_for_what_it_is_nothing_converted(make_cfg, torchao_on_cpu):
    """torchao's % 16 filter leaves every LeNet layer in high precision: the record must say so."""
    record = _record(make_cfg("format=fp8", "scaling=per_tensor", "train.max_steps=3"))
    modules = record["env"]["precision"]["fp8_modules"]
    assert record["status"] == "ok" and modules["converted"] == [] and modules["converted_flop_share"] == 0
    assert modules["kept_in_high_precision"] == ["0", "3", "7", "9", "11"]


def test_the_native_fp8_path_resumes_from_its_checkpoint(make_cfg, torchao_on_cpu):
    cfg = make_cfg("model=bert_tiny", "format=fp8", "scaling=per_tensor", "train.max_steps=4",
                   "train.keep_checkpoint=true")
    first = _record(cfg)
    (Path(cfg.results_dir) / cfg.cell / "result.json").unlink()  # as if killed while evaluating
    second = _record(cfg)
    assert second["status"] == "ok" and second["metrics"] == first["metrics"]
    state = torch.load(Path(cfg.results_dir) / cfg.cell / "checkpoint.pt", weights_only=False)
    assert state["loop"]["steps"] == 4


def test_rowwise_scaling_runs_torchaos_rowwise_recipe_natively(make_cfg, torchao_on_cpu, monkeypatch):
    import torchao.float8

    recipes = []
    convert = torchao.float8.convert_to_float8_training
    monkeypatch.setattr(torchao.float8, "convert_to_float8_training",
                        lambda model, config, **kw: recipes.append(config) or convert(model, config=config, **kw))
    record = _record(make_cfg("model=bert_tiny", "format=fp8", "scaling=rowwise", "train.max_steps=4"))
    assert record["status"] == "ok", record.get("traceback")
    precision = record["env"]["precision"]
    assert precision["backend"] == "native" and precision["native_recipe"].startswith("torchao float8 rowwise")
    assert recipes and recipes[0].round_scales_to_power_of_2 and recipes[0].cast_config_input.scaling_granularity.name == "AXISWISE"
    assert len(precision["fp8_modules"]["converted"]) == 12 and precision["block"] is None


def test_block_scaling_is_emulated_even_where_fp8_is_native(make_cfg, torchao_on_cpu):
    record = _record(make_cfg("model=bert_tiny", "format=fp8", "scaling=block", "train.max_steps=2"))
    precision = record["env"]["precision"]
    assert record["status"] == "ok" and precision["backend"] == "emulated"
    assert "Float8BlockScaling is not wired in" in precision["backend_reason"]


def test_stochastic_rowwise_gradients_are_emulated_where_torchao_would_round_to_nearest(make_cfg, torchao_on_cpu):
    record = _record(make_cfg("model=bert_tiny", "format=fp8", "scaling=rowwise", "format.rounding=stochastic",
                              "train.max_steps=2"))
    precision = record["env"]["precision"]
    assert record["status"] == "ok" and precision["backend"] == "emulated"
    assert precision["backend_reason"].startswith("stochastic rounding of gradients exists only as emulation")
    assert precision["block"]["rounding_of_gradients"] == "stochastic"
