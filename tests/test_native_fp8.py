"""The native FP8 code path (torchao float8 training) on CPU, through torchao's own emulate=True mode: conversion,
module filter, optimiser, checkpoint/resume and the record run here as they would on an H100."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch

import bench.precision
from bench.device import NativeSupport
from bench.run import DeviceError, run_cell

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


def test_lenet_fp8_is_emulated_where_torchao_would_convert_nothing(make_cfg, torchao_on_cpu):
    """torchao's % 16 filter leaves every LeNet layer in high precision: a native run would train in FP32 and be
    recorded as FP8 (it was, on an H100: the default sweep's fp8 x per_tensor cell matched FP32 to the digit).
    auto emulates it and says why; an explicit format.backend=native fails the cell, naming the valid choices."""
    record = _record(make_cfg("format=fp8", "scaling=per_tensor", "train.max_steps=3"))
    precision = record["env"]["precision"]
    assert record["status"] == "ok" and precision["backend"] == "emulated" and precision["fp8_modules"] is None
    assert precision["backend_reason"].startswith("torchao's float8 training converts only Linear layers")
    assert record["numerics"]["quantisation"]["activations"]["values_sampled"] > 0  # the emulation rounded
    refused = _record(make_cfg("format=fp8", "scaling=per_tensor", "format.backend=native", "train.max_steps=3",
                               "experiment_name=native_asked"))
    assert refused["status"] == "failed" and "nothing would run in FP8" in refused["reason"]
    assert "format.backend=auto or emulated" in refused["reason"] and not refused["metrics"]


@pytest.mark.parametrize("scaling", ["per_tensor", "rowwise"])
def test_native_fp8_meets_the_gpu_kernels_multiple_of_16_with_a_head_on_one_token_per_example(
        make_cfg, monkeypatch, scaling):
    """torch._scaled_mm on CUDA refuses a GEMM whose inner dimension is not a multiple of 16. DistilBERT's
    pre-classifier sees one token per example, so its weight-gradient GEMM reduces over the batch (12 here):
    on an H100 this crashed with 'Expected trailing dimension of mat1 to be divisible by 16 but got mat1 shape:
    (768x12)'. Here torchao runs its real (non-emulated) path through CPU _scaled_mm, with the CUDA kernel's
    shape check added."""
    cpu_scaled_mm = torch._scaled_mm
    inner_dims = []

    def scaled_mm_with_cuda_shape_check(a, b, **kwargs):
        inner_dims.append(a.shape[1])
        assert a.shape[1] % 16 == 0 and b.shape[0] % 16 == 0 and b.shape[1] % 16 == 0, (a.shape, b.shape)
        return cpu_scaled_mm(a, b, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", scaled_mm_with_cuda_shape_check)
    support = bench.precision.native_support
    monkeypatch.setattr(bench.precision, "native_support", lambda fmt, device: NativeSupport(
        True, True, "test: torchao float8 through CPU _scaled_mm") if fmt == "fp8" else support(fmt, device))
    record = _record(make_cfg("model=distilbert_tiny", "format=fp8", f"scaling={scaling}", "model.batch_size=12",
                              "train.max_steps=2"))
    assert record["status"] == "ok", record.get("reason")
    assert record["env"]["precision"]["backend"] == "native" and "pre_classifier" in \
        record["env"]["precision"]["fp8_modules"]["converted"]
    assert 12 not in inner_dims and 16 in inner_dims  # the batch of 12 CLS tokens, zero-padded to 16


def test_the_native_fp8_path_resumes_from_its_checkpoint(make_cfg, torchao_on_cpu):
    cfg = make_cfg("model=bert_tiny", "format=fp8", "scaling=per_tensor", "train.max_steps=4",
                   "train.keep_checkpoint=true")
    first = _record(cfg)
    (Path(cfg.results_dir) / cfg.cell / "result.json").unlink()  # as if killed while evaluating
    second = _record(cfg)
    assert second["status"] == "ok" and second["metrics"] == first["metrics"]
    state = torch.load(Path(cfg.results_dir) / cfg.cell / "checkpoint.pt", weights_only=False)
    assert state["loop"]["steps"] == 4


@pytest.mark.parametrize("scaling", ["rowwise", "rowwise_with_gw_hp"])
def test_rowwise_scalings_run_torchaos_recipe_of_that_name_natively(make_cfg, torchao_on_cpu, monkeypatch, scaling):
    import torchao.float8

    recipes = []
    convert = torchao.float8.convert_to_float8_training
    monkeypatch.setattr(torchao.float8, "convert_to_float8_training",
                        lambda model, config, **kw: recipes.append(config) or convert(model, config=config, **kw))
    record = _record(make_cfg("model=bert_tiny", "format=fp8", f"scaling={scaling}", "train.max_steps=4"))
    assert record["status"] == "ok", record.get("traceback")
    precision = record["env"]["precision"]
    assert precision["backend"] == "native" and precision["native_recipe"].startswith(f"torchao float8 {scaling} ")
    assert recipes and recipes[0].round_scales_to_power_of_2 and recipes[0].cast_config_input.scaling_granularity.name == "AXISWISE"
    assert len(precision["fp8_modules"]["converted"]) == 12 and precision["block"] is None
    high_precision_grad_weight = recipes[0].cast_config_input_for_grad_weight is not None and \
        recipes[0].cast_config_input_for_grad_weight.scaling_type.name == "DISABLED"
    assert high_precision_grad_weight == (scaling == "rowwise_with_gw_hp")


def test_block_scaling_is_emulated_even_where_fp8_is_native(make_cfg, torchao_on_cpu):
    record = _record(make_cfg("model=bert_tiny", "format=fp8", "scaling=block", "train.max_steps=2"))
    precision = record["env"]["precision"]
    assert record["status"] == "ok" and precision["backend"] == "emulated"
    assert "Float8BlockScaling is not wired in" in precision["backend_reason"]


@pytest.mark.parametrize("scaling", ["per_tensor", "rowwise"])
def test_stochastic_fp8_gradients_are_emulated_where_torchao_would_round_to_nearest(make_cfg, torchao_on_cpu, scaling):
    record = _record(make_cfg("model=bert_tiny", "format=fp8", f"scaling={scaling}", "format.rounding=stochastic",
                              "train.max_steps=2"))
    precision = record["env"]["precision"]
    assert record["status"] == "ok" and precision["backend"] == "emulated"
    assert precision["backend_reason"].startswith("stochastic rounding of gradients exists only as emulation")
    assert precision["rounding_of_gradients"] == "stochastic"
    with pytest.raises(DeviceError, match="torchao's float8 recipes round to nearest.*format.backend=auto or emulated"):
        run_cell(make_cfg("model=bert_tiny", "format=fp8", f"scaling={scaling}", "format.rounding=stochastic",
                          "format.backend=native", "train.max_steps=2", "experiment_name=native_asked"))
