"""format.accumulation: emulated Linear GEMMs accumulated as a GPU's tensor cores do (bench/numerics/tensor_cores.py),
each of the three on the codes its rounding sites made, descaled after, FP8 fast or promoted per GEMM as asked; exact
accumulation unchanged; the config refusing what the model does not cover, before anything trains."""

import pytest
import torch
from torch import nn

from bench.numerics.formats import quantise_value
from bench.numerics.precision import Precision
from bench.numerics.tensor_cores import matmul
from bench.running.config import ConfigError, check
from tests.conftest import eager_tensor_core_kernels

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def eager_kernels(monkeypatch):
    """Compiling each small shape here would cost more than running it."""
    eager_tensor_core_kernels(monkeypatch)


def _linear(fmt, scaling, accumulation, seed=0, k=256, out=24):
    torch.manual_seed(seed)
    layer = nn.Linear(k, out)
    precision = Precision.of(fmt, CPU, scaling, accumulation=accumulation, backend="emulated")
    return precision.prepare(layer), precision


def _step(layer, seed=1, k=256, positive=False, tokens=40):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(tokens, k, generator=g) * 3).requires_grad_()
    if positive:  # a running sum that only grows: fast accumulation's lost bits show
        x = x.detach().abs().requires_grad_()
        layer.weight.data.abs_()
    y = layer(x)
    y.backward(torch.randn(y.shape, generator=g))
    return x, y


def test_each_gemm_is_the_tensor_core_model_on_the_sites_codes_descaled_after():
    """FP8 tensorwise with format.accumulation=H100 (torchao's choice: the output GEMM fast, both backward GEMMs
    promoted every 128): forward and both gradients equal tensor_cores.matmul on E4M3/E5M2 codes, recomputed here
    from the per-tensor scales (448 / amax, 57344 / amax), times the inverse scales; the bias added after, its
    gradient the rounded output gradient summed in FP32."""
    layer, _ = _linear("fp8", "per_tensor", "H100")
    x, y = _step(layer)
    g = torch.Generator().manual_seed(1)
    torch.randn(40, 256, generator=g)
    grad = torch.randn(y.shape, generator=g)

    def codes(t, fmt, top):
        scale = top / t.detach().abs().max()
        return quantise_value(t.detach() * scale, fmt), scale

    (xq, xs), (wq, ws), (gq, gs) = (codes(x, "fp8_e4m3", 448.0), codes(layer.weight, "fp8_e4m3", 448.0),
                                    codes(grad, "fp8_e5m2", 57344.0))
    out = matmul(xq, wq, gpu="H100", a_format="fp8_e4m3") * (xs.reciprocal() * ws.reciprocal())
    assert torch.equal(y.detach(), out + layer.bias.detach())
    grad_x = matmul(gq, wq.t(), gpu="H100", a_format="fp8_e5m2", b_format="fp8_e4m3", promote_every=128)
    assert torch.equal(x.grad, grad_x * (gs.reciprocal() * ws.reciprocal()))
    grad_w = matmul(gq.t(), xq.t(), gpu="H100", a_format="fp8_e5m2", b_format="fp8_e4m3", promote_every=128)
    assert torch.equal(layer.weight.grad, grad_w * (gs.reciprocal() * xs.reciprocal()))
    assert torch.equal(layer.bias.grad, (gq / gs).sum(0))  # the bias's: the rounded gradient summed, as before


def test_fast_and_promoted_differ_where_k_spans_promotions_and_exact_is_unchanged():
    """Each GEMM reducing over 160 (two promotion intervals: in features, out features, tokens), positive operands:
    H100-fast and H100-promoted differ in all three GEMMs; H100 (torchao's mix) is fast in the forward and promoted
    in the backward; exact is the emulation without the key, bit for bit."""
    runs = {}
    for accumulation in ("exact", "H100", "H100-fast", "H100-promoted", None):
        layer, _ = _linear("fp8", "per_tensor", accumulation or "exact", k=160, out=160)
        if accumulation is None:
            assert layer.accumulation is None
        x, y = _step(layer, positive=True, k=160, tokens=160)
        runs[accumulation] = (y.detach(), x.grad, layer.weight.grad)
    fast, promoted, mixed = runs["H100-fast"], runs["H100-promoted"], runs["H100"]
    assert not any(torch.equal(f, p) for f, p in zip(fast, promoted))
    assert torch.equal(mixed[0], fast[0]) and torch.equal(mixed[1], promoted[1]) and torch.equal(mixed[2], promoted[2])
    assert all(torch.equal(a, b) for a, b in zip(runs["exact"], runs[None]))
    assert not torch.equal(runs["exact"][0], promoted[0])


def test_a_site_codes_come_back_exactly_from_its_values_and_scale():
    """value * scale, rounded again, is the codes the site made: over scales that are not powers of two, both FP8
    formats, subnormal codes and BF16 under autocast's widening."""
    from bench.numerics.emulation import _operand

    g = torch.Generator().manual_seed(0)
    for fmt in ("fp8_e4m3", "fp8_e5m2"):
        layer, precision = _linear("fp8", "per_tensor", "H100")
        site = layer.casts.activation if fmt == "fp8_e4m3" else layer.casts.grad_output
        for trial in range(20):
            x = torch.randn(64, 64, generator=g) * torch.exp2(torch.randn(64, 64, generator=g) * 4) * 10 ** (trial - 10)
            value = site(x)
            codes = quantise_value(x * site.last_scale, fmt)
            assert torch.equal(_operand(value, site)[0], codes)
            assert torch.equal(_operand(value.bfloat16(), site)[0], codes)


def test_bf16_accumulation_rounds_no_scale_and_keeps_the_sixteen_bit_output():
    """BF16-mixed on H100's model: codes are the BF16 values themselves, the output written in BF16 as before."""
    layer, _ = _linear("bf16", "none", "H100", k=64)
    x, y = _step(layer, k=64)
    xq, wq = quantise_value(x.detach(), "bf16"), quantise_value(layer.weight.detach(), "bf16")
    bias = quantise_value(layer.bias.detach(), "bf16")
    want = quantise_value(matmul(xq, wq, gpu="H100", a_format="bf16") + bias, "bf16")
    assert torch.equal(y.detach(), want)


@pytest.mark.parametrize("overrides,message", [
    (["format=bf16", "format.accumulation=V100"], "valid: exact, A100, Ada, H100, H200, B200"),
    (["format=fp8", "format.accumulation=A100"], "operands e4m3 and e5m2.*valid: exact, Ada, Ada-fast, Ada-promoted"),
    (["format=bf16", "format.accumulation=H100-fast"], "valid: exact, A100, Ada, H100"),
    (["format=mxfp8", "format.accumulation=H100"], "block-scaled GEMMs.*valid there: format.accumulation=exact"),
    (["format=fp32", "format.mode=true", "format.accumulation=H100"], "FP32 GEMMs run on CUDA cores"),
    (["format=fp8", "scaling=rowwise", "format.accumulation=H100"], "scales rows or tiles.*scaling=per_tensor"),
])
def test_an_uncovered_accumulation_is_refused_naming_the_valid_choices(make_cfg, overrides, message):
    with pytest.raises(ConfigError, match=message):
        check(make_cfg("model=lenet", *overrides))


def test_a_convolution_is_an_implicit_gemm_on_its_patches():
    """Conv2d (stride 2, padding 2) with format.accumulation=H100: its output is the tensor-core GEMM of the E4M3
    codes of its input's patches (im2col) against the flattened weight, descaled, plus the bias; the weight gradient
    the promoted GEMM of the E5M2 gradient codes against the patches."""
    import torch.nn.functional as F

    torch.manual_seed(0)
    conv = nn.Conv2d(3, 8, 5, padding=2, stride=2)
    layer = Precision.of("fp8", CPU, "per_tensor", accumulation="H100", backend="emulated").prepare(conv)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 3, 15, 15, generator=g).requires_grad_()
    y = layer(x)
    grad = torch.randn(y.shape, generator=g)
    y.backward(grad)
    codes = lambda t, fmt, top: (quantise_value(t.detach() * (top / t.detach().abs().max()), fmt),
                                 top / t.detach().abs().max())
    (xq, xs), (wq, ws), (gq, gs) = (codes(x, "fp8_e4m3", 448.0), codes(layer.weight, "fp8_e4m3", 448.0),
                                    codes(grad, "fp8_e5m2", 57344.0))
    patches = F.unfold(xq, 5, padding=2, stride=2).transpose(1, 2).reshape(-1, 75)  # (positions, C x 5 x 5)
    out = matmul(patches, wq.reshape(8, -1), gpu="H100", a_format="fp8_e4m3") * (xs.reciprocal() * ws.reciprocal())
    want = (out + layer.bias.detach()).reshape(2, 64, 8).transpose(1, 2).reshape(2, 8, 8, 8)
    assert torch.equal(y.detach(), want)
    g_rows = gq.reshape(2, 8, 64).transpose(1, 2).reshape(-1, 8)
    grad_w = matmul(g_rows.t(), patches.t(), gpu="H100", a_format="fp8_e5m2", b_format="fp8_e4m3", promote_every=128)
    assert torch.equal(layer.weight.grad, (grad_w * (gs.reciprocal() * xs.reciprocal())).reshape(8, 3, 5, 5))
    grad_patches = matmul(g_rows, wq.reshape(8, -1).t(), gpu="H100", a_format="fp8_e5m2", b_format="fp8_e4m3",
                          promote_every=128) * (gs.reciprocal() * ws.reciprocal())
    grad_x = F.fold(grad_patches.reshape(2, 64, 75).transpose(1, 2), (15, 15), 5, padding=2, stride=2)
    assert torch.equal(x.grad, grad_x)


def test_an_accumulating_step_holds_what_the_format_stores(make_cfg):
    """The memory a record counts is the format's, however its GEMMs accumulate: LeNet in FP8 with per-tensor scales,
    one step, with format.accumulation=H100 against exact accumulation: every category equal but the activations,
    which hold the ten FP32 scales the scaled GEMMs save besides (a convolution saves its input's codes, not its
    patches, and each GEMM's codes count at a byte: the H100 step counted 3.7 times exact's)."""
    from bench.running.run import run_cell

    args = ("format=fp8", "scaling=per_tensor", "train.max_steps=1")
    exact, tensor_cores = (run_cell(make_cfg(*args, f"format.accumulation={a}"))["memory"]["step"]
                           for a in ("exact", "H100"))
    scales = 5 * 2 * 4  # LeNet's five GEMMs, an input's and a weight's scale each
    assert tensor_cores == exact | {"activations": exact["activations"] + scales,
                                    "total": exact["total"] + scales}


def test_a_convolution_without_one_implicit_gemm_is_refused_before_it_trains():
    from bench.numerics.plan import PrecisionError

    precision = Precision.of("fp8", CPU, "per_tensor", accumulation="H100", backend="emulated")
    with pytest.raises(PrecisionError, match="0 has groups=2; valid: groups=1 with numeric padding, or "
                                             "format.accumulation=exact"):
        precision.prepare(nn.Sequential(nn.Conv2d(4, 4, 3, groups=2)))


def test_an_accumulating_cell_trains_records_its_model_and_is_another_run(make_cfg):
    from omegaconf import OmegaConf

    from bench.running.identity import cell_path, run_id
    from bench.running.run import run_cell

    ident = lambda cfg: run_id(OmegaConf.to_container(cfg, resolve=True))
    args = ("model=bert_tiny", "format=fp8", "scaling=per_tensor", "train.max_steps=2", "train.log_every=1",
            "model.batch_size=4", "train.eval_precision=fp32")
    cell = make_cfg(*args, "format.accumulation=H100-promoted")
    record = run_cell(cell)
    assert record["status"] == "ok", record["reason"]
    described = record["env"]["precision"]["accumulation"]
    assert described["tensor_cores"] == "H100" and described["gemms"]["output"] == "promoted to FP32 every 128"
    exact = make_cfg(*args)
    assert ident(cell) != ident(exact) and ident(make_cfg(*args, "format.accumulation=exact")) == ident(exact)
    assert "format.accumulation" in cell_path(cell, {}, [])


def test_a_compiled_step_is_refused_and_auto_runs_eagerly_saying_why(make_cfg):
    """train.compile=true cannot trace through the model's own compiled kernels: exit 2 before training; auto runs
    the step eagerly on any device, the record saying why."""
    from bench.running.compile import CompiledStep

    with pytest.raises(ConfigError, match="train.compile=true with format.accumulation=H100.*valid: "
                                          "train.compile=auto"):
        check(make_cfg("model=lenet", "format=fp8", "format.accumulation=H100", "train.compile=true"))
    precision = Precision.of("bf16", CPU, accumulation="H100", backend="emulated")
    step = CompiledStep.for_task(None, torch.device("cuda"), task=None, precision=precision)
    assert not step.enabled and "format.accumulation=H100" in step.eager_because
