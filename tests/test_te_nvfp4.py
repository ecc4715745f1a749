"""NVFP4 as Transformer Engine computes it (format.scale_rule=te, format.sr_bits=8): each rule on a hand-made case
(the 168 tie, a block far below the tensor's amax, zero blocks, 8-bit stochastic rounding's probabilities), the
conformance rows against a reference written from TE's source in numpy and ml_dtypes, and the config's keys."""

import math

import numpy as np
import pytest
import torch

from bench.numerics.blocks import (
    nvfp4_quantise,
    nvfp4_tensor_scale,
    te_nvfp4_encode_scale,
    te_nvfp4_quantise,
    te_nvfp4_tile_quantise,
)
from bench.numerics.formats import quantise_stochastic, uniforms
from bench.running.config import ConfigError, check
from bench.tools import conformance


def _two_blocks(tensor_amax: float, block_amax: float) -> torch.Tensor:
    x = torch.zeros(2, 16)
    x[0, 0], x[1, 0] = tensor_amax, block_amax
    return x


def test_an_exact_168_settles_at_160_by_torchaos_order_and_176_by_tes():
    """Tensor amax 768, block amax 288: torchao's (288 / 6) / (768 / 2688) is exactly 168, an E4M3 midpoint, which
    rounds to even (160); TE's 288 x (3.5 x fl(1/6)) is a little above 168 and rounds up (176)."""
    x = _two_blocks(768.0, 288.0)
    assert nvfp4_quantise(x, nvfp4_tensor_scale(x)).scale[1].item() == 160.0
    assert te_nvfp4_quantise(x, x.abs().max()).scale[1].item() == 176.0


def test_a_block_far_below_the_tensor_amax_keeps_a_subnormal_scale_under_te():
    """Tensor amax 2688 (S_enc = 1): a block of amax 0.012 gets the E4M3 subnormal 2^-9 under TE; torchao clamps
    its scale to 2^-6, and its smaller elements round to zero."""
    x = _two_blocks(2688.0, 0.012)
    x[1, 1:] = torch.linspace(0.001, 0.011, 15)
    te = te_nvfp4_quantise(x, x.abs().max())
    torchao = nvfp4_quantise(x, nvfp4_tensor_scale(x))
    assert te.scale[1].item() == 2.0**-9 and torchao.scale[1].item() == 2.0**-6
    error = lambda b: ((b.values[1] - x[1]).norm() / x[1].norm()).item()
    assert error(te) < 0.15 < 0.3 < error(torchao)
    assert int((te.values[1] == 0).sum()) < int((torchao.values[1] == 0).sum())


def test_zero_blocks_and_a_zero_tensor_get_scale_zero_and_stay_zero():
    x = _two_blocks(3.0, 0.0)
    te = te_nvfp4_quantise(x, x.abs().max())
    assert te.scale[1].item() == 0.0 and torch.equal(te.values[1], torch.zeros(16))
    zero = te_nvfp4_quantise(torch.zeros(2, 16), torch.tensor(0.0))
    assert torch.equal(zero.values, torch.zeros(2, 16)) and not zero.values.isnan().any()
    assert te_nvfp4_encode_scale(torch.tensor(0.0)).item() == 1.0
    assert te_nvfp4_encode_scale(torch.tensor(math.inf)).item() == 1.0
    assert te_nvfp4_encode_scale(torch.tensor(1e-40)).item() == torch.finfo(torch.float32).max


def test_the_encode_scale_is_2688_over_the_amax_rounded_once_as_tes_cuda_divides():
    """S_enc = 448 * 6 / amax, one FP32 division in TE's compute_global_encode_scaling_factor_FP4, against numpy's
    FP32 division, over amaxes of every magnitude: Python's `2688 / amax` on a tensor is its reciprocal times 2688,
    and missed by one unit in the last place for about a quarter of amaxes."""
    generator = torch.Generator().manual_seed(0)
    amax = torch.rand(2**17, generator=generator) * 2.0 ** torch.randint(-120, 120, (2**17,), generator=generator)
    expected = np.minimum(np.float32(2688.0) / amax.numpy(), np.finfo(np.float32).max)
    assert np.array_equal(te_nvfp4_encode_scale(amax).numpy().view(np.int32), expected.view(np.int32))


@pytest.mark.parametrize("rule_quantiser", ["vector", "tiles"])
def test_te_rules_match_the_reference_written_from_tes_source_on_every_family(rule_quantiser):
    """0 mismatches on every adversarial family (blocks far below the tensor amax, ties on BF16 data, zeros,
    subnormals, scale boundaries); torchao's rule differs there, each difference named."""
    compare = (lambda x: conformance.compare_nvfp4_with_te(x, "te")) if rule_quantiser == "vector" \
        else conformance.compare_te_tiles_with_reference
    departures = 0
    for family, x in conformance.families("fp4_e2m1", 16, 2**12).items():
        counts = compare(x)
        assert counts["scale_mismatches"] == counts["value_mismatches"] == 0, family
        if rule_quantiser == "vector":
            torchao = conformance.compare_nvfp4_with_te(x, "torchao")
            assert torchao["scale_mismatches"] == torchao["value_mismatches"] == 0
            departures += torchao["torchao_scale_clamp"] + torchao["torchao_scale_order"]
    assert departures > 0 or rule_quantiser == "tiles"


def test_the_transform_in_bf16_then_te_blocks_match_the_reference():
    x = conformance.families("fp4_e2m1", 16, 2**12)["random"]
    counts = conformance.compare_te_rht_with_reference(x)
    assert counts["value_mismatches"] == 0 and counts["rht_fp32_arithmetic"] < counts["values"]


@pytest.mark.parametrize("fraction", [1 / 512, 3 / 512, 0.25, 0.5, 0.999])
def test_eight_bit_stochastic_rounding_rounds_up_with_probability_floor_256_f_over_256(fraction):
    """E2M1 between 1 and 1.5 (spacing 0.5): x = 1 + 0.5 f rounds up with probability floor(256 f) / 256 from 8
    random bits (exactly never for f < 1/256), f from an FP32 uniform. 2^16 draws; a 5-sigma band, so a false
    alarm on a correct rounding is under 1 in 10^6 per case."""
    n = 1 << 16
    x = torch.full((n,), 1 + 0.5 * fraction)
    for bits, expected in ((8, math.floor(256 * fraction) / 256), (None, fraction)):
        up = (quantise_stochastic(x, "fp4_e2m1", torch.Generator().manual_seed(0), bits=bits) == 1.5).float().mean()
        sigma = math.sqrt(max(expected * (1 - expected), 1 / n) / n)
        assert abs(up.item() - expected) <= 5 * sigma, (bits, up.item(), expected)
    if fraction < 1 / 256:
        assert not (quantise_stochastic(x, "fp4_e2m1", torch.Generator().manual_seed(1), bits=8) == 1.5).any()


def test_eight_bit_draws_are_the_int64_streams_and_leave_the_generator_where_it_left():
    """`uniforms(..., bits=8)` draws its integers as FP32 (faster); they are the draws the committed stochastic cells
    made, torch.randint's int64 integers over 256, and the generator ends where that left it."""
    generators = [torch.Generator().manual_seed(11) for _ in range(2)]
    shape = (3, 1000, 7)
    ours = uniforms(shape, torch.device("cpu"), generators[0], 8)
    reference = torch.randint(0, 256, shape, generator=generators[1]).float() / 256
    assert ours.dtype == torch.float32 and torch.equal(ours, reference)
    assert torch.equal(torch.rand(16, generator=generators[0]), torch.rand(16, generator=generators[1]))


def test_a_te_weight_tile_rounds_to_nearest_under_its_tile_scale():
    w = torch.randn(32, 48, generator=torch.Generator().manual_seed(0))
    tiles = te_nvfp4_tile_quantise(w, w.abs().max())
    assert tiles.scale.shape == (2, 3) and torch.equal(tiles.values, te_nvfp4_tile_quantise(w, w.abs().max()).values)


@pytest.mark.parametrize("overrides,message", [
    (["format=fp8", "format.scale_rule=te"], r"format.scale_rule=te is NVFP4's \(nvfp4, nvfp4_recipe\), not "
                                             "format=fp8's; valid there: format.scale_rule=torchao"),
    (["format=nvfp4", "format.scale_rule=cublas"], "valid: torchao, te"),
    (["format=nvfp4", "format.sr_bits=8"], "format.rounding=nearest; valid there: format.sr_bits=null"),
    (["format=mxfp8", "format.rounding=stochastic", "format.sr_bits=8"], "not of format=mxfp8"),
    (["format=nvfp4_recipe", "format.sr_bits=4"], "format.sr_bits.*valid: 8"),
])
def test_te_keys_where_they_do_not_apply_are_refused_naming_the_valid_choices(make_cfg, overrides, message):
    with pytest.raises(ConfigError, match=message):
        check(make_cfg("model=lenet", *overrides))


def test_a_te_cell_trains_records_its_rule_and_is_another_run(make_cfg):
    from omegaconf import OmegaConf

    from bench.running.identity import cell_path, run_id
    from bench.running.run import run_cell

    ident = lambda cfg: run_id(OmegaConf.to_container(cfg, resolve=True))

    args = ("model=bert_tiny", "format=nvfp4_recipe", "train.max_steps=2", "train.log_every=1")
    te = make_cfg(*args, "format.scale_rule=te", "format.sr_bits=8")
    record = run_cell(te)
    assert record["status"] == "ok", record["reason"]
    assert record["env"]["precision"]["block"]["scale_rule"] == "te"
    assert record["env"]["precision"]["block"]["sr_bits"] == 8
    torchao = make_cfg(*args)
    assert ident(te) != ident(torchao)
    assert ident(make_cfg(*args, "format.scale_rule=torchao")) == ident(torchao)
    assert "format.scale_rule" in cell_path(te, {}, [])  # named (here among shortened keys), never the default's place
