"""Unit scaling: output and input-gradient scales at initialisation, per layer type and model shape; the transform."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from bench.errors import ConfigError
from bench.numerics.ops import Add, Attention, CausalAttention, Residual
from bench.numerics.unit import (
    UnitAdd,
    UnitAttention,
    UnitConv2d,
    UnitEmbedding,
    UnitGELU,
    UnitLayerNorm,
    UnitLinear,
    UnitMaxPool2d,
    UnitReLU,
    UnitResidual,
    residual_taus,
    unit_cross_entropy,
    unit_scale,
)
from bench.tasks.lenet import LeNet5


def _stds(layer, x):
    x = x.requires_grad_(True)
    y = layer(x)
    y.backward(torch.randn_like(y))
    return y.std().item(), x.grad.std().item()


def _predicted(layer, shape) -> tuple[float, float]:
    """(output std, input-gradient std) the docstring claims: 1 and 1 unconstrained; (fan_in/fan_out)^1/4 and
    its inverse under the geometric-mean constraint. A convolution's input pixels near the border receive fewer
    than k*k/stride^2 gradient terms: its input-gradient std is further multiplied by the root of the mean
    coverage (counted with a transposed convolution of ones), as the scale does not correct for borders."""
    if isinstance(layer, UnitLinear):
        fan_in, fan_out, border = layer.in_features, layer.out_features, 1.0
    else:
        kh, kw = layer.kernel_size
        fan_in = layer.in_channels * kh * kw
        fan_out = layer.out_channels * kh * kw / (layer.stride[0] * layer.stride[1])
        out = nn.functional.conv2d(torch.zeros(1, 1, *shape[-2:]), torch.zeros(1, 1, kh, kw), stride=layer.stride,
                                   padding=layer.padding)
        coverage = nn.functional.conv_transpose2d(torch.ones_like(out), torch.ones(1, 1, kh, kw), stride=layer.stride,
                                                  padding=layer.padding, output_padding=_output_padding(layer, shape))
        border = (coverage.mean().item() * layer.stride[0] * layer.stride[1] / (kh * kw)) ** 0.5
    ratio = (fan_in / fan_out) ** 0.25 if layer.constraint == "gmean" else 1.0
    return ratio, border / ratio


def _output_padding(layer, shape) -> tuple[int, int]:
    """What conv_transpose2d needs to give back the input's size."""
    return tuple((size + 2 * p - k) % s for size, p, k, s in zip(shape[-2:], layer.padding, layer.kernel_size,
                                                                  layer.stride))


# Every matmul/conv shape of the three models. LeNet has no residual adds, so unit-scaling's transform leaves all of
# its ops unconstrained; in BERT-base and DistilBERT the ops inside the encoder blocks are constrained and the pooler
# and task heads (after the last residual add) are not.
MODEL_SHAPES = [
    ("lenet conv 1->6 5x5", UnitConv2d(1, 6, 5), (64, 1, 32, 32)),
    ("lenet conv 6->16 5x5", UnitConv2d(6, 16, 5), (64, 6, 14, 14)),
    ("lenet fc 400->120", UnitLinear(400, 120), (512, 400)),
    ("lenet fc 120->84", UnitLinear(120, 84), (512, 120)),
    ("lenet fc 84->10", UnitLinear(84, 10), (512, 84)),
    ("bert attention 768->768", UnitLinear(768, 768, constraint="gmean"), (256, 768)),
    ("bert ffn 768->3072", UnitLinear(768, 3072, constraint="gmean"), (256, 768)),
    ("bert ffn 3072->768", UnitLinear(3072, 768, constraint="gmean"), (256, 3072)),
    ("bert pooler / distilbert pre_classifier 768->768", UnitLinear(768, 768), (256, 768)),
    ("bert qa_outputs 768->2", UnitLinear(768, 2), (4096, 768)),
    ("distilbert classifier 768->2", UnitLinear(768, 2), (4096, 768)),
    ("conv 16->32 3x3 stride 2, constrained", UnitConv2d(16, 32, 3, stride=2, padding=1, constraint="gmean"),
     (32, 16, 16, 16)),
]


@pytest.mark.parametrize("name,layer,shape", MODEL_SHAPES, ids=[m[0] for m in MODEL_SHAPES])
def test_output_and_input_gradient_std_are_as_stated_for_every_model_shape(name, layer, shape):
    torch.manual_seed(0)
    layer.reset_parameters()  # built at collection, from whatever state the global generator had then
    out_std, grad_std = _stds(layer, torch.randn(shape))
    want_out, want_grad = _predicted(layer, shape)
    assert out_std == pytest.approx(want_out, rel=0.1), (name, out_std)
    assert grad_std == pytest.approx(want_grad, rel=0.1), (name, grad_std)


def _normal_std(f, draws: int = 1, rms: bool = False) -> float:
    """std (rms: root mean square) of f(z) for z ~ N(0, 1), or of f(the max of `draws` such z), by numerical
    integration: a reference independent of torch and of the module under test."""
    from scipy import integrate, stats

    def density(z):
        return draws * stats.norm.pdf(z) * stats.norm.cdf(z) ** (draws - 1)  # the max of `draws` normals

    mean = 0.0 if rms else integrate.quad(lambda z: f(z) * density(z), -12, 12)[0]
    return math.sqrt(integrate.quad(lambda z: f(z) ** 2 * density(z), -12, 12)[0] - mean**2)


def _gelu(z: float) -> float:
    return 0.5 * z * (1 + math.erf(z / math.sqrt(2)))


def _gelu_slope(z: float) -> float:
    return 0.5 * (1 + math.erf(z / math.sqrt(2))) + z * math.exp(-z * z / 2) / math.sqrt(2 * math.pi)


# (layer, its plain twin, stated output std, stated input-gradient std) on unit-normal inputs and gradients, and
# those stds integrated by hand. An input gradient is the incoming one (unit normal, independent) times the op's
# slope: its std is the slope's root mean square. ReLU and GELU: the paper's factors make both 1 (a plain ReLU: 0.584
# and 0.707). Max-pooling 2x2: the forward is left unscaled, so the std of the max of 4 normals (0.70); each output's
# gradient reaches 1 input in 4 (rms 0.5), scaled by 2: 1.
ACTIVATIONS = [
    ("relu", UnitReLU(), nn.ReLU(), 1.0, 1.0,
     lambda: (1.713 * _normal_std(lambda z: max(z, 0.0)),
              math.sqrt(2) * _normal_std(lambda z: float(z > 0), rms=True))),
    ("gelu", UnitGELU(), nn.GELU(), 1.0, 1.0,
     lambda: (1.701 * _normal_std(_gelu), 1.481 * _normal_std(_gelu_slope, rms=True))),
    ("max-pool 2x2", UnitMaxPool2d(2), nn.MaxPool2d(2), 0.70, 1.0,
     lambda: (_normal_std(lambda z: z, draws=4), 2 * math.sqrt(1 / 4))),
]


@pytest.mark.parametrize("name,layer,plain,out_stated,grad_stated,reference", ACTIVATIONS,
                         ids=[a[0] for a in ACTIVATIONS])
def test_activations_keep_the_stated_scales_within_5_percent_and_plain_ones_do_not(name, layer, plain, out_stated,
                                                                                    grad_stated, reference):
    """The stated output and input-gradient stds hold to 5% on unit-normal inputs and gradients; they are the
    numerically integrated ones (`reference`), and the plain op misses at least one of them by more than 5%."""
    assert reference() == pytest.approx((out_stated, grad_stated), rel=0.01)  # the stated figures, by hand
    torch.manual_seed(0)
    x = torch.randn((64, 6, 28, 28))
    out_std, grad_std = _stds(layer, x.clone())
    assert out_std == pytest.approx(out_stated, rel=0.05) and grad_std == pytest.approx(grad_stated, rel=0.05), \
        (name, out_std, grad_std)
    plain_out, plain_grad = _stds(plain, x.clone())
    assert plain_out != pytest.approx(out_stated, rel=0.05) or plain_grad != pytest.approx(grad_stated, rel=0.05)


def test_transformer_blocks_are_constrained_and_the_head_is_not():
    from transformers import BertConfig, BertForQuestionAnswering

    model = unit_scale(BertForQuestionAnswering(BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2,
                                                           num_attention_heads=2, intermediate_size=64)))
    constraints = {name: m.constraint for name, m in model.named_modules() if isinstance(m, UnitLinear)}
    assert constraints.pop("qa_outputs") is None
    assert constraints and all(name.startswith("bert.encoder.layer.") and c == "gmean"
                               for name, c in constraints.items())


@pytest.mark.parametrize("make_layer,shape", [(lambda: nn.Linear(48, 20), (16, 48)),
                                              (lambda: nn.Conv2d(3, 8, 3, stride=2, padding=1), (4, 3, 12, 12))])
@pytest.mark.parametrize("constraint", [None, "gmean"])
def test_pretrained_conversion_keeps_a_layer_with_bias_exactly(make_layer, shape, constraint):
    """Weights as trained layers have them (non-zero bias, non-unit variance): the converted layer computes the
    same function to float rounding, whichever constraint its place in the model gives it."""
    torch.manual_seed(0)
    layer = make_layer()
    with torch.no_grad():
        layer.weight.mul_(3.0)
        layer.bias.copy_(torch.randn_like(layer.bias))
    x = torch.randn(shape)
    inside_blocks = nn.Sequential(nn.ModuleList([copy.deepcopy(layer)]))  # where a residual stack keeps it
    converted = unit_scale(inside_blocks if constraint else nn.Sequential(copy.deepcopy(layer)), preserve=True)[0]
    converted = converted[0] if constraint else converted
    assert converted.constraint == constraint
    assert torch.allclose(converted(x), layer(x), rtol=1e-5, atol=1e-6)


def test_plain_layers_are_far_from_unit_scale_so_the_test_can_fail():
    torch.manual_seed(0)
    _, grad_std = _stds(nn.Linear(400, 120), torch.randn(512, 400))
    assert grad_std < 0.5


def test_cross_entropy_input_gradient_is_unit_scaled_and_loss_is_the_mean():
    torch.manual_seed(0)
    logits = torch.randn(1024, 10, requires_grad=True)
    targets = torch.randint(0, 10, (1024,))
    loss = unit_cross_entropy(logits, targets)
    assert torch.allclose(loss, nn.functional.cross_entropy(logits, targets))
    loss.backward()
    assert 0.5 <= logits.grad.std().item() <= 2


def test_unit_scale_replaces_every_layer_with_unit_variance_weights():
    model = unit_scale(LeNet5())
    kinds = {type(m) for m in model.modules()}
    assert {UnitConv2d, UnitLinear, UnitReLU, UnitMaxPool2d} <= kinds
    assert not kinds & {nn.Linear, nn.Conv2d, nn.ReLU, nn.MaxPool2d}
    for m in model.modules():
        if isinstance(m, (UnitLinear, UnitConv2d)):
            assert 0.8 < m.weight.std().item() < 1.2 and not m.bias.any()


def test_unknown_parameterised_module_is_refused():
    with pytest.raises(ConfigError, match="BatchNorm2d"):
        unit_scale(nn.Sequential(nn.BatchNorm2d(3)))


# The transformer ops a from-scratch unit-scaled GPT needs (bench/numerics/ops.py's modules and their unit versions),
# each against its plain version, which must miss the band so that the test can fail. Attention's scale is the
# library's empirical model of the causal average, hence its wider band.
def _op_stds(op, inputs, weight=None):
    """(output std, std of each input's gradient, std of the weight gradient) for a unit-normal output gradient."""
    inputs = [x.requires_grad_(x.is_floating_point()) for x in inputs]
    y = op(*inputs)
    y.backward(torch.randn_like(y))
    grads = [x.grad.std().item() for x in inputs if x.is_floating_point()]
    return y.std().item(), grads, None if weight is None else weight.grad.std().item()


TRANSFORMER_OPS = {
    # name: (plain op, unit op, inputs, band for every std)
    "embedding 65 x 128, 12 x 64 lookups": (lambda: nn.Embedding(65, 128), lambda: UnitEmbedding(65, 128),
                                            lambda: [torch.randint(0, 65, (12, 64))], 0.1),
    "layer norm 128, no bias": (lambda: nn.LayerNorm(128, bias=False), lambda: UnitLayerNorm(128, bias=False),
                                lambda: [torch.randn(12, 64, 128) + 0.5], 0.1),
    "causal attention, 4 heads x 32, length 64": (CausalAttention, lambda *a: UnitAttention(*a, causal=True),
                                                  lambda: [torch.randn(12, 4, 64, 32) for _ in range(3)], 0.33),
    "bidirectional attention, 4 heads x 32, length 64": (Attention, UnitAttention,
                                                         lambda: [torch.randn(12, 4, 64, 32) for _ in range(3)], 0.33),
    "token + position embedding sum": (Add, UnitAdd, lambda: [torch.randn(12, 64, 128), torch.randn(64, 128)], 0.1),
}


@pytest.mark.parametrize("name", TRANSFORMER_OPS)
def test_transformer_ops_have_unit_output_input_and_weight_gradients(name):
    """Unit ops: output, input-gradient and weight-gradient std within the band around 1 (the embedding's rows are
    N(0, 1); LayerNorm's weight gradient sums over 768 positions and is scaled back); plain ops: some std outside."""
    plain, unit, inputs, band = TRANSFORMER_OPS[name]
    for op, must_be_unit in ((unit(), True), (plain(), False)):
        torch.manual_seed(0)
        weight = getattr(op, "weight", None)
        out, grads, weight_grad = _op_stds(op, inputs(), weight)
        stds = [out, *grads] + ([weight_grad] if weight is not None else [])
        within = all(abs(s - 1) <= band for s in stds)
        assert within == must_be_unit, (name, type(op).__name__, stds)


def test_embedding_sum_broadcast_gradient_is_scaled_by_its_broadcast_factor():
    """The position embedding is added to 12 sequences: its gradient is the sum of 12 and unit_scaling's add divides
    it by sqrt(12); the forward divides the sum of two unit-variance inputs by sqrt(2)."""
    a, b = torch.randn(12, 64, 128, requires_grad=True), torch.randn(64, 128, requires_grad=True)
    y = UnitAdd()(a, b)
    g = torch.randn_like(y)
    y.backward(g)
    assert torch.allclose(y, (a + b) / 2**0.5)
    assert torch.allclose(a.grad, g, atol=1e-6) and torch.allclose(b.grad, g.sum(0) / 12**0.5, atol=1e-5)


@pytest.mark.parametrize("tau", [0.5, 0.2, 0.0833])
def test_residual_add_is_the_papers_weighted_sum_with_a_unit_gradient_inside_the_branch(tau):
    """Forward sqrt(1-tau) x + sqrt(tau) f(x); the gradient reaching x is the true derivative of that sum, and the
    branch f receives the unscaled (unit) output gradient, its sqrt(tau) applied after it."""
    torch.manual_seed(0)
    x = torch.randn(8, 16, requires_grad=True)
    seen = {}

    def branch(h):
        h = 3 * h
        h.register_hook(lambda grad: seen.setdefault("grad", grad))
        return h

    y = UnitResidual(tau)(x, branch)
    g = torch.randn_like(y)
    y.backward(g)
    assert torch.allclose(y, (1 - tau) ** 0.5 * x + tau**0.5 * 3 * x, atol=1e-6)
    assert torch.allclose(x.grad, ((1 - tau) ** 0.5 + 3 * tau**0.5) * g, atol=1e-5)
    assert torch.allclose(seen["grad"], g, atol=1e-6)


@pytest.mark.parametrize("count", [2, 8, 24])
def test_residual_taus_give_every_branch_the_same_share_and_the_embedding_a_third(count):
    taus = residual_taus(count)
    shares = [tau * math.prod(1 - t for t in taus[i + 1:]) for i, tau in enumerate(taus)]
    assert shares == pytest.approx([shares[0]] * count)
    assert math.prod(1 - t for t in taus) == pytest.approx(1 / 3)


@pytest.mark.parametrize("norm", ["pre", "post"])
def test_unit_scaled_char_gpt_is_unit_scaled_end_to_end_and_the_plain_one_is_not(norm):
    """Every block's output and output gradient, and the logits, have std within [0.6, 1.6] at initialisation, with
    unit_scaling's cross-entropy; the nanoGPT-initialised model's residual stream starts far below (0.03)."""
    from bench.tasks.charlm import CharGPT

    def block_stds(model, cross_entropy):
        outputs = []

        def keep(_module, _inputs, output):
            output.retain_grad()
            outputs.append(output)

        for block in model.h:
            block.register_forward_hook(keep)
        x, y = torch.randint(0, 65, (12, 64)), torch.randint(0, 65, (12, 64))
        logits = model(x)
        logits.retain_grad()
        cross_entropy(logits.view(-1, 65), y.view(-1)).backward()
        return [s for t in outputs + [logits] for s in (t.std().item(), t.grad.std().item())]

    torch.manual_seed(0)
    unit = unit_scale(CharGPT(65, 64, 4, 4, 128, norm=norm))
    assert unit.wte.weight is unit.lm_head.weight  # nanoGPT's tie survives the conversion
    kinds = {type(m) for m in unit.modules()}
    assert {UnitEmbedding, UnitLinear, UnitResidual, UnitAttention, UnitAdd, UnitGELU} <= kinds
    assert not kinds & {nn.Linear, nn.Embedding, nn.LayerNorm, nn.GELU, Residual, CausalAttention, Add}
    assert all(0.6 <= s <= 1.6 for s in block_stds(unit, unit_cross_entropy))
    torch.manual_seed(0)
    plain = block_stds(CharGPT(65, 64, 4, 4, 128, norm=norm), nn.functional.cross_entropy)
    assert not all(0.6 <= s <= 1.6 for s in plain)


def test_relative_lr_rule_gives_every_tensor_the_regular_models_relative_adam_step():
    """nanoGPT's init: matrices and embeddings RMS 0.02 (x50), residual projections 0.02/sqrt(8) (x141), LayerNorm
    weights 1 (x1). After one AdamW step (Adam's first step moves each element by about lr), every tensor of the
    unit-scaled model has moved by the same fraction of its RMS as in the regular model, weight decay included."""
    from omegaconf import OmegaConf

    from bench.numerics.unit import relative_lr_multipliers
    from bench.tasks.charlm import CharGPT
    from bench.tasks.optimizer import build_optimizer

    cfg = OmegaConf.create({"name": "adamw", "lr": 1e-3, "beta2": 0.99, "weight_decay": 0.1,
                            "decay_matrices_only": True})
    x, y = torch.randint(0, 65, (4, 16)), torch.randint(0, 65, (4, 16))

    def relative_steps(model, cross_entropy, multipliers):
        optimizer = build_optimizer(cfg, model.parameters(), multipliers)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        cross_entropy(model(x).view(-1, 65), y.view(-1)).backward()
        optimizer.step()
        return {n: float((p - before[n]).norm() / before[n].norm()) for n, p in model.named_parameters()}

    torch.manual_seed(0)
    regular = CharGPT(65, 16, 2, 2, 32)
    rms = {n: float(p.pow(2).mean().sqrt()) for n, p in regular.named_parameters()}
    unit = unit_scale(copy.deepcopy(regular))
    multipliers = relative_lr_multipliers(rms, unit)
    by_name = {n: multipliers[p] for n, p in unit.named_parameters()}
    assert by_name["wte.weight"] == pytest.approx(50, rel=0.05)
    assert by_name["h.0.attn.c_proj.weight"] == pytest.approx(50 * 2, rel=0.05)  # 0.02 / sqrt(2 * 2 layers)
    assert by_name["h.0.ln_1.weight"] == 1.0
    steps_regular = relative_steps(regular, nn.functional.cross_entropy, None)
    steps_unit = relative_steps(unit, unit_cross_entropy, multipliers)
    for name in steps_regular:
        assert steps_unit[name] == pytest.approx(steps_regular[name], rel=0.02), name
    steps_same_lr = relative_steps(unit_scale(copy.deepcopy(regular)), unit_cross_entropy, None)
    assert steps_same_lr["wte.weight"] < steps_regular["wte.weight"] / 20  # the rule is what makes them equal


@pytest.mark.parametrize("layer", ["linear", "conv"])
def test_unit_scaled_layers_run_their_gemm_in_a_native_autocast_format(layer):
    """Natively (bf16-mixed, nothing emulated) a unit-scaled layer's GEMM is autocast's: BF16 operands, BF16 out,
    bit for bit F.linear/F.conv2d under autocast times the unit scale; not an FP32 GEMM rounded afterwards."""
    torch.manual_seed(0)
    unit = UnitLinear(64, 48) if layer == "linear" else UnitConv2d(4, 8, 3)
    x = torch.randn(16, 64) if layer == "linear" else torch.randn(2, 4, 9, 9)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = unit(x)
        plain = (F.linear(x, unit.weight, unit.bias) if layer == "linear"
                 else F.conv2d(x, unit.weight, unit.bias))
    fan_in = unit.weight[0].numel()
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, plain * fan_in**-0.5)
