"""format.elsewhere: FP8 and the block formats with everything outside their converted GEMMs in BF16 autocast, as
torchao's float8 training, Transformer Engine and DeepSeek-V3 run them; FP32 there (the default) as before."""

import json
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from bench.numerics.precision import Precision, PrecisionError
from bench.running.config import check
from bench.running.identity import run_id

CPU = torch.device("cpu")


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_an_emulated_gemm_under_bf16_autocast_is_the_fp32_gemm_of_its_operands_handed_on_in_bf16(fmt):
    """The operands already hold the format's values: the GEMM runs on them in FP32 and writes BF16 (an FP8 GEMM's
    output under autocast), never a BF16 GEMM that would round them again (NVFP4's FP32 tensor scale does not fit)."""
    torch.manual_seed(0)
    layer, x = torch.nn.Linear(64, 32), torch.randn(8, 64)
    plain = Precision.of(fmt, CPU, mode="mixed", backend="emulated").prepare(layer)
    with torch.no_grad():
        reference = plain(x)
    elsewhere = Precision.of(fmt, CPU, mode="mixed", backend="emulated", elsewhere="bf16")
    with torch.no_grad(), elsewhere.autocast():
        y = plain(x)  # the same emulated layer, under the BF16 autocast format.elsewhere=bf16 adds
    assert y.dtype == torch.bfloat16 and torch.equal(y, reference.to(torch.bfloat16))


def test_under_bf16_autocast_an_emulated_fp8_layers_gradient_is_rounded_once_in_fp32_to_the_same_values():
    """The BF16 gradient reaching an emulated FP8 layer is widened for its FP32 backward anyway: its E5M2 rounding
    takes the widened FP32 tensor (no BF16 pass of its own), the layer with its casts to and from BF16 is one
    autograd node, and every gradient equals the reference: E5M2 of the BF16 gradient, through the FP32 GEMMs of
    the E4M3 operands, the input's gradient handed back in BF16."""
    from bench.numerics import emulation
    from bench.numerics.formats import quantise_value

    torch.manual_seed(0)
    layer, x = torch.nn.Linear(64, 32), torch.randn(8, 64)
    weight, bias = layer.weight.detach().clone(), layer.bias.detach().clone()
    precision = Precision.of("fp8", CPU, mode="mixed", backend="emulated", elsewhere="bf16")
    model = precision.prepare(layer)
    seen = []
    rounds = emulation.TensorSite._round
    emulation.TensorSite._round = lambda site, t: seen.append((site.tensor_class, t.dtype)) or rounds(site, t)
    try:
        x_bf16 = x.to(torch.bfloat16).requires_grad_()
        with precision.autocast():
            y = model(x_bf16)
        upstream = torch.randn(8, 32).to(torch.bfloat16) * 1e-3
        y.backward(upstream)
    finally:
        emulation.TensorSite._round = rounds
    assert ("gradients", torch.float32) in seen and ("gradients", torch.bfloat16) not in seen
    nodes, stack = [], [y.grad_fn]
    while stack:  # the layer's backward graph: one node, then the leaves
        node = stack.pop()
        nodes.append(type(node).__name__)
        stack.extend(next_node for next_node, _ in node.next_functions if next_node is not None)
    assert nodes[0] == "_EmulatedOpBackward" and set(nodes[1:]) == {"AccumulateGrad"}, nodes
    x_e4m3, w_e4m3 = quantise_value(x_bf16.detach().float(), "fp8_e4m3"), quantise_value(weight, "fp8_e4m3")
    assert torch.equal(y, torch.nn.functional.linear(x_e4m3, w_e4m3, bias).to(torch.bfloat16))
    g = quantise_value(upstream.float(), "fp8_e5m2")
    assert x_bf16.grad.dtype == torch.bfloat16 and torch.equal(x_bf16.grad, (g @ w_e4m3).to(torch.bfloat16))
    assert torch.equal(model.weight.grad, (x_e4m3.t() @ g).t()) and torch.equal(model.bias.grad, g.sum(0))


def test_bf16_elsewhere_runs_the_rest_of_a_cell_in_bf16_and_says_so(make_cfg):
    from bench.reporting.aggregate import summarise, to_frame
    from bench.reporting.tables import precision_table
    from bench.running.run import run_cell

    cells = {}
    for elsewhere in ("fp32", "bf16"):
        cfg = make_cfg("model=bert_tiny", "format=fp8", "scaling=per_tensor", f"format.elsewhere={elsewhere}",
                       "train.max_steps=3", f"experiment_name=elsewhere_{elsewhere}")  # composed outside a sweep
        run_cell(cfg)
        cells[elsewhere] = json.loads((Path(cfg.results_dir) / cfg.cell / "result.json").read_text())
    bf16 = cells["bf16"]["env"]["precision"]
    assert (bf16["elsewhere"], bf16["label"]) == ("bf16", "fp8-mixed (bf16 elsewhere) (emulated)")
    assert cells["fp32"]["env"]["precision"]["label"] == "fp8-mixed (emulated)"
    assert cells["bf16"]["metrics"]["final_train_loss"] != cells["fp32"]["metrics"]["final_train_loss"]
    frame = to_frame([r | {"_dir": None} for r in cells.values()])
    table = precision_table(summarise(frame))
    assert sorted(table["setting"]) == ["fp8-mixed (bf16 elsewhere) †", "fp8-mixed †"]


def test_elsewhere_fp32_is_the_run_it_always_was_and_bf16_the_recipes_default(make_cfg):
    """Before 0.2.0 fp8 and the block formats ran FP32 elsewhere (no key, or null); now their yaml says bf16."""
    configs = {value: make_cfg("format=fp8", *([f"format.elsewhere={value}"] if value else []))
               for value in (None, "null", "fp32", "bf16")}
    ids = {value: run_id(OmegaConf.to_container(cfg, resolve=True)) for value, cfg in configs.items()}
    assert ids["null"] == ids["fp32"] != ids["bf16"] == ids[None]
    assert configs["fp32"].cell == configs["null"].cell == "default/lenet/fp8-mixed/none/seed0"
    assert configs[None].cell == configs["bf16"].cell == "default/lenet/fp8-mixed/none/seed0,format.elsewhere=bf16"
    for fmt in ("fp8", "mxfp8", "mxfp6", "mxfp4", "nvfp4"):
        assert make_cfg(f"format={fmt}").format.elsewhere == "bf16"


@pytest.mark.parametrize("overrides, message", [
    (["format=bf16", "format.elsewhere=bf16"], "format.elsewhere=bf16 applies to the formats of the GEMM operands only "
                                                "(fp8, mxfp8, mxfp6, mxfp4, nvfp4, nvfp4_recipe), not to format=bf16"),
    (["format=fp8", "format.elsewhere=fp16"], "format.elsewhere='fp16' is not valid; valid: fp32, bf16"),
])
def test_elsewhere_is_refused_where_it_means_nothing(make_cfg, overrides, message):
    with pytest.raises(PrecisionError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check(make_cfg(*overrides))


def _exact_operands(*shapes, seed=0):
    """Small integers times powers of two: every product and partial sum is exact in FP32, so any order of
    accumulation gives the same sum and a GEMM's result depends on its rounding alone (to BF16, at the end)."""
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randint(-15, 16, shape, generator=generator) * 2.0 ** torch.randint(-3, 4, shape,
                                                                                       generator=generator))
            .float().requires_grad_() for shape in shapes]


GEMM_CALLS = {  # each as a model may spell it; with its operands' shapes
    "conv2d": (lambda x, w, b: torch.nn.functional.conv2d(x, w, b), ((4, 3, 9, 9), (5, 3, 3, 3), (5,))),
    "linear": (lambda x, w, b: torch.nn.functional.linear(x, w, b), ((7, 40), (24, 40), (24,))),
    "matmul (@)": (lambda a, b: a @ b, ((2, 6, 40), (2, 40, 6))),
    "baddbmm": (lambda c, a, b: torch.baddbmm(c, a, b), ((3, 8, 5), (3, 8, 40), (3, 40, 5))),
}


# oneDNN's BF16 convolution backward on a CPU without AVX-512 rounds partial sums: on a 2-core AMD EPYC with AVX2
# (2026-11-28), on these exact operands, 461 of 972 input-gradient and 46 of 135 weight-gradient values were not the
# exact sum rounded once, up to 312 and 18 BF16 units from it; on the AVX-512 CPUs every value was
NATIVE_CONV_GRADIENTS_ROUND_ONCE = torch.backends.cpu.get_cpu_capability() != "AVX2"


@pytest.mark.parametrize("call", GEMM_CALLS)
def test_emulated_autocast_gemms_round_the_exact_result_once_as_the_native_bf16_kernels_do(call):
    """bench/numerics/autocast.py on operands whose FP32 accumulation is exact in any order: its output and every input
    gradient are the exact result (FP64 on the BF16-rounded operands) rounded once to BF16, BF16 out and FP32
    gradients back; and torch's own BF16 autocast on this CPU (oneDNN, the BLAS) gives the same bits, but for the
    convolution's gradients on a CPU without AVX-512 (NATIVE_CONV_GRADIENTS_ROUND_ONCE), not compared there."""
    from bench.numerics.autocast import EmulatedGemms

    function, shapes = GEMM_CALLS[call]
    results = {}
    for emulated in (False, True):
        operands = _exact_operands(*shapes)
        with torch.autocast("cpu", dtype=torch.bfloat16), EmulatedGemms("cpu") if emulated else nullcontext():
            y = function(*operands)
        gradient = _exact_operands(y.shape, seed=1)[0].detach().to(y.dtype)
        y.backward(gradient)
        results[emulated] = [y.detach(), *(t.grad for t in operands)]
    exact_operands = [t.detach().to(torch.bfloat16).double().requires_grad_() for t in operands]
    y = function(*exact_operands)
    exact = [y.detach(), *torch.autograd.grad(y, exact_operands, gradient.double())]
    reference = [exact[0].to(torch.bfloat16), *(g.to(torch.bfloat16).float() for g in exact[1:])]
    for want, emulated in zip(reference, results[True]):
        assert want.dtype == emulated.dtype and torch.equal(want, emulated), call
    compared = results[False] if NATIVE_CONV_GRADIENTS_ROUND_ONCE or call != "conv2d" else results[False][:1]
    for native, emulated in zip(compared, results[True]):
        assert native.dtype == emulated.dtype and torch.equal(native, emulated), call


def test_emulated_autocast_gemms_round_what_native_ones_round():
    """Random operands (accumulation order may then move a last bit): the emulated GEMM rounds its operands and its
    result to BF16 as the native kernel does, so the two agree to within one BF16 unit, far closer than an FP32 GEMM
    (the GEMM not emulated at all) or a GEMM on unrounded operands."""
    from bench.numerics.autocast import EmulatedGemms

    generator = torch.Generator().manual_seed(0)
    a, b = torch.randn(64, 256, generator=generator), torch.randn(256, 48, generator=generator)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        native = a @ b
        with EmulatedGemms("cpu"):
            emulated = a @ b
    unit = torch.finfo(torch.bfloat16).eps * native.float().abs()
    assert emulated.dtype == torch.bfloat16
    assert ((emulated.float() - native.float()).abs() <= unit).all()
    assert (emulated.float() == native.float()).float().mean() > 0.95
    assert (((a @ b).bfloat16().float() - native.float()).abs() > unit).any()  # operands unrounded: visibly not it


@pytest.mark.parametrize("cpu_flags, fmt, elsewhere, emulated", [
    ((), "mxfp8", "bf16", True), ((), "fp8", "bf16", True), (("avx512_bf16",), "mxfp8", "bf16", False),
    (("amx_bf16",), "fp8", "bf16", False), ((), "mxfp8", "fp32", False)])
def test_bf16_elsewhere_emulates_its_gemms_on_a_cpu_without_bf16_units_and_says_so(cpu_flags, fmt, elsewhere,
                                                                                     emulated):
    """Where oneDNN's BF16 kernels are slow (no avx512_bf16, no amx_bf16), the plan emulates autocast's GEMMs and the
    record says why; with BF16 units, or with nothing in BF16 elsewhere, autocast runs as torch runs it."""
    from bench.numerics import hardware
    from bench.numerics.autocast import EmulatedGemms

    with hardware.simulated("cpu", cpu_flags) as device:
        precision = Precision.of(fmt, device, mode="mixed", elsewhere=elsewhere)
    why = precision.describe()["elsewhere_emulated"]
    assert (why is not None) == emulated
    if emulated:
        assert why.startswith("CPU lacks amx_bf16/avx512_bf16") and "emulated in FP32" in why
    with precision.autocast():
        modes = torch.overrides._get_current_function_mode_stack()
        assert any(isinstance(m, EmulatedGemms) for m in modes) == emulated
        assert torch.is_autocast_enabled("cpu") == (elsewhere == "bf16")


def test_an_emulated_elsewhere_cell_trains_its_convolutions_through_the_emulated_gemms(make_cfg, monkeypatch):
    """LeNet in MXFP8 keeps its convolutions out of the format (torchao converts Linears alone): on a CPU without
    BF16 units they are autocast's BF16 convolutions, computed by the emulation, and the record says so."""
    from bench.numerics import autocast, hardware
    from bench.running.run import run_cell

    taken = []
    original = autocast.EmulatedGemms._widened
    monkeypatch.setattr(autocast.EmulatedGemms, "_widened",
                        lambda self, a, dtype: taken.append(tuple(a.shape)) or original(self, a, dtype)
                        if isinstance(a, torch.Tensor) else original(self, a, dtype))
    monkeypatch.setattr(hardware, "_cpu_flags", lambda: frozenset())
    cfg = make_cfg("format=mxfp8", "train.max_steps=2")
    run_cell(cfg)
    record = json.loads((Path(cfg.results_dir) / cfg.cell / "result.json").read_text())
    assert record["status"] == "ok" and record["env"]["precision"]["elsewhere_emulated"]
    assert (6, 1, 5, 5) in taken and (16, 6, 5, 5) in taken  # both convolutions' weights


def test_the_emulation_is_entered_only_where_a_layer_computes_under_autocast():
    """FP8 emulates every Linear and convolution itself (autocast off inside): nothing would be left for the
    emulated GEMMs but their cost, so autocast runs as torch runs it. MXFP8 leaves LeNet's convolutions to autocast."""
    from bench.numerics import hardware
    from bench.tasks.lenet import LeNet5

    with hardware.simulated("cpu") as device:
        fp8, mxfp8 = (Precision.of(fmt, device, mode="mixed", elsewhere="bf16") for fmt in ("fp8", "mxfp8"))
    fp8.prepare(LeNet5())
    mxfp8.prepare(LeNet5())
    assert fp8.autocast_layers == [] and fp8.describe()["elsewhere_emulated"] is None
    assert mxfp8.autocast_layers == ["0", "3"] and mxfp8.describe()["elsewhere_emulated"]
