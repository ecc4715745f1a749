"""Precision policy: TF32 flags, where emulation rounds, native/emulated decisions."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from bench.numerics.formats import quantise_value
from bench.numerics.precision import Precision, PrecisionError

CPU = torch.device("cpu")


def _linear_and_input(seed=0):
    torch.manual_seed(seed)
    layer = nn.Linear(64, 32)
    return layer, torch.randn(16, 64)


FLAG_NAMES = [(torch.backends.cuda.matmul, "fp32_precision"), (torch.backends.cudnn.conv, "fp32_precision"),
              (torch.backends.cudnn.rnn, "fp32_precision"), (torch.backends.mkldnn.matmul, "fp32_precision"),
              (torch.backends.mkldnn.conv, "fp32_precision")]


def _flags() -> list[str]:
    return [getattr(obj, name) for obj, name in FLAG_NAMES]


def test_fp32_has_tf32_off_and_tf32_has_it_on_while_the_cell_runs_and_not_after():
    """A plan names the flags; only the cell's run sets them (precision.fp32_flags()), and its end puts back what
    was there, whatever that was."""
    before = _flags()
    fp32, tf32 = (Precision.of(fmt, CPU, mode="true", backend="auto") for fmt in ("fp32", "tf32"))
    assert _flags() == before  # building a precision touches nothing global
    assert fp32.flags["cuda_matmul"] == fp32.flags["cudnn_conv"] == fp32.flags["cudnn_rnn"] == "ieee"
    assert tf32.flags["cuda_matmul"] == tf32.flags["cudnn_conv"] == "tf32"
    assert tf32.flags["mkldnn_matmul"] == "ieee"  # CPU rounding is decided by emulation, never by oneDNN
    for precision, value in ((fp32, "ieee"), (tf32, "tf32")):
        with precision.fp32_flags():
            assert _flags() == [value, value, value, "ieee", "ieee"]
        assert _flags() == before
    torch.backends.cuda.matmul.fp32_precision = "tf32"  # someone else's setting survives a cell
    try:
        with fp32.fp32_flags():
            assert torch.backends.cuda.matmul.fp32_precision == "ieee"
        assert torch.backends.cuda.matmul.fp32_precision == "tf32"
    finally:
        torch.backends.cuda.matmul.fp32_precision = before[0]


def test_the_device_matrix_doctor_predictions_and_the_preflight_leave_torchs_flags_as_they_found_them(make_cfg):
    """What decides many cells without training one: each plans on (simulated) devices, none sets a flag."""
    from bench.running.run import preflight
    from bench.speed.model import recipe_on
    from bench.speed.profiles import gpu
    from bench.speed.trace import trace_cell
    from bench.tools import doctor, matrix

    original = torch.backends.cuda.matmul.fp32_precision
    torch.backends.cuda.matmul.fp32_precision = "tf32"  # not what a 32-true cell runs under: a change would show
    try:
        before = _flags()
        matrix.markdown()
        doctor.precision_rows(CPU)
        for fmt in ("fp32", "tf32", "bf16", "fp8"):
            cfg = make_cfg(f"format={fmt}")
            preflight(cfg)
            recipe_on(cfg, trace_cell(cfg), gpu("H100"))
        assert _flags() == before
    finally:
        torch.backends.cuda.matmul.fp32_precision = original


def test_emulated_tf32_rounding_is_visible_in_a_matmul():
    layer, x = _linear_and_input()
    exact = layer(x)
    precision = Precision.of("tf32", CPU, mode="true", backend="emulated")
    layer = precision.prepare(layer)
    expected = F.linear(quantise_value(x, "tf32"), quantise_value(layer.weight, "tf32"), layer.bias)
    assert torch.equal(layer(x), expected)
    assert not torch.equal(layer(x), exact)
    assert (layer(x) - exact).abs().max() < 1e-2


@pytest.mark.parametrize("fmt", ["fp16", "bf16"])
def test_emulated_sixteen_bit_mixed_rounds_inputs_output_and_gradients(fmt):
    layer, x = _linear_and_input()
    x.requires_grad_(True)
    layer = Precision.of(fmt, CPU, mode="mixed", backend="emulated").prepare(layer)
    y = layer(x)
    q = lambda t: quantise_value(t, fmt)
    assert torch.equal(y, q(F.linear(q(x), q(layer.weight), q(layer.bias))))
    grad_out = torch.randn_like(y) * 1e-3
    y.backward(grad_out)
    expected_grad_x = q(q(grad_out) @ q(layer.weight))
    assert torch.equal(x.grad, expected_grad_x)
    assert torch.equal(layer.weight.grad, q(q(grad_out).T @ q(x.detach())))


def test_emulated_fp8_uses_e4m3_forward_and_e5m2_gradients_and_keeps_outputs_fp32():
    layer, x = _linear_and_input()
    x.requires_grad_(True)
    layer = Precision.of("fp8", CPU, mode="mixed", backend="emulated").prepare(layer)
    y = layer(x)
    e4m3 = lambda t: quantise_value(t, "fp8_e4m3")
    assert torch.equal(y, F.linear(e4m3(x), e4m3(layer.weight), layer.bias))
    grad_out = torch.randn_like(y)
    y.backward(grad_out)
    assert torch.equal(x.grad, quantise_value(grad_out, "fp8_e5m2") @ e4m3(layer.weight))


@pytest.mark.parametrize("per_tensor", [False, True], ids=["unscaled", "per_tensor"])
def test_stochastic_fp8_rounds_only_the_gradients_entering_the_backward_and_is_unbiased_there(per_tensor):
    """format.rounding=stochastic with tensorwise FP8: the forward is exactly the nearest-rounding forward; the
    output gradient enters the backward on E5M2's grid (scaled and unscaled by its per-tensor scale), differs from
    RNE, and averages to the exact gradient over seeded draws where RNE's error does not average out."""
    from bench.numerics.formats import FORMATS
    from bench.numerics.scaling import PerTensorScale

    layer, x = _linear_and_input()
    grad_out = torch.randn(16, 32) * 2.0**-14  # E5M2's subnormals: coarse enough that rounding shows
    scaling = "per_tensor" if per_tensor else "none"  # per_tensor: current amax, no margin: PerTensorScale(spec)
    nearest, stochastic = (Precision.of("fp8", CPU, scaling, mode="mixed", backend="emulated", rounding=r)
                           for r in ("nearest", "stochastic"))
    scale = PerTensorScale(FORMATS["fp8_e4m3"]).scale_for(layer.weight) if per_tensor else 1.0
    exact_grad_x = grad_out @ (quantise_value(layer.weight * scale, "fp8_e4m3") / scale)  # the weight the GEMM took
    stochastic_layer = stochastic.prepare(_linear_and_input()[0])
    nearest_layer = nearest.prepare(_linear_and_input()[0])
    assert torch.equal(stochastic_layer(x), nearest_layer(x))
    grads = []
    for draw in range(400):
        torch.manual_seed(draw)
        xi = x.clone().requires_grad_(True)
        stochastic_layer(xi).backward(grad_out)
        grads.append(xi.grad)
    xi = x.clone().requires_grad_(True)
    nearest_layer(xi).backward(grad_out)
    grads = torch.stack(grads)
    assert not torch.equal(grads[0], xi.grad) and not torch.equal(grads[0], grads[1])
    assert (grads.mean(0) - exact_grad_x).abs().mean() < (xi.grad - exact_grad_x).abs().mean() / 4
    assert stochastic.describe()["rounding_of_gradients"] == "stochastic"
    refusal = "format.rounding applies to fp8, mxfp8, mxfp6, mxfp4, nvfp4, nvfp4_recipe, not to format=fp16"
    with pytest.raises(PrecisionError, match=refusal):
        Precision.of("fp16", CPU, mode="mixed", backend="emulated", rounding="stochastic")


def test_true_mode_emulation_keeps_parameters_and_optimiser_state_in_format():
    layer, x = _linear_and_input()
    precision = Precision.of("fp16", CPU, mode="true", backend="emulated")
    layer = precision.prepare(layer)
    opt = torch.optim.Adam(layer.parameters(), lr=1e-3)
    layer(x).square().mean().backward()
    precision.after_backward(layer)
    opt.step()
    precision.after_step(layer, opt)
    tensors = [*layer.parameters(), *(p.grad for p in layer.parameters()),
               *(v for s in opt.state.values() for v in s.values() if v.dim() > 0)]
    assert all(torch.equal(t, t.half().float()) for t in tensors)


def test_state_dict_keys_survive_emulation():
    layer, _ = _linear_and_input()
    keys = list(layer.state_dict())
    layer = Precision.of("fp8", CPU, mode="mixed", backend="emulated").prepare(layer)
    assert list(layer.state_dict()) == keys


def test_backend_decisions_are_explicit(monkeypatch):
    monkeypatch.setattr("bench.numerics.hardware._cpu_flags", lambda: frozenset({"avx512f"}))
    assert Precision.of("fp16", CPU, mode="mixed", backend="auto").backend == "emulated"  # slow CPU fp16: emulate
    assert Precision.of("bf16", CPU, mode="mixed", backend="auto").backend == "emulated"
    monkeypatch.setattr("bench.numerics.hardware._cpu_flags", lambda: frozenset({"avx512_bf16"}))
    auto_bf16 = Precision.of("bf16", CPU, mode="mixed", backend="auto")
    assert auto_bf16.backend == "native" and "avx512_bf16" in auto_bf16.why
    assert Precision.of("fp16", CPU, mode="mixed", backend="native").backend == "native"  # torch has CPU fp16 kernels
    with pytest.raises(PrecisionError, match="no native path on cpu"):
        Precision.of("tf32", CPU, mode="true", backend="native")
    with pytest.raises(PrecisionError, match="no native path on cpu"):
        Precision.of("fp8", CPU, mode="mixed", backend="native")


def test_every_tensor_stream_has_its_own_site():
    """A delayed per-tensor scale must see one stream's amaxes only: weight and bias, and the three
    gradients a 16-bit kernel returns, never share a history."""
    layer, _ = _linear_and_input()
    layer = Precision.of("fp16", CPU, "per_tensor", mode="mixed", backend="emulated").prepare(layer)
    c = layer.casts
    sites = [c.activation, c.weight, c.bias, c.grad_activation, c.grad_weight, c.grad_bias, c.grad_output, c.output]
    assert len({id(s) for s in sites}) == len(sites)
    fp8 = nn.Linear(4, 4)
    fp8 = Precision.of("fp8", CPU, mode="mixed", backend="emulated").prepare(fp8)
    assert fp8.casts.bias is None and fp8.casts.grad_weight is None  # FP8 GEMMs keep bias and outputs wide


@pytest.mark.parametrize("overrides, kwargs", [
    (["format=fp16", "format.rounding=stochastic"], dict(fmt="fp16", rounding="stochastic")),
    (["format=fp32", "format.scale_mode=ceil"], dict(fmt="fp32", mode="true", scale_mode="ceil")),
    (["format=mxfp6", "format.gradients=fp8_e4m3"], dict(fmt="mxfp6", gradients="fp8_e4m3")),
    (["format=mxfp8", "scaling=per_tensor"], dict(fmt="mxfp8", scaling="per_tensor")),
    (["format=bf16", "scaling=rowwise"], dict(fmt="bf16", scaling="rowwise")),
    (["format=fp16", "format.mode=half"], dict(fmt="fp16", mode="half")),
])
def test_the_config_check_and_precision_refuse_a_mistake_in_one_wording(make_cfg, overrides, kwargs):
    """One validation path (PrecisionConfig): what `python -m bench.run` says before training is what Precision
    says when a tool builds one directly."""
    from bench.running.config import check

    with pytest.raises(PrecisionError) as from_check:
        check(make_cfg(*overrides))
    args = {"mode": "mixed", "backend": "emulated"} | kwargs
    with pytest.raises(PrecisionError) as from_precision:
        Precision.of(args.pop("fmt"), CPU, **args)
    assert str(from_check.value) == str(from_precision.value)


def test_a_swapped_module_holds_the_same_tensors_and_the_original_is_left_alone():
    """bench/numerics/swap.py: prepare puts an EmulatedLinear in each Linear's place holding the same Parameter
    objects (an optimiser built before, a tie, the state-dict keys all still hold), the model itself included when
    it is one Linear; evaluation in full precision swaps torchao's Linears out and back."""
    from bench.numerics.chain import EmulatedChain
    from bench.numerics.emulation import EmulatedLinear
    from bench.numerics.swap import restore, swap_modules, with_state_of

    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    weights, keys = [m.weight for m in model if isinstance(m, nn.Linear)], set(model.state_dict())
    hooked = []
    model[0].register_forward_hook(lambda *_: hooked.append(1))
    prepared = Precision.of("fp16", CPU, mode="mixed", backend="emulated").prepare(model)
    assert [type(m) for m in model] == [EmulatedLinear, nn.ReLU, EmulatedLinear]
    # a chain of emulated ops (bench/numerics/chain.py) comes back as an EmulatedChain holding the model's modules
    assert isinstance(prepared, EmulatedChain) and list(prepared) == list(model) and set(prepared.state_dict()) == keys
    assert [m.weight for m in model if isinstance(m, nn.Linear)] == weights and set(model.state_dict()) == keys
    model(torch.randn(2, 4))
    prepared(torch.randn(2, 4))
    assert hooked == [1, 1]  # the old module's hook came along, and a hooked chain runs its modules one by one
    bare = nn.Linear(4, 4)
    swapped_in = Precision.of("fp16", CPU, mode="mixed", backend="emulated").prepare(bare)
    assert type(bare) is nn.Linear and type(swapped_in) is EmulatedLinear and swapped_in.weight is bare.weight
    replaced = swap_modules(model, lambda _, m: with_state_of(nn.Linear, m) if isinstance(m, EmulatedLinear) else None)
    assert [type(m) for m in model] == [nn.Linear, nn.ReLU, nn.Linear] and set(replaced) == {"0", "2"}
    restore(model, replaced)
    assert [type(m) for m in model] == [EmulatedLinear, nn.ReLU, EmulatedLinear]


def test_an_ops_input_casts_are_one_node_that_rounds_and_draws_as_three_cast_nodes_did():
    """bench/numerics/emulation.py _InputCasts: x, weight and bias rounded forward in that order, their gradients
    backward in the order autograd ran three `cast` nodes (bias, weight, x), each site drawing from the global
    generator here, as a stochastic rounding would: the same gradients, bit for bit, and the same draws."""
    from types import SimpleNamespace

    from bench.numerics.emulation import _InputCasts, cast

    def run(merged: bool):
        torch.manual_seed(0)
        order = []

        def site(name):
            def rounded(t):
                order.append(name)
                return quantise_value(t + 1e-3 * torch.rand(t.shape), "bf16")
            return rounded

        casts = SimpleNamespace(**{name: site(name) for name in ("activation", "weight", "bias", "grad_activation",
                                                                 "grad_weight", "grad_bias")})
        x, w, b = (torch.randn(*shape, requires_grad=True) for shape in ((4, 3), (5, 3), (5,)))
        inputs = _InputCasts.apply(casts, False, x, w, b) if merged else (
            cast(x, casts.activation, casts.grad_activation), cast(w, casts.weight, casts.grad_weight),
            cast(b, casts.bias, casts.grad_bias))
        F.linear(*inputs).square().sum().backward()
        return order, [t.grad for t in (x, w, b)]

    (three_order, three_grads), (one_order, one_grads) = run(merged=False), run(merged=True)
    assert one_order == three_order == ["activation", "weight", "bias", "grad_bias", "grad_weight", "grad_activation"]
    assert all(torch.equal(a, b) for a, b in zip(three_grads, one_grads))
    # an input that wants no gradient (the batch into the first layer) gives an output that wants none: the op's
    # backward then skips that gradient (LeNet FP8's first convolution: 0.8 ms a step, had it not)
    rounding = SimpleNamespace(activation=None, weight=None, bias=None)
    batch, weight = torch.randn(4, 3), torch.randn(5, 3, requires_grad=True)
    assert [t.requires_grad for t in _InputCasts.apply(rounding, False, batch, weight, None)[:2]] == [False, True]


@pytest.mark.parametrize("gemm, x_shape, w_shape, bias, wanted", [
    ("linear", (8, 16), (4, 16), True, (True, True, True)),
    ("linear", (2, 6, 16), (4, 16), True, (True, True, True)),
    ("linear", (2, 6, 16), (4, 16), False, (True, True, False)),
    ("linear", (16, 8), (4, 16), True, (True, True, True)),  # x column-major (transposed below)
    ("linear", (8, 16), (4, 16), True, (False, True, True)),
    ("conv", (2, 3, 9, 9), (4, 3, 3, 3), True, (True, True, True)),
    ("conv", (2, 4, 9, 9), (6, 2, 3, 3), False, (False, True, False)),
])
def test_an_exact_emulated_ops_backward_is_torchs_autograd_bit_for_bit(gemm, x_shape, w_shape, bias, wanted):
    """An emulated Linear or convolution is one autograd node (bench/numerics/emulation.py _EmulatedOp) computing the
    backward torch's autograd computes for F.linear (addmm, or mm without a bias; a column-major input's gradient
    column-major) and F.conv2d (stride, padding, dilation, groups): the same bits on the same operands."""
    from bench.numerics.emulation import ConvGemm, LinearGemm

    torch.manual_seed(0)
    groups = x_shape[1] // w_shape[1]
    op = LinearGemm() if gemm == "linear" else ConvGemm((2, 1), (1, 2), (1, 2), groups)
    x = torch.randn(x_shape)
    x = x.t() if gemm == "linear" and x_shape[0] == 16 else x
    x.requires_grad_(wanted[0])
    w = torch.randn(w_shape, requires_grad=wanted[1])
    b = torch.randn(w_shape[0], requires_grad=wanted[2]) if bias else None
    y = op.forward(x, w, b)
    g = torch.randn_like(y)
    inputs = [t for t, want in zip((x, w, b), wanted) if want]
    reference = iter(torch.autograd.grad(y, inputs, g))
    ours = op.backward(g, x.detach(), w.detach(), wanted)
    for want, mine in zip(wanted, ours):
        if want:
            expected = next(reference)
            assert mine.shape == expected.shape and torch.equal(mine, expected)
        else:
            assert mine is None
