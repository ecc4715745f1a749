"""Evaluation in the precision the cell trained in (train.eval_precision=trained, the default) or in FP32: a native and
an emulated cell of one setting evaluate alike; fp32 turns every rounding site, autocast and torchao layer off; nothing
an evaluation does changes training. And the loss a char-LM reports is the loss it trains (u-μP's multiplier too)."""

import copy
import importlib.util

import pytest
import torch
from torch import nn

from bench.numerics.precision import Precision
from bench.numerics.scaling_methods import PerTensor
from bench.running.run import run_cell
from bench.tasks.charlm import charlm_task
from tests.conftest import char_data as _data

CPU = torch.device("cpu")


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16))


def _on_bf16_grid(t: torch.Tensor) -> bool:
    return torch.equal(t.float(), t.float().to(torch.bfloat16).float())


@pytest.mark.parametrize("backend", ["native", "emulated"])
def test_native_and_emulated_bf16_cells_evaluate_in_bf16_and_fp32_evaluates_in_fp32(backend):
    reference = _mlp()
    model = copy.deepcopy(reference)
    precision = Precision.of("bf16", CPU, mode="mixed", backend=backend)
    model = precision.prepare(model)
    x = torch.randn(8, 32)
    with torch.no_grad():
        with precision.evaluating(model, "trained") as cast_inputs:
            trained = model(cast_inputs(x))
        with precision.evaluating(model, "fp32") as cast_inputs:
            fp32 = model(cast_inputs(x))
        plain = reference(x)
    assert _on_bf16_grid(trained)  # the last GEMM wrote bf16, natively (autocast) or emulated (its output site)
    assert precision.evaluated_in("trained") == ("bf16-mixed" if backend == "native" else "bf16-mixed (emulated)")
    assert fp32.dtype == torch.float32 and torch.equal(fp32, plain)  # FP32 inference of the same weights
    assert not _on_bf16_grid(fp32) and precision.evaluated_in("fp32") == "32-true"
    with torch.no_grad():  # and the rounding sites are back once the fp32 evaluation ended
        assert _on_bf16_grid(model(precision.inputs(x))) if backend == "emulated" else True


def test_a_whole_model_bf16_cast_is_widened_for_fp32_evaluation_and_narrowed_back_exactly():
    model = _mlp()
    precision = Precision.of("bf16", CPU, mode="true", backend="native")
    model = precision.prepare(model)
    before = [p.detach().clone() for p in model.parameters()]
    x = torch.randn(8, 32)
    with torch.no_grad(), precision.evaluating(model, "fp32") as cast_inputs:
        assert all(p.dtype == torch.float32 for p in model.parameters())
        out = model(cast_inputs(x))
    assert out.dtype == torch.float32
    assert all(p.dtype == torch.bfloat16 and torch.equal(p, b) for p, b in zip(model.parameters(), before))


@pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="needs torchao")
def test_torchaos_fp8_linears_compute_in_fp32_while_evaluating_in_fp32():
    from torchao.float8 import convert_to_float8_training

    from bench.numerics.native import torchao_converts, torchao_float8_config

    reference = _mlp()
    config = torchao_float8_config()
    model = convert_to_float8_training(copy.deepcopy(reference), config=type(config)(**{**config.__dict__,
                                                                                       "emulate": True}),
                                       module_filter_fn=torchao_converts)
    kinds = [type(m).__name__ for m in model]
    precision = Precision.of("fp32", CPU, mode="true", backend="auto")
    x = torch.randn(8, 32)
    with torch.no_grad():
        fp8 = model(x)
        with precision.evaluating(model, "fp32"):
            fp32 = model(x)
        assert torch.equal(fp32, reference(x)) and not torch.equal(fp8, fp32)
    assert [type(m).__name__ for m in model] == kinds == ["Float8Linear", "ReLU", "Float8Linear"]


def test_an_evaluation_leaves_a_delayed_amax_history_and_the_telemetry_as_they_were():
    model = _mlp()

    delayed = PerTensor(name="per_tensor", amax="delayed", history_len=4)
    precision = Precision.of("fp8", CPU, delayed, mode="mixed", backend="emulated")
    model = precision.prepare(model)
    precision.telemetry.sampling = True
    model(torch.randn(8, 32)).sum().backward()  # a training step fills the histories
    histories = [list(s.history) for s in precision._site_scales]
    counted = precision.telemetry.end_step()
    precision.telemetry.sampling = True
    with torch.no_grad(), precision.evaluating(model) as cast_inputs:
        model(cast_inputs(100 * torch.randn(8, 32)))
    assert [list(s.history) for s in precision._site_scales] == histories and histories[0]
    assert precision.telemetry.sampling and precision.telemetry.end_step() == {} and counted


def _charlm(make_cfg, text_file, *overrides):
    return make_cfg("model=charlm", "model.data.source=local", f"model.data.path={text_file}", "model.data.sha256=null",
                    "model.iterations=20", "model.arch.layers=2", "model.arch.embedding=32", "model.arch.block_size=16",
                    "train.log_every=10", *overrides)


@pytest.mark.parametrize("fmt", ["fp8", "fp32"])
def test_eval_precision_fp32_evaluates_the_same_training_in_fp32(make_cfg, text_file, fmt, tmp_path):
    """The same cell trained once more with train.eval_precision=fp32 (another run: its own run_id): the same
    training, to the bit; the validation loss differs where the cell's format rounds (FP8 GEMMs, BF16 elsewhere), not
    where it does not (FP32)."""
    from omegaconf import OmegaConf

    from bench.running.identity import run_id

    trained = run_cell(_charlm(make_cfg, text_file, f"format={fmt}"))
    cfg = _charlm(make_cfg, text_file, f"format={fmt}", "train.eval_precision=fp32", f"results_dir={tmp_path}/fp32")
    in_fp32 = run_cell(cfg)
    assert trained["status"] == in_fp32["status"] == "ok"
    assert trained["metrics"]["final_train_loss"] == in_fp32["metrics"]["final_train_loss"]
    assert in_fp32["metrics"]["evaluated_in"] == "32-true"
    assert in_fp32["run_id"] == run_id(OmegaConf.to_container(cfg, resolve=True)) != trained["run_id"]
    if fmt == "fp8":
        assert trained["metrics"]["evaluated_in"] == "fp8-mixed (bf16 elsewhere) (emulated)"
        assert trained["metrics"]["val_loss"] != in_fp32["metrics"]["val_loss"]
    else:
        assert trained["metrics"]["evaluated_in"] == "32-true"
        assert trained["metrics"]["val_loss"] == in_fp32["metrics"]["val_loss"]


def test_the_validation_loss_is_the_loss_the_task_trains_with_umups_output_multiplier(text_file):
    """scaling.output_mult=2: u-μP trains on cross_entropy(2 * logits); evaluation reported F.cross_entropy(logits)."""
    from omegaconf import OmegaConf

    from bench.numerics.umup import UmupHyper, umup_task

    cfg = OmegaConf.create({"iterations": 2, "batch_size": 4, "eval_batch_size": 7,
                            "arch": {"layers": 1, "heads": 2, "embedding": 16, "block_size": 32, "dropout": 0.0,
                                     "bias": False, "norm": "pre"}, "data": _data(path=str(text_file))})
    task = charlm_task(cfg, CPU, seed=0)
    umup_task(task, UmupHyper(output_mult=2.0))
    metrics = task.evaluate(task.model, lambda x: x)
    from bench.tasks.charlm import encode, validation_windows

    _, val, _ = encode(text_file.read_text(), 0.9)
    x, y = validation_windows(val, 32)
    with torch.no_grad():
        logits = 2.0 * task.model(x).double()  # by hand: the softmax of twice the logits, per token
        per_token = torch.logsumexp(logits, -1) - logits.gather(-1, y[..., None])[..., 0]
    assert metrics["val_loss"] == pytest.approx(float(per_token.mean()), rel=1e-5)
    assert metrics["val_window_loss_std"] == pytest.approx(float(per_token.mean(1).std()), rel=1e-4)
    with torch.no_grad():
        assert abs(float(per_token.mean()) - float(nn.functional.cross_entropy(logits.flatten(0, 1) / 2,
                                                                                y.flatten()))) > 0.01
