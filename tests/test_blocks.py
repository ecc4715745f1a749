"""Block formats (MX, NVFP4) against torchao and ml_dtypes, scale modes by hand, stochastic rounding statistically."""

import math
from pathlib import Path

import pandas as pd
import pytest
import torch

from bench.numerics.blocks import (
    MX_ELEMENTS,
    SCALE_MODES,
    mx_quantise,
    nvfp4_quantise,
    nvfp4_tensor_scale,
    rowwise_quantise,
    tile2d_quantise,
    tile_quantise,
)
from bench.numerics.formats import FORMATS, quantise_stochastic, quantise_value
from bench.numerics.scaling_methods import SCALING_METHODS
from bench.tools.conformance import (
    DEPARTURES,
    conformance_rows,
    conformance_table,
    departure_examples,
    family_table,
    torchao_rceil_byte,
)

CONFORMANCE = Path(__file__).resolve().parents[1] / "results" / "conformance"


@pytest.fixture(scope="module")
def rows():
    return conformance_rows()  # 2^20 random values per format, plus six adversarial families


@pytest.fixture(scope="module")
def table(rows):
    return conformance_table(rows)


def test_every_block_format_matches_its_reference_except_the_named_departures(rows, table):
    """0 differing scale bytes and 0 differing dequantised values against torchao (every MX element format and scale
    mode, NVFP4 one- and two-level, rowwise FP8), ml_dtypes (element casts), and between edge, transposed and plain
    inputs, on every input family; what differs is confined to the named departures, each where it belongs."""
    assert len(table) == 5 * (4 + 3) + 2 + 2 + 2 + 4  # MX, its edge/transposed/ml_dtypes rows; NVFP4 x 2; rowwise FP8
    # x 2; NVIDIA's recipe: 16 x 16 tiles against their definition, the RHT'd weight-gradient operand against scipy +
    # torchao; Transformer Engine's rules: NVFP4 under either scale rule, its tiles and its BF16 transform
    assert set(rows["family"]) >= {"random", "zero", "scale boundaries", "element ties", "subnormal",
                                   "mixed extremes", "bf16 inputs"}
    assert table["values"].min() >= 1024
    assert (table[table["reference"].str.startswith("torchao to_mx")]["values"] >= 10**6).all()
    bad = rows[(rows["scale_mismatches"] > 0) | (rows["value_mismatches"] > 0)]
    assert bad.empty, bad.to_string()
    where = {name: rows[rows[name] > 0] for name in DEPARTURES}
    assert set(where["round_trip_2^-127"]["reference"]) == {"torchao to_mx + to_dtype"}
    rceil = where["rceil_float32_log2"]
    assert set(rceil["scale mode"]) == {"rceil"} and set(rceil["family"]) == {"scale boundaries"}
    assert set(rceil["format"]) == {f"MX {element}" for element in MX_ELEMENTS}
    assert set(where["e2m1_nan_code"]["format"]) == {"NVFP4"}
    floor = where["tensor_scale_floor"]
    assert set(floor["scale mode"]) == {"E4M3 block x FP32 tensor", "E4M3 block x FP32 tensor, along the tokens"}
    assert set(floor["family"]) == {"zero", "subnormal"}
    rht = where["rht_fp32_arithmetic"]
    assert set(rht["format"]) <= {"NVFP4 + RHT (weight-gradient operands)",
                                  "NVFP4 + RHT in BF16 (weight-gradient operands)"}
    assert set(rht["family"]) <= {"subnormal", "mixed extremes"}
    assert table[table["format"] == "NVFP4 16x16 weight tiles"][list(DEPARTURES)].sum().sum() == 0
    te = rows["reference"].str.startswith("Transformer Engine")
    assert set(rows[te & (rows["torchao_scale_clamp"] + rows["torchao_scale_order"] > 0)]["scale mode"]) == {
        "scale_rule=torchao"}  # every difference from TE's rules is torchao's rule, none is scale_rule=te's
    assert rows[te & (rows["scale mode"] == "scale_rule=torchao")]["torchao_scale_clamp"].sum() > 0
    plain = rows[~te & (rows["family"] == "random")]
    assert (plain[list(DEPARTURES)] == 0).all().all()  # random inputs never reach the torchao references' departures


def test_the_committed_conformance_tables_are_what_the_command_writes(rows, table):
    for name, made in (("block_formats.csv", table), ("block_formats_by_family.csv", family_table(rows))):
        committed = pd.read_csv(CONFORMANCE / name).fillna("")
        made = made.astype(committed.dtypes)
        assert committed.equals(made), f"results/conformance/{name} is stale: run python -m bench.tools.conformance"


def _exact_rceil_byte(amax: float, spec) -> int:
    """ceil(log2(amax / max_elem)) in exact rational arithmetic, clamped and biased as E8M0."""
    from fractions import Fraction

    q = Fraction(amax) / Fraction(spec.max)
    if q == 0:
        return 0
    e = q.numerator.bit_length() - q.denominator.bit_length()
    while Fraction(2) ** e < q:
        e += 1
    while Fraction(2) ** (e - 1) >= q:
        e -= 1
    return max(-127, min(127, e)) + 127


@pytest.mark.parametrize("element", MX_ELEMENTS)
def test_rceil_follows_the_exact_rule_where_torchaos_float32_log2_rounds_down(element):
    """At, one ulp below and one ulp above max_elem * 2^j for every j: ours is the exact ceil(log2(amax / max_elem))
    (rational arithmetic); torchao's byte is its float32 log2's (torchao_rceil_byte reproduces it), and the two
    differ exactly one ulp above max_elem * 2^j where log2 of it, j + log2(1 + 2^-23), rounds to j in float32
    (|j| >= 4 or 5), torchao a binade low."""
    from torchao.prototype.mx_formats.mx_tensor import ScaleCalculationMode, to_mx

    from bench.tools.conformance import _torchao

    spec = FORMATS[element]
    j = torch.arange(-120, 118, dtype=torch.float64)
    j = j[(spec.max * torch.exp2(j)).float().isfinite()]
    anchors = (spec.max * torch.exp2(j)).float()
    below, above = torch.nextafter(anchors, torch.zeros_like(anchors)), torch.nextafter(anchors, anchors * 2)
    amax = torch.cat([below, anchors, above])
    x = torch.zeros(len(amax), 32)
    x[:, 0], x[:, 1] = amax, -amax / 3
    ours = mx_quantise(x, element, "rceil").scale_bits[:, 0]
    assert ours.tolist() == [_exact_rceil_byte(a, spec) for a in amax.tolist()]
    scale, _ = to_mx(x, _torchao()[2][element], 32, ScaleCalculationMode.RCEIL)
    theirs = scale.view(torch.uint8)[:, 0]
    assert torch.equal(theirs, torchao_rceil_byte(amax, element))
    differs = theirs != ours
    one_ulp_above = torch.zeros_like(differs)
    one_ulp_above[2 * len(j):] = (j + math.log2(1 + 2.0**-23)).float() == j.float()
    assert torch.equal(differs, one_ulp_above)
    assert (ours[differs].int() - theirs[differs].int() == 1).all()


def test_each_named_departure_has_its_example():
    """The README's examples: MXFP4 rceil with block amax 96.0000076 beside a 24 (torchao keeps 24, the exact rule
    gives 32); a zero tensor under two-level NVFP4 (torchao NaN, ours 0)."""
    examples = departure_examples().set_index("departure")
    assert list(examples.index) == list(DEPARTURES)
    assert examples.loc["rceil_float32_log2", ["element", "reference", "ours"]].tolist() == ["24", "24", "32"]
    assert examples.loc["tensor_scale_floor", ["reference", "ours"]].tolist() == ["nan", "0"]
    assert examples.loc["torchao_scale_clamp", ["reference", "ours"]].tolist() == ["0.001953125", "0.015625"]
    assert examples.loc["torchao_scale_order", ["reference", "ours"]].tolist() == ["176", "160"]


# E4M3: emax 8, max 448, 3 mantissa bits. (amax, floor, ceil, even, rceil) unbiased scale exponents, by hand:
# 14 = 1.75 * 2^3: floor 3 - 8; ceil 4 - 8; even keeps 1.75 (3 bits) -> floor; rceil ceil(log2(14 / 448)) = -5.
# 15.5 = 1.9375 * 2^3: even rounds 1.1111b to 10.000b -> 2^4; rceil ceil(log2(15.5 / 448)) = ceil(-4.85) = -4.
# 8 = 2^3 exactly: ceil adds nothing; rceil ceil(log2(1 / 56)) = ceil(-5.81) = -5.
# 449 = 1.754 * 2^8: floor 0 (449 saturates to 448); rceil ceil(log2(449 / 448)) = 1.
SCALES = [(14.0, -5, -4, -5, -5), (15.5, -5, -4, -4, -4), (8.0, -5, -5, -5, -5), (449.0, 0, 1, 0, 1)]


@pytest.mark.parametrize("amax,floor,ceil,even,rceil", SCALES)
def test_mx_scale_modes_by_hand(amax, floor, ceil, even, rceil):
    x = torch.zeros(1, 32)
    x[0, 5] = -amax
    x[0, 6] = 1.0
    for mode, want in zip(("floor", "ceil", "even", "rceil"), (floor, ceil, even, rceil)):
        got = mx_quantise(x, "fp8_e4m3", mode)
        assert int(got.scale_bits) - 127 == want, mode
        assert float(got.scale) == 2.0**want
        element = float(quantise_value(torch.tensor(-amax / 2.0**want), "fp8_e4m3", overflow="saturate"))
        assert float(got.elements[0, 5]) == element and float(got.values[0, 5]) == element * 2.0**want
    # floor can clip: 15.5 / 2^-5 = 496 saturates to 448; the ceil modes keep it (15.5 / 2^-4 = 248 -> RNE 256)
    assert float(mx_quantise(torch.full((1, 32), 15.5), "fp8_e4m3", "floor").elements[0, 0]) == 448.0
    assert float(mx_quantise(torch.full((1, 32), 15.5), "fp8_e4m3", "rceil").elements[0, 0]) == 256.0


def test_a_nan_block_dequantises_to_nan_and_leaves_its_neighbours_alone():
    x = torch.randn(2, 64)
    x[0, 40] = float("nan")
    got = mx_quantise(x, "fp4_e2m1")
    assert got.values[0, 32:].isnan().all() and not got.values[0, :32].isnan().any()
    assert int(got.scale_bits[0, 1]) == 255 and not got.values[1].isnan().any()


BLOCK_QUANTISERS = {
    **{f"mx {element} {mode}": (lambda element, mode: lambda x: mx_quantise(x, element, mode))(element, mode)
       for element in MX_ELEMENTS for mode in SCALE_MODES},
    "nvfp4 one-level": lambda x: nvfp4_quantise(x),
    "nvfp4 two-level": lambda x: nvfp4_quantise(x, nvfp4_tensor_scale(x)),
    "fp8 rowwise": lambda x: rowwise_quantise(x),
    "fp8 1x128 tiles": lambda x: tile_quantise(x),
    "fp8 128x128 tiles": lambda x: tile2d_quantise(x),
}


@pytest.mark.parametrize("quantise", BLOCK_QUANTISERS.values(), ids=BLOCK_QUANTISERS.keys())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_zero_tensor_quantises_to_exact_zeros_with_finite_scales(quantise, dtype):
    """Two-level NVFP4 turned an all-zero tensor into NaN (a tensor scale of 0, as torchao's): now every block
    format gives exact zeros and finite, positive scales and factors."""
    got = quantise(torch.zeros(4, 256, dtype=dtype))
    assert torch.equal(got.values, torch.zeros(4, 256)) and torch.equal(got.elements, torch.zeros(4, 256))
    for per_block in (got.scale, got.factor):
        assert per_block.isfinite().all() and (per_block > 0).all()


@pytest.mark.parametrize("quantise", BLOCK_QUANTISERS.values(), ids=BLOCK_QUANTISERS.keys())
@pytest.mark.parametrize("amax", [1e-30, 1e-34, 1e-36, 1e-39, 2.0**-149])
def test_a_tiny_tensor_quantises_to_finite_values_keeping_zeros_and_signs(quantise, amax):
    """A tensor whose amax is far below 1 (gradients late in training; float32 subnormals included): two-level
    NVFP4 gave a tensor scale whose reciprocal overflowed, so its zeros became NaN and every other element
    saturated to its block's max. Now: finite, zeros stay zero, no sign flips, nothing rounded past twice the amax."""
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(0))
    x = (x / x.abs().max() * amax).float()
    x[0, :40] = 0.0
    got = quantise(x).values
    assert got.isfinite().all()
    assert torch.equal(got[0, :40], torch.zeros(40))
    assert (got * x >= 0).all() and (got.abs() <= 2 * x.abs().max()).all()


def test_nvfp4_tensor_scale_is_torchaos_above_its_floor_and_never_zero_below_it():
    from torchao.prototype.mx_formats.nvfp4_tensor import per_tensor_amax_to_scale

    for amax in (2688 * 2.0**-121, 2e-33, 1e-20, 1.0, 3e4, 3e38):
        assert torch.equal(nvfp4_tensor_scale(torch.tensor([amax, -amax / 3])),
                           per_tensor_amax_to_scale(torch.tensor(amax)))
    for amax in (0.0, 1e-36, 1e-40):
        t = nvfp4_tensor_scale(torch.tensor([amax]))
        assert float(t) == 2.0**-121 and torch.isfinite(1 / t / 2.0**-6)
    assert nvfp4_tensor_scale(torch.tensor([float("inf")])).isinf()  # an overflow stays visible
    assert nvfp4_tensor_scale(torch.tensor([1.0, float("nan")])).isnan()


BLOCK_CELLS = {"mxfp8": {}, "mxfp6": {}, "mxfp4": {}, "nvfp4": {}, "fp8 rowwise": {"scaling": "rowwise"},
               "fp8 block": {"scaling": "block"}}


@pytest.mark.parametrize("fmt", BLOCK_CELLS, ids=BLOCK_CELLS.keys())
def test_a_zero_initialised_linear_trains_in_every_block_format_without_nan_or_skipped_steps(fmt):
    """The output layer starts at zero (a common init for output projections and adapters): its input gradient
    g W is a zero GEMM operand, and so is every gradient of the layer below on the first step. Under two-level
    NVFP4 those operands were NaN, and the loss scaler skipped step after step."""
    from bench.numerics.precision import Precision
    from bench.numerics.scaling import LossScaler

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32))
    torch.nn.init.zeros_(model[2].weight)
    torch.nn.init.zeros_(model[2].bias)
    model = Precision.of(fmt.split()[0], torch.device("cpu"), mode="mixed", backend="emulated",
                         **BLOCK_CELLS[fmt]).prepare(model)
    x, target = torch.randn(64, 64), torch.randint(0, 32, (64,))
    y = model(x)
    y.backward(torch.zeros_like(y))  # a zero upstream gradient: both gradient GEMMs take all-zero operands
    for p in model.parameters():
        assert torch.equal(p.grad, torch.zeros_like(p))
    model.zero_grad()
    optimiser, scaler = torch.optim.SGD(model.parameters(), lr=0.5), LossScaler("dynamic", init_scale=2.0**10)
    losses = []
    for _ in range(5):
        loss = torch.nn.functional.cross_entropy(model(x), target)
        scaler.scale_loss(loss).backward()
        scaler.step(optimiser, list(model.parameters()))
        optimiser.zero_grad()
        losses.append(float(loss))
    scaler.sync()
    assert scaler.skipped_steps == 0 and scaler.overflow_steps == 0
    assert all(math.isfinite(loss) for loss in losses) and losses[-1] < losses[0]
    assert all(p.isfinite().all() for p in model.parameters())
    assert not torch.equal(model[2].weight, torch.zeros_like(model[2].weight))


def test_blocks_run_along_the_requested_dimension():
    """The forward GEMM blocks activations and weights along K; the weight-gradient GEMM blocks along the batch:
    the same tensor blocked along dim 0 is the transposed tensor blocked along its last dimension."""
    x = torch.randn(64, 48) * torch.exp2(torch.randint(-8, 8, (64, 1)).float())
    assert torch.equal(mx_quantise(x, "fp8_e4m3", dim=0).values, mx_quantise(x.t(), "fp8_e4m3").values.t())
    assert torch.equal(nvfp4_quantise(x, dim=0).values, nvfp4_quantise(x.t().contiguous()).values.t())


@pytest.mark.parametrize("fmt,value", [("fp4_e2m1", 1.3), ("fp4_e2m1", -2.6), ("fp4_e2m1", 0.3), ("fp4_e2m1", 5.0),
                                       ("fp8_e4m3", 300.0), ("fp8_e4m3", 2.0**-8 * 1.3), ("fp6_e3m2", 0.1),
                                       ("fp8_e5m2", 2.0**-16 * 1.3), ("fp8_e5m2", -40000.0)])
def test_stochastic_rounding_is_unbiased_and_rounds_up_in_proportion_to_the_distance(fmt, value):
    """Over n draws: the mean is the input within 5 standard errors, and the share rounded up is the distance to the
    grid point below over the spacing, within 5 binomial standard errors."""
    n = 40_000
    drawn = quantise_stochastic(torch.full((n,), value), fmt, torch.Generator().manual_seed(0))
    below, above = drawn.abs().min().item(), drawn.abs().max().item()
    assert len(drawn.unique()) == 2 and below < abs(value) < above
    p = (abs(value) - below) / (above - below)
    share_up = (drawn.abs() == above).float().mean().item()
    assert abs(share_up - p) < 5 * math.sqrt(p * (1 - p) / n)
    assert abs(drawn.double().mean().item() - value) < 5 * (above - below) * math.sqrt(p * (1 - p) / n)


def test_stochastic_rounding_is_reproducible_keeps_grid_values_saturates_and_keeps_nan():
    x = torch.randn(10_000)
    first = quantise_stochastic(x, "fp4_e2m1", torch.Generator().manual_seed(3))
    assert torch.equal(first, quantise_stochastic(x, "fp4_e2m1", torch.Generator().manual_seed(3)))
    assert not torch.equal(first, quantise_stochastic(x, "fp4_e2m1", torch.Generator().manual_seed(4)))
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -6.0, -0.5])
    assert torch.equal(quantise_stochastic(grid, "fp4_e2m1"), grid)
    assert quantise_stochastic(torch.tensor([7.0, -1e30, float("inf")]), "fp4_e2m1").tolist() == [6.0, -6.0, 6.0]
    assert quantise_stochastic(torch.tensor([float("nan")]), "fp4_e2m1").isnan().all()


@pytest.mark.parametrize("fmt", ["bf16", "tf32"])
def test_stochastic_rounding_of_an_infinity_past_fp32s_range_follows_the_overflow_policy(fmt):
    """BF16's and TF32's grids reach past FP32's largest value, so |x| is not bounded before its rounding: an
    infinity's distance above its grid point is inf - inf, NaN, which must round neither up nor to NaN."""
    x = torch.tensor([math.inf, -math.inf, math.nan, 1.0])
    top = FORMATS[fmt].max
    for policy, infinities in (("saturate", [top, -top]), ("inf", [math.inf, -math.inf]),
                               ("nan", [math.inf, -math.inf])):
        rounded = quantise_stochastic(x, fmt, torch.Generator().manual_seed(0), overflow=policy)
        assert rounded[:2].tolist() == infinities and rounded[2].isnan() and rounded[3] == 1.0, policy


@pytest.mark.parametrize("policy", ["inf", "nan", "saturate"])
def test_stochastic_rounding_past_max_overflows_in_proportion_and_follows_the_overflow_policy(policy):
    """E5M2 (max 57344, top spacing 8192): 57344 + 2048 overflows a quarter of the time (to inf, NaN, or max when
    saturating) and otherwise lands on max; past max + spacing it always overflows; inf stays inf but saturated."""
    n = 40_000
    drawn = quantise_stochastic(torch.full((n,), 57344.0 + 2048.0), "fp8_e5m2", torch.Generator().manual_seed(0),
                                overflow=policy)
    if policy == "saturate":
        assert drawn.unique().tolist() == [57344.0]
    else:
        share = (~drawn.isfinite()).float().mean().item()
        assert abs(share - 0.25) < 5 * math.sqrt(0.25 * 0.75 / n)
        assert drawn[drawn.isfinite()].unique().tolist() == [57344.0]
    edges = quantise_stochastic(torch.tensor([-1e6, float("inf"), 57344.0]), "fp8_e5m2", overflow=policy).tolist()
    assert edges[1:] == [57344.0 if policy == "saturate" else math.inf, 57344.0]
    assert {"inf": edges[0] == -math.inf, "nan": math.isnan(edges[0]), "saturate": edges[0] == -57344.0}[policy]


@pytest.mark.parametrize("quantise", [lambda x, **kw: mx_quantise(x, "fp4_e2m1", **kw),
                                      lambda x, **kw: nvfp4_quantise(x, **kw)], ids=["mxfp4", "nvfp4"])
def test_stochastic_block_rounding_keeps_the_scales_and_is_unbiased_inside_each_block(quantise):
    """The same block scales as nearest rounding; the mean over many seeded draws is the input (up to saturation at
    the block's largest element), where nearest rounding's error does not average out."""
    x = torch.randn(4, 64) * torch.exp2(torch.randint(-6, 6, (4, 1)).float())
    nearest = quantise(x)
    generator = torch.Generator().manual_seed(0)
    draws = torch.stack([quantise(x, rounding="stochastic", generator=generator).values for _ in range(2000)])
    assert torch.equal(quantise(x, rounding="stochastic").scale, nearest.scale)
    spacing = (draws.max(0).values - draws.min(0).values).clamp(min=1e-30)
    inside = spacing > 1e-30  # elements that landed between two grid points (not on one, not saturated)
    z = (draws.double().mean(0) - x.double()).abs() / (spacing.double() / 2 / math.sqrt(2000))
    assert inside.sum() > 100 and (z[inside] < 5).all()
    assert ((nearest.values - x).abs()[inside] > 0).all()
    with pytest.raises(ValueError, match="valid: nearest, stochastic"):
        quantise(x, rounding="up")


def _blocked_linear(fmt: str, rounding: str = "nearest"):
    from bench.numerics.precision import Precision

    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 48)
    layer = Precision.of(fmt, torch.device("cpu"), mode="mixed", backend="emulated", rounding=rounding).prepare(layer)
    return layer


def test_mxfp8_linear_blocks_each_gemm_operand_along_that_gemms_reduction_dimension():
    """forward x W^T: x and W along in_features (E4M3); grad_input = g W: g and W along out_features (E5M2, E4M3);
    grad_weight = g^T x: g and x along the tokens. Blocking grad_weight's operands along the features instead
    gives another answer, so the test tells the dimensions apart."""
    layer = _blocked_linear("mxfp8")
    x = (torch.randn(2, 40, 64) * torch.exp2(torch.randint(-6, 6, (2, 40, 1)).float())).requires_grad_()
    y = layer(x)
    g = torch.randn_like(y) * 1e-3
    y.backward(g)
    w, b = layer.weight.detach(), layer.bias.detach()
    mx = lambda t, element, dim: mx_quantise(t, element, dim=dim).values
    gemm = mx(x.detach(), "fp8_e4m3", -1).reshape(-1, 64) @ mx(w, "fp8_e4m3", -1).t()
    assert torch.equal(y, gemm.reshape(2, 40, 48) + b)
    g2, x2 = g.reshape(-1, 48), x.detach().reshape(-1, 64)
    assert torch.equal(x.grad, (mx(g2, "fp8_e5m2", -1) @ mx(w, "fp8_e4m3", 0)).reshape(x.shape))
    assert torch.equal(layer.weight.grad, mx(g2, "fp8_e5m2", 0).t() @ mx(x2, "fp8_e4m3", 0))
    assert torch.equal(layer.bias.grad, g2.sum(0))
    assert not torch.equal(layer.weight.grad, mx(g2.t().contiguous(), "fp8_e5m2", 0) @ mx(x2, "fp8_e4m3", -1))


def test_nvfp4_linear_uses_each_tensors_own_amax_for_its_tensor_scale_and_stochastic_gradients():
    layer = _blocked_linear("nvfp4", rounding="stochastic")
    x = torch.randn(32, 64, requires_grad=True)
    weight = layer.weight.detach()
    expected = torch.nn.functional.linear(nvfp4_quantise(x.detach(), nvfp4_tensor_scale(x)).values,
                                          nvfp4_quantise(weight, nvfp4_tensor_scale(weight)).values,
                                          layer.bias.detach())
    grads, upstream = [], torch.randn(32, 48, generator=torch.Generator().manual_seed(5))
    for seed in (0, 0, 1):
        torch.manual_seed(seed)
        x.grad = None
        y = layer(x)
        assert torch.equal(y, expected)  # the forward rounds to nearest
        y.backward(upstream)
        grads.append(x.grad.clone())
    assert torch.equal(grads[0], grads[1]) and not torch.equal(grads[0], grads[2])  # seeded stochastic gradients


def test_block_format_cells_train_and_say_what_they_did(make_cfg, tmp_path):
    from bench.running.run import run_cell

    lenet = run_cell(make_cfg("model=lenet", "format=mxfp8", "train.max_steps=20", "train.log_every=10"))
    assert lenet["status"] == "ok", lenet["reason"]
    block = lenet["env"]["precision"]["block"]
    assert block["kind"] == "mx" and block["block_size"] == 32 and block["scale_mode"] == "floor"
    assert block["kept_in_high_precision"] == ["0", "3"]  # LeNet's convolutions stay FP32
    assert lenet["env"]["precision"]["setting"] == "mxfp8-mixed" and lenet["env"]["precision"]["backend"] == "emulated"
    nv = run_cell(make_cfg("model=lenet", "format=nvfp4", "format.rounding=stochastic", "train.max_steps=20",
                           "scaling=static"))
    assert nv["status"] == "ok", nv["reason"]
    assert nv["env"]["precision"]["block"]["rounding_of_gradients"] == "stochastic"


@pytest.mark.parametrize("overrides,message", [
    (["format=mxfp8", "scaling=per_tensor"], "valid for mxfp8: none, static, dynamic, unit, umup$"),
    (["format=fp8", "format.scale_mode=ceil"], "applies to the block formats only"),
    (["format=bf16", "format.rounding=stochastic"],
     "applies to fp8, mxfp8, mxfp6, mxfp4, nvfp4, nvfp4_recipe, not to format=bf16; valid there: nearest"),
    (["format=fp8", "format.gradients=fp8_e4m3"],
     "does not go with format=fp8; valid: null .*fp8_e4m3, fp8_e5m2 for mxfp8"),
    (["format=mxfp8", "format.gradients=fp6_e3m2"], "fp6_e2m3, fp6_e3m2 for mxfp6"),
    (["format=mxfp4", "format.scale_mode=round"], "valid: floor, ceil, even, rceil"),
    (["format=mxfp6", "format.rounding=up"], "valid: nearest, stochastic"),
    (["format=fp16", "scaling=rowwise"], "FP8 recipes.*valid for fp16: none, static, dynamic, per_tensor, unit, umup$"),
    (["format=mxfp8", "scaling=block"], "valid for mxfp8: none, static, dynamic, unit, umup$"),
    (["format=fp8", "scaling=block", "format.overflow=ieee"], "valid there: null or saturate"),
])
def test_block_format_combinations_that_do_not_exist_are_refused_before_training(make_cfg, overrides, message):
    from bench.running.config import ConfigError, check

    with pytest.raises(ConfigError, match=message):
        check(make_cfg("model=lenet", *overrides))


def test_the_registry_names_the_block_formats_the_yamls_offer():
    from bench.numerics.specs import block_formats
    from tests.conftest import CONF

    assert block_formats() == ["mxfp8", "mxfp6", "mxfp4", "nvfp4", "nvfp4_recipe"]
    assert set(block_formats()) <= {p.stem for p in (CONF / "format").glob("*.yaml")}


@pytest.mark.parametrize("recipe", ["rowwise", "rowwise_with_gw_hp"])
def test_rowwise_fp8_linear_is_torchaos_rowwise_recipe_bit_for_bit(recipe):
    """Forward, input gradient, weight gradient and bias gradient of scaling=rowwise's (and rowwise_with_gw_hp's)
    emulated Linear against torchao's Float8Linear under its recipe of that name (emulate=True: dequantise, FP32
    matmul), with inputs spanning nine binades across tokens and weights spanning four across features: scales
    per row, along each GEMM's reduction dimension, so one scale per tensor would give another answer."""
    import copy
    import dataclasses

    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    from bench.numerics.emulation import EmulatedLinear, FP8TileOperands

    torch.manual_seed(0)
    reference = torch.nn.Linear(256, 128)
    with torch.no_grad():
        reference.weight.mul_(torch.logspace(-2, 2, 256))
    ours = copy.deepcopy(reference)
    ours.__class__, ours.operands = EmulatedLinear, FP8TileOperands(SCALING_METHODS[recipe].tiles)
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=True)
    reference = convert_to_float8_training(torch.nn.Sequential(reference), config=config)[0]
    x = torch.randn(4, 32, 256) * torch.logspace(-3, 1, 32).view(1, 32, 1)
    x_ref, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    g = torch.randn(4, 32, 128) * 1e-3
    y_ref, y_ours = reference(x_ref), ours(x_ours)
    y_ref.backward(g)
    y_ours.backward(g)
    assert torch.equal(y_ours, y_ref) and torch.equal(x_ours.grad, x_ref.grad)
    assert torch.equal(ours.weight.grad, reference.weight.grad) and torch.equal(ours.bias.grad, reference.bias.grad)
    amax = x.abs().amax()
    tensorwise = torch.nn.functional.linear(quantise_value(x * (448 / amax), "fp8_e4m3") * (amax / 448),
                                            ours.weight.detach(), ours.bias.detach())
    assert not torch.equal(y_ours, tensorwise)
    # the recipes differ where they should: only rowwise_with_gw_hp's weight gradient is an FP32 GEMM's
    exact_weight_grad = g.reshape(-1, 128).t() @ x.reshape(-1, 256)
    assert torch.equal(ours.weight.grad, exact_weight_grad) == (recipe == "rowwise_with_gw_hp")


@pytest.mark.parametrize("amax,scale", [
    (448.0, 1.0), (449.0, 0.5), (447.0, 1.0), (0.0, 1.0), (float("inf"), 1.0), (1e-45, 2.0**127),
    (1.0, 256.0), (3.5, 128.0), (3.5 + 2.0**-22, 64.0),  # 448 / amax one float32 ulp under 128: floor, 64
])
def test_transformer_engines_power_of_two_scale_by_hand(amax, scale):
    """TE's compute_scale_from_amax with force_pow_2_scales and epsilon 0."""
    from bench.numerics.blocks import te_pow2_scale

    assert te_pow2_scale(torch.tensor([amax])).item() == scale


def test_torchaos_power_of_two_scale_rounds_up_just_below_a_power_of_two_where_te_floors():
    """amax one ulp above 3.5, 448 / amax one ulp under 128: TE floors to 64; torchao's float32 log2 rounds to 7
    and gives 128, so amax times its scale exceeds 448 and the cast saturates (the departure the conformance
    output names)."""
    from bench.numerics.blocks import te_pow2_scale, torchao_pow2_scale

    amax = torch.tensor([3.5 + 2.0**-22])
    assert te_pow2_scale(amax).item() == 64.0 and torchao_pow2_scale(amax).item() == 128.0
    assert (amax * 128).item() > 448


def test_block_scaled_fp8_uses_1x128_tiles_for_activations_and_gradients_and_128x128_for_weights():
    """Transformer Engine's Float8BlockScaling layout: each 1 x 128 run along the reduced dimension has its own
    scale; each 128 x 128 weight square one scale, the same for W (forward) and W^T (grad_input)."""
    from bench.numerics.blocks import te_pow2_scale, tile2d_quantise, tile_quantise
    from bench.numerics.emulation import FP8TileOperands

    torch.manual_seed(0)
    x = torch.randn(3, 300) * torch.exp2(torch.randint(-8, 8, (3, 300)).float())
    tiled = tile_quantise(x, -1)
    assert tiled.scale.shape == (3, 3)  # 128 + 128 + a 44-wide edge tile per row
    for row in range(3):
        for t, (lo, hi) in enumerate([(0, 128), (128, 256), (256, 300)]):
            s = te_pow2_scale(x[row, lo:hi].abs().amax())
            assert tiled.scale[row, t] == s
            assert torch.equal(tiled.values[row, lo:hi],
                               quantise_value(x[row, lo:hi] * s, "fp8_e4m3", overflow="saturate") / s)
    w = torch.randn(200, 300) * torch.exp2(torch.randint(-8, 8, (200, 300)).float())
    squares = tile2d_quantise(w)
    assert squares.scale.shape == (2, 3)
    assert squares.scale[1, 2] == te_pow2_scale(w[128:, 256:].abs().amax())
    operands = FP8TileOperands(SCALING_METHODS["block"].tiles)
    assert operands.weight_tiles and torch.equal(operands.tiled_weight(w), squares.values)
    assert not torch.equal(operands.tiled_weight(w), operands.forward(w, -1))  # and it is not 1 x 128


@pytest.mark.parametrize("path", ["eager", "fused"])
def test_a_side_shorter_than_a_tile_is_quantised_as_the_zero_padded_tile_bit_for_bit(path):
    """BERT-tiny's 64 features in 1 x 128 tiles, its 64 x 64 weights in 128 x 128 ones: quantised as one run (one
    tile) of their own length, they give the zero-padded tile's values, elements, scales and amaxes bit for bit, and
    under stochastic rounding its draws too (the padded tile's taken, the generator left where padding leaves it)."""
    from bench.numerics.blocks import tile2d_quantise, tile_quantise

    call = (lambda q: q.eager) if path == "eager" else (lambda q: q.fused)
    same = lambda a, b: torch.equal(a.contiguous().view(torch.int32), b.contiguous().view(torch.int32))  # NaN's too
    torch.manual_seed(0)
    x = torch.randn(6, 64) * torch.exp2(torch.randint(-8, 8, (6, 64)).float())
    x[0, 5], x[1] = float("nan"), 0.0  # a NaN run and a zero run keep their own scales
    for dim, along in ((-1, x), (0, x.T.contiguous())):
        wide = torch.nn.functional.pad(along, (0, 64)) if dim == -1 else torch.nn.functional.pad(along, (0, 0, 0, 64))
        for rounding in ("nearest", "stochastic"):
            short_generator, padded_generator = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
            short = call(tile_quantise)(along, dim, rounding=rounding, generator=short_generator)
            whole = call(tile_quantise)(wide, dim, rounding=rounding, generator=padded_generator)
            cut = (slice(None), slice(0, 64)) if dim == -1 else (slice(0, 64), slice(None))
            for field in ("values", "elements"):
                assert same(getattr(short, field), getattr(whole, field)[cut]), (dim, rounding, field)
            for field in ("scale", "amax", "factor"):
                assert same(getattr(short, field), getattr(whole, field)), (dim, rounding, field)
            assert torch.equal(short_generator.get_state(), padded_generator.get_state()), (dim, rounding)
    for w in (torch.randn(64, 64), torch.randn(64, 300), torch.randn(200, 40)):
        tiled = call(tile2d_quantise)(w)
        rows, cols = -w.shape[0] % 128, -w.shape[1] % 128
        reference = call(tile2d_quantise)(torch.nn.functional.pad(w, (0, cols, 0, rows)))
        assert same(tiled.values, reference.values[:w.shape[0], :w.shape[1]])
        assert same(tiled.elements, reference.elements[:w.shape[0], :w.shape[1]])
        for field in ("scale", "amax", "factor"):
            assert same(getattr(tiled, field), getattr(reference, field)), (w.shape, field)


def test_block_scaled_fp8_quantises_each_weight_once_per_step_for_both_of_its_gemms(monkeypatch):
    """One 128 x 128 quantisation serves the forward and the input-gradient GEMM (W and W^T hold the same tiles),
    as Transformer Engine keeps one quantised weight; rowwise scales run along each GEMM's reduction, so its weight
    is quantised for each GEMM that reads it."""
    import bench.numerics.emulation as emulation
    from bench.numerics.emulation import EmulatedLinear, FP8TileOperands

    weight_quantisations = []

    def counting(quantiser):
        def counted(t, *args, **kwargs):
            if t.shape == (200, 300):  # the weight's, not the activations' (8, 300) or the gradient's (8, 200)
                weight_quantisations.append(quantiser.__name__)
            return quantiser.values(t, *args, **kwargs)
        counted.values = counted  # a step asks for the values alone (emulation._values)
        return counted

    for name in ("tile2d_quantise", "tile_quantise", "rowwise_quantise"):
        monkeypatch.setattr(emulation, name, counting(getattr(emulation, name)))
    torch.manual_seed(0)
    for recipe, expected in (("block", ["tile2d_quantise"]), ("rowwise", ["rowwise_quantise"] * 2)):
        layer = EmulatedLinear(300, 200)
        layer.operands = FP8TileOperands(SCALING_METHODS[recipe].tiles)
        weight_quantisations.clear()
        layer(torch.randn(8, 300, requires_grad=True)).square().sum().backward()
        assert weight_quantisations == expected, recipe


def test_fp8_rowwise_and_block_cells_train_and_say_what_they_did(make_cfg):
    from bench.running.run import run_cell

    for scaling, kind in (("rowwise", "rowwise"), ("rowwise_with_gw_hp", "rowwise_with_gw_hp"), ("block", "block")):
        record = run_cell(make_cfg("model=bert_tiny", "format=fp8", f"scaling={scaling}", "train.max_steps=6",
                                   "train.log_every=3"))
        assert record["status"] == "ok", record["reason"]
        precision = record["env"]["precision"]
        assert precision["backend"] == "emulated" and precision["element_formats"] == ["fp8_e4m3"]
        assert precision["block"]["kind"] == kind and precision["block"]["kept_in_high_precision"] == []


def test_block_telemetry_counts_clipped_blocks_flushed_elements_error_and_scale_spread_by_hand():
    """Two MX E4M3 blocks under floor: the first's amax 1.99 * 2^8 clips to 448 (floor's scale 2^0 leaves it past
    448 + 16); the second holds 2^-20 beside 1.0, which flushes (below E4M3's smallest subnormal 2^-9 under scale
    2^-8). Then the same through a cell: every class of an mxfp8 LeNet run carries the statistics."""
    from bench.numerics.formats import FORMATS
    from bench.numerics.telemetry import QuantTelemetry

    x = torch.zeros(2, 32)
    x[0, 0], x[0, 1] = 1.99 * 2**8, 3.0
    x[1, 0], x[1, 1], x[1, 2] = 1.0, 2.0**-20, 0.5
    blocked = mx_quantise(x, "fp8_e4m3", "floor")
    telemetry = QuantTelemetry()
    telemetry.sampling = True
    telemetry.observe_blocks("activations", x, blocked, FORMATS["fp8_e4m3"])
    telemetry.end_step()
    stats = telemetry.summary()["activations"]["blocks"]
    assert stats["clipped_block_fraction"] == 0.5 and stats["flushed_fraction"] == 1 / 5
    error = ((x - blocked.values) ** 2).sum() / (x ** 2).sum()
    assert stats["relative_mse"] == pytest.approx(error.item(), rel=1e-6)
    assert (stats["log2_scale_min"], stats["log2_scale_max"]) == (-8.0, 0.0) and stats["blocks_sampled"] == 2


def test_block_format_cells_record_block_statistics_per_tensor_class(make_cfg):
    from bench.aggregate import main
    from bench.running.run import run_cell

    cfg = make_cfg("model=lenet", "format=mxfp4", "train.max_steps=10", "train.log_every=5")
    record = run_cell(cfg)
    quantisation = record["numerics"]["quantisation"]
    for tensor_class in ("weights", "activations", "gradients"):
        stats = quantisation[tensor_class]["blocks"]
        assert stats["blocks_sampled"] > 0 and 0 < stats["relative_mse"] < 0.5, (tensor_class, stats)
        assert stats["log2_scale_min"] <= stats["log2_scale_median"] <= stats["log2_scale_max"]
    assert quantisation["gradients"]["blocks"]["clipped_block_fraction"] > 0  # floor clips FP4 blocks
    assert main([cfg.results_dir, "--out", f"{cfg.results_dir}/tables", "--no-plots"]) == 0
    numerics = (Path(cfg.results_dir) / "tables" / cfg.experiment_name / "numerics.md").read_text()
    assert "gradients blocks clipped / flushed / rel. MSE" in numerics


def test_stochastic_fp8_tiles_round_only_the_gradients_unbiased_and_keep_their_scales():
    """scaling=rowwise|block with format.rounding=stochastic: gradient operands are rounded stochastically under the
    same power-of-two scales (the mean of many roundings is the input), forward operands to nearest."""
    from bench.numerics.blocks import rowwise_quantise, tile_quantise
    from bench.numerics.emulation import FP8TileOperands

    torch.manual_seed(0)
    x = torch.randn(4, 256) * torch.exp2(torch.randint(-6, 6, (4, 256)).float())
    for quantise in (rowwise_quantise, tile_quantise):
        nearest = quantise(x)
        draws = torch.stack([quantise(x, rounding="stochastic", generator=torch.Generator().manual_seed(k)).values
                             for k in range(400)])
        assert torch.equal(quantise(x, rounding="stochastic").scale, nearest.scale)
        spacing = (nearest.values - x).abs().max()
        assert (draws.mean(0) - x).abs().max() < 0.25 * spacing  # unbiased within 400 draws
        assert not torch.equal(draws[0], nearest.values)
    operands = FP8TileOperands(SCALING_METHODS["block"].tiles, "stochastic")
    assert torch.equal(operands.forward(x, -1), tile_quantise(x).values)  # the forward stays nearest
    assert not torch.equal(operands.gradient(x, -1), tile_quantise(x).values)


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_unit_scaling_puts_its_scales_around_the_block_scaled_gemm(fmt):
    """A unit-scaled Linear under a block format: output alpha * (the block-scaled GEMM + b), input gradient beta
    times the block GEMM's, weight and bias gradients batch^-1/2 times theirs: bit for bit what the plain
    block-scaled Linear computes on the same tensors, scaled."""
    import copy

    from bench.numerics.precision import Precision
    from bench.numerics.unit import UnitLinear, _linear_scales

    torch.manual_seed(0)
    unit = UnitLinear(64, 32)
    torch.nn.init.normal_(unit.bias)
    plain = torch.nn.Linear(64, 32)
    plain.load_state_dict(copy.deepcopy(unit.state_dict()))
    unit, plain = (Precision.of(fmt, torch.device("cpu"), mode="mixed", backend="emulated").prepare(layer)
                   for layer in (unit, plain))
    assert type(plain).__name__ == "EmulatedLinear" and plain.operands is not None and unit.operands is not None
    x = torch.randn(48, 64) * torch.exp2(torch.randint(-4, 4, (48, 1)).float())
    grad = torch.randn(48, 32)
    results = []
    for layer in (unit, plain):
        xi = x.clone().requires_grad_(True)
        y = layer(xi)
        y.backward(grad)
        results.append((y.detach(), xi.grad, layer.weight.grad, layer.bias.grad))
    (y_u, gx_u, gw_u, gb_u), (y_p, gx_p, gw_p, gb_p) = results
    alpha, beta = _linear_scales(unit.weight, None)
    assert torch.equal(y_u, y_p * alpha) and torch.equal(gx_u, gx_p * beta)
    assert torch.equal(gw_u, gw_p * 48**-0.5) and torch.equal(gb_u, gb_p * 48**-0.5)
    assert not torch.equal(y_p, torch.nn.functional.linear(x, plain.weight, plain.bias))  # the GEMM was blocked


def test_a_unit_scaled_model_trains_in_a_block_format_and_its_convolutions_stay_fp32(make_cfg):
    from bench.running.run import run_cell

    record = run_cell(make_cfg("model=lenet", "format=mxfp4", "scaling=unit", "train.max_steps=20",
                               "train.log_every=10"))
    assert record["status"] == "ok", record["reason"]
    block = record["env"]["precision"]["block"]
    assert block["kind"] == "mx" and block["kept_in_high_precision"] == ["0", "3"]  # the UnitConv2d layers
    assert record["numerics"]["quantisation"]["gradients"]["blocks"]["relative_mse"] > 0
