"""The native FP8 code path (torchao float8 training) on CPU, through torchao's own emulate=True mode: conversion,
module filter, optimiser, checkpoint/resume and the record run here as they would on an H100."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch

import bench.numerics.plan
import bench.numerics.precision
from bench.errors import ConfigError
from bench.numerics.hardware import NativeSupport
from bench.running.run import DeviceError, run_cell

pytest.importorskip("torchao.float8")


def _native_on_cpu(monkeypatch, native_format: str, why: str) -> None:
    """`native_format` counts as native (and fast) on this CPU; every other format as the CPU really has it."""
    support = bench.numerics.plan.native_support
    monkeypatch.setattr(bench.numerics.plan, "native_support", lambda fmt, device: NativeSupport(
        True, True, why) if fmt == native_format else support(fmt, device))


@pytest.fixture
def torchao_on_cpu(monkeypatch):
    """FP8 counts as native on this CPU, and torchao's recipes run with emulate=True."""
    recipe = bench.numerics.precision.torchao_float8_config
    monkeypatch.setattr(bench.numerics.precision, "torchao_float8_config",
                        lambda name="tensorwise": dataclasses.replace(recipe(name), emulate=True))
    _native_on_cpu(monkeypatch, "fp8", "test: torchao float8 with emulate=True on CPU")


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
    asked = make_cfg("format=fp8", "scaling=per_tensor", "format.backend=native", "train.max_steps=3",
                     "experiment_name=native_asked")
    with pytest.raises(ConfigError, match="nothing would run in FP8.*valid here: format.backend=auto or emulated"):
        run_cell(asked)  # a set-up problem: exit 2, no record
    assert not (Path(asked.results_dir) / asked.cell / "result.json").exists()


@pytest.mark.parametrize("scaling", ["per_tensor", "rowwise"])
def test_native_fp8_meets_the_gpu_kernels_multiple_of_16_with_a_head_on_one_token_per_example(
        make_cfg, monkeypatch, scaling):
    """torch._scaled_mm on CUDA refuses a GEMM whose inner dimension is not a multiple of 16. DistilBERT's
    pre-classifier sees one token per example, so its weight-gradient GEMM reduces over the batch (12 here):
    on an H100 this crashed with 'Expected trailing dimension of mat1 to be divisible by 16 but got mat1 shape:
    (768x12)'. Here torchao runs its real (non-emulated) path through _scaled_mm, which has the CUDA kernel's shape
    check and computes the kernel's arithmetic in FP32 (the shapes are under test: CPU _scaled_mm's own kernel took
    0.2 s for one 1536 x 64 x 128 GEMM on an Intel Xeon with AMX, the test a minute)."""
    inner_dims = []

    def scaled_mm_with_cuda_shape_check(a, b, *, scale_a, scale_b, bias=None, scale_result=None, out_dtype=None,
                                        use_fast_accum=False):
        inner_dims.append(a.shape[1])
        assert a.shape[1] % 16 == 0 and b.shape[0] % 16 == 0 and b.shape[1] % 16 == 0, (a.shape, b.shape)
        out = (a.float() * scale_a) @ (b.float() * scale_b) + (0 if bias is None else bias.float())
        return (out if scale_result is None else out * scale_result).to(out_dtype or a.dtype)

    monkeypatch.setattr(torch, "_scaled_mm", scaled_mm_with_cuda_shape_check)
    _native_on_cpu(monkeypatch, "fp8", "test: torchao float8 through a _scaled_mm with the CUDA shape check")
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
    assert recipes and recipes[0].round_scales_to_power_of_2
    assert recipes[0].cast_config_input.scaling_granularity.name == "AXISWISE"
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


@pytest.fixture
def torchao_mx_on_cpu(monkeypatch):
    """MXFP8 counts as native on this CPU, and torchao's MXFP8Linear runs its EMULATED kernels."""
    pytest.importorskip("torchao.prototype.moe_training.mxfp8_linear")
    from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

    monkeypatch.setattr(bench.numerics.precision, "torchao_mx_kernel", lambda: KernelPreference.EMULATED)
    _native_on_cpu(monkeypatch, "mxfp8", "test: torchao MXFP8Linear with its EMULATED kernels on CPU")


@pytest.mark.parametrize("tokens", [64, 12])
@pytest.mark.parametrize("scale_mode", ["rceil", "floor"])
def test_native_mxfp8_is_torchaos_mxfp8linear_and_our_emulation_of_its_recipe_equals_it_bit_for_bit(
        torchao_mx_on_cpu, tokens, scale_mode):
    """format=mxfp8 format.gradients=fp8_e4m3 (torchao's recipe): emulated (bench/numerics/blocks.py) and native
    (torchao's MXFP8Linear, tokens zero-padded to whole blocks) give the same output, input, weight and bias gradients
    to the bit, on a layer with a non-zero bias and rows of very different scales. torchao's own layer refuses 12
    tokens."""
    import copy

    from torchao.prototype.moe_training.mxfp8_linear import MXFP8Linear
    from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

    from bench.numerics.precision import Precision

    torch.manual_seed(0)
    base = torch.nn.Linear(96, 64)
    torch.nn.init.normal_(base.bias)
    x = torch.randn(tokens, 96) * torch.exp2(torch.randint(-6, 6, (tokens, 1)).float())
    grad = torch.randn(tokens, 64) * torch.exp2(torch.randint(-10, 4, (tokens, 1)).float())
    results = {}
    for backend in ("emulated", "native"):
        layer = copy.deepcopy(base)
        precision = Precision.of("mxfp8", torch.device("cpu"), mode="mixed", backend=backend, scale_mode=scale_mode,
                              gradients="fp8_e4m3")
        layer = precision.prepare(layer)
        xi = x.clone().requires_grad_(True)
        y = layer(xi)
        y.backward(grad)
        results[backend] = (y.detach(), xi.grad, layer.weight.grad, layer.bias.grad)
        assert type(layer).__name__ == {"emulated": "EmulatedLinear", "native": "PaddedMXFP8Linear"}[backend]
    for emulated, native in zip(results["emulated"], results["native"]):
        assert torch.equal(emulated, native)
    assert not torch.equal(results["native"][0], base(x).detach())  # it did round
    unpadded = MXFP8Linear(96, 64, kernel_preference=KernelPreference.EMULATED)
    if tokens % 32:
        with pytest.raises(AssertionError, match="divisible by block_size 32"):
            unpadded(x.clone().requires_grad_(True)).sum().backward()


def test_a_transformer_trains_natively_in_mxfp8_and_the_record_says_what_was_converted(make_cfg, torchao_mx_on_cpu):
    """DistilBERT's pre-classifier sees one token per example: 12 here, padded to a block of 32. FP32 elsewhere:
    torchao's EMULATED MX kernel (the CPU's) dequantises each operand to its own dtype and cannot multiply a BF16
    input by an FP32 weight; its GPU kernels write BF16 from any (checked only where one is lent)."""
    record = _record(make_cfg("model=distilbert_tiny", "model.batch_size=12", "format=mxfp8", "format.elsewhere=fp32",
                              "format.gradients=fp8_e4m3", "format.scale_mode=rceil", "train.max_steps=3"))
    assert record["status"] == "ok", record.get("traceback")
    precision = record["env"]["precision"]
    assert precision["backend"] == "native" and precision["native_recipe"].startswith("torchao MXFP8Linear")
    assert precision["element_formats"] == ["fp8_e4m3"] and precision["block"] is None
    modules = precision["fp8_modules"]
    assert len(modules["converted"]) == 13 and "pre_classifier" in modules["converted"]  # 2 layers x 6, and the head
    assert modules["kept_in_high_precision"] == ["classifier"] and 0 < modules["converted_flop_share"] <= 1


@pytest.mark.parametrize("overrides,reason", [
    (["model=bert_tiny"], "needs format.gradients=fp8_e4m3"),  # the MX paper's E5M2 gradients
    (["model=bert_tiny", "format.gradients=fp8_e4m3", "format.scale_mode=even"],
     "needs format.scale_mode=rceil or floor"),
    (["model=bert_tiny", "format.gradients=fp8_e4m3", "format.rounding=stochastic"], "needs format.rounding=nearest"),
    (["model=lenet", "format.gradients=fp8_e4m3"],
     "converts only Linear layers whose in and out features are multiples of 32"),
])
def test_mxfp8_outside_torchaos_recipe_is_emulated_and_native_refused(make_cfg, torchao_mx_on_cpu, overrides, reason):
    record = _record(make_cfg("format=mxfp8", "train.max_steps=2", *overrides))
    precision = record["env"]["precision"]
    assert record["status"] == "ok" and precision["backend"] == "emulated" and reason in precision["backend_reason"]
    asked = make_cfg("format=mxfp8", "train.max_steps=2", "format.backend=native", "experiment_name=native_asked",
                     *overrides)
    if overrides[0] == "model=lenet":  # found when the model is converted: a set-up problem all the same
        with pytest.raises(ConfigError, match=reason):
            run_cell(asked)
        assert not (Path(asked.results_dir) / asked.cell / "result.json").exists()
    else:
        with pytest.raises(DeviceError, match=reason):
            run_cell(asked)


# A plug-in (every rank of a distributed cell imports it) doing what the torchao_on_cpu fixture does in this process.
TORCHAO_ON_CPU = '''
import dataclasses

import bench.numerics.plan as plan
import bench.numerics.precision as precision
from bench.numerics.hardware import NativeSupport

_support, _recipe = plan.native_support, precision.torchao_float8_config
plan.native_support = lambda fmt, device: NativeSupport(True, True, "test: torchao float8, emulate=True, on CPU") \\
    if fmt == "fp8" else _support(fmt, device)
precision.torchao_float8_config = lambda name="tensorwise": dataclasses.replace(_recipe(name), emulate=True)
'''


def test_fsdp2_gathers_torchaos_float8_weights_in_fp8_one_byte_each_and_fp32_params_train_the_same(tmp_path, make_cfg):
    """parallel.fp8_all_gather (torchao's enable_fsdp_float8_all_gather, its scales precomputed after each step): two
    ranks of BERT-tiny under FSDP2, natively through torchao's tensorwise recipe (emulate=True on this CPU). Each
    converted weight's shard is all-gathered as uint8, a byte an element where FP32 took four; everything else still
    in FP32. With FP32 parameters the weight is cast once either way, from the same values with the same scale: the
    training is the same, bit for bit. Elsewhere (this CPU, FP8 emulated) the cell is refused, naming why."""
    import os
    import subprocess
    import sys

    from bench.tasks import build_task

    (tmp_path / "torchao_fp8_on_cpu.py").write_text(TORCHAO_ON_CPU)
    overrides = ["model=bert_tiny", "parallel=fsdp2", "format=fp8", "scaling=per_tensor", "train.max_steps=4"]
    sweep = subprocess.run(
        [sys.executable, "-m", "bench.run", "-m", *overrides, "parallel.fp8_all_gather=false,true",
         "plugins=[torchao_fp8_on_cpu]", f"results_dir={tmp_path / 'results'}", "hydra/launcher=local"],
        cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=300,
        env=os.environ | {"PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
                          "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"})
    records = {r["config"]["parallel"]["fp8_all_gather"]: r for r in
               (json.loads(p.read_text()) for p in (tmp_path / "results").rglob("result.json"))}
    assert sorted(records) == [False, True], sweep.stdout[-2000:] + sweep.stderr[-2000:]
    assert all(r["status"] == "ok" for r in records.values()), [r.get("reason") for r in records.values()]
    plain, gathered = records[False], records[True]
    assert gathered["parallel"]["fp8_all_gather"] and gathered["env"]["precision"]["backend"] == "native"
    converted = gathered["env"]["precision"]["fp8_modules"]["converted"]
    modules = dict(build_task(make_cfg(*overrides).model, torch.device("cpu"), 0).model.named_modules())
    elements = sum(modules[name].weight.numel() for name in converted)
    sent = {r["parallel"]["fp8_all_gather"]: r["parallel"]["collective_bytes_first_step"] for r in records.values()}
    # each rank hands in its half of every weight, in the forward and again in the backward (FSDP2 reshards after
    # the forward): three bytes fewer an element each time
    assert sent[False]["all_gather"] - sent[True]["all_gather"] == 2 * (4 - 1) * elements // 2
    assert sent[False]["reduce_scatter"] == sent[True]["reduce_scatter"]  # gradients: FP32 either way
    assert gathered["metrics"]["final_train_loss"] == plain["metrics"]["final_train_loss"]

    cfg = make_cfg(*overrides, "parallel.fp8_all_gather=true")  # no plug-in: on this CPU FP8 is emulated
    with pytest.raises(DeviceError, match="parallel.fp8_all_gather gathers torchao's float8 weights: it needs"):
        run_cell(cfg)


def test_the_native_paths_autocast_layers_are_the_layers_torchao_left(torchao_on_cpu):
    """Under format.elsewhere=bf16 autocast computes the Linears torchao did not convert (here a head of 10 outputs,
    not a multiple of 16), never torchao's own Float8Linear: one rule (precision._autocast_layers) on every path."""
    from torch import nn

    from bench.numerics.precision import Precision

    precision = Precision.of("fp8", torch.device("cpu"), "per_tensor", mode="mixed", backend="auto", elsewhere="bf16")
    precision.prepare(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10)))
    assert precision.native and precision.conversion["converted"] == ["0"]
    assert precision.autocast_layers == ["2"] == precision.conversion["kept_in_high_precision"]
