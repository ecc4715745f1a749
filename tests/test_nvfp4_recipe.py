"""NVIDIA's NVFP4 recipe, part by part, against independent references: the random Hadamard transform against
scipy's Hadamard matrix and Transformer Engine's signs, 16 x 16 weight tiles against ml_dtypes' E4M3 and E2M1
casts, stochastic gradients statistically, the weight-gradient GEMM against torchao's nvfp4_quantize of the
transformed operands; each switch's record, identity and place; each mistake refused before training."""

import math
import re
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
import scipy.linalg
import torch

from bench.numerics.blocks import (
    TE_RHT_SIGNS,
    hadamard,
    nvfp4_tensor_scale,
    nvfp4_tile_quantise,
    random_hadamard_transform,
    rht_matrix,
    rht_signs,
)
from bench.numerics.plan import PrecisionError, kept_layers
from bench.numerics.precision import Precision
from bench.running.config import ConfigError, check


def _nvfp4_linear(in_features=64, out_features=48, **switches):
    """A Linear in emulated NVFP4 with the recipe's `switches` (PrecisionConfig's fields), FP32 elsewhere."""
    from bench.numerics.plan import PrecisionConfig, plan
    from bench.numerics.scaling_methods import scaling_class

    torch.manual_seed(0)
    layer = torch.nn.Linear(in_features, out_features)
    method = scaling_class("none")(name="none")
    config = PrecisionConfig("nvfp4", backend="emulated", scaling="none", **switches)
    layer = Precision.from_plan(plan(config, method, torch.device("cpu")), method, torch.device("cpu")).prepare(layer)
    return layer


# --- the random Hadamard transform ------------------------------------------------------------------------------

def test_the_hadamard_matrix_is_sylvesters_over_four_and_the_signs_are_transformer_engines():
    assert torch.equal(hadamard(16), torch.from_numpy(scipy.linalg.hadamard(16).astype(np.float64)) / 4)
    assert torch.equal(rht_matrix(None), torch.diag(torch.tensor(TE_RHT_SIGNS, dtype=torch.float64)) @ hadamard(16))
    assert TE_RHT_SIGNS == (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)  # nvfp4_tensor.py's vector


@pytest.mark.parametrize("seed", [None, 0, 7])
def test_the_transform_is_orthogonal_a_seed_draws_other_signs_and_each_unit_vector_becomes_a_row(seed):
    """rht_matrix is the definition; the transform, which takes the signs, maps each unit vector to its row (sums
    with zeros are exact)."""
    matrix = rht_matrix(seed)
    assert torch.equal(matrix @ matrix.t(), torch.eye(16, dtype=torch.float64))
    assert set(torch.diag(matrix @ hadamard(16).t()).tolist()) <= {-1.0, 1.0}  # a +-1 diagonal times H
    if seed is not None:
        assert not torch.equal(matrix, rht_matrix(None)) and torch.equal(matrix, rht_matrix(seed))
    assert torch.equal(random_hadamard_transform(torch.eye(16), rht_signs(seed), 0), matrix.t().float())


def test_the_matrix_as_before_0_3_is_multiplied_as_then_with_a_deprecation_warning():
    x = torch.randn(40, 24, generator=torch.Generator().manual_seed(3))
    with pytest.warns(DeprecationWarning, match="takes the 16 signs now"):
        found = random_hadamard_transform(x, rht_matrix(None), 0)
    padded = torch.nn.functional.pad(x, (0, 0, 0, 8)).reshape(-1, 16, 24)
    assert torch.equal(found, (rht_matrix(None).float().t() @ padded).reshape(48, 24))


def _in_place_fwht_in_numpy(groups: np.ndarray, signs: np.ndarray) -> np.ndarray:
    """The reference order, written apart in numpy's float32: each value times its sign / 4, then the in-place fast
    Walsh-Hadamard transform over axis 1 (pairs `width` apart for width 1, 2, 4, 8; the first gets the sum)."""
    rows = groups.astype(np.float32) * (signs.astype(np.float32) / np.float32(4))[None, :, None]
    width = 1
    with np.errstate(over="ignore", invalid="ignore"):  # the mixed extremes overflow, as FP32 does
        while width < 16:
            for start in range(0, 16, 2 * width):
                first, second = rows[:, start:start + width].copy(), rows[:, start + width:start + 2 * width].copy()
                rows[:, start:start + width], rows[:, start + width:start + 2 * width] = first + second, first - second
            width *= 2
    return rows


@pytest.mark.parametrize("path", ["eager", "fused"])
def test_the_transform_rounds_in_one_order_on_every_machine_the_in_place_fast_walsh_hadamard_transforms(path):
    """Bit for bit against numpy's float32 in the in-place FWHT's order, eager and fused, on random values across
    2^+-20 and on the conformance families: the bits depend on no BLAS kernel (an FP32 GEMM's changed with the
    instruction set oneDNN and MKL were allowed, AVX2 against AVX-512). About half the values differ from the
    correctly rounded transform, so any other order of the sums (the GEMM's, the pairs taken 8 apart first) fails
    here."""
    from bench.tools.conformance import _as_tiles, families

    transform = getattr(random_hadamard_transform, path)
    generator = torch.Generator().manual_seed(5)
    inputs = [torch.randn(256, 48, generator=generator) * torch.exp2(torch.randint(-20, 20, (256, 48),
                                                                                   generator=generator))]
    inputs += [w for w in map(_as_tiles, families("fp4_e2m1", 16, count=2**12).values()) if len(w)]
    for x in inputs:
        expected = _in_place_fwht_in_numpy(x.numpy().reshape(-1, 16, x.shape[1]), rht_signs(None).numpy())
        found = transform(x, rht_signs(None), 0).numpy()
        expected = expected.reshape(found.shape)
        same = (found.view(np.int32) == expected.view(np.int32)) | (np.isnan(found) & np.isnan(expected))
        assert same.all(), (found[~same][:4], expected[~same][:4])
    exact = (rht_matrix(None).t() @ inputs[0].double().reshape(-1, 16, 48)).reshape(256, 48).float()
    assert 0.3 < (transform(inputs[0], rht_signs(None), 0) != exact).float().mean() < 0.7


@pytest.mark.parametrize("tokens", [96, 100, 7])  # whole groups of 16, a partial last group, fewer than 16
def test_the_transform_leaves_an_unquantised_product_unchanged(tokens):
    generator = torch.Generator().manual_seed(tokens)
    grad = torch.randn(tokens, 24, generator=generator) * torch.exp2(
        torch.randint(-8, 8, (tokens, 1), generator=generator))
    x = torch.randn(tokens, 40, generator=generator)
    signs = rht_signs(None)
    product = random_hadamard_transform(grad, signs, 0).t().double() @ random_hadamard_transform(x, signs, 0).double()
    exact = grad.t().double() @ x.double()
    assert (product - exact).abs().max() <= 1e-6 * exact.abs().max()
    transformed = random_hadamard_transform(grad, signs, 0)
    assert transformed.shape[0] == 16 * math.ceil(tokens / 16) and not torch.allclose(transformed[:tokens], grad)


def test_the_transform_is_scipys_hadamard_times_te_signs_to_fp32_accumulation():
    """Against scipy's Hadamard matrix and TE's signs in float64: each product by +-1/4 is exact, and the sum of 16
    rounds in FP32, within 16 ulps of the group's largest magnitude."""
    generator = torch.Generator().manual_seed(9)
    x = torch.randn(64, 32, generator=generator) * torch.exp2(torch.randint(-20, 20, (64, 32), generator=generator))
    reference_matrix = torch.diag(torch.tensor(TE_RHT_SIGNS, dtype=torch.float64)) \
        @ torch.from_numpy(scipy.linalg.hadamard(16).astype(np.float64)) / 4
    groups = x.double().reshape(-1, 16, 32)
    reference = (reference_matrix.t() @ groups).reshape(x.shape)
    ours = random_hadamard_transform(x, rht_signs(None), 0).double()
    bound = 16 * 2.0**-24 * groups.abs().amax(1, keepdim=True).expand_as(groups).reshape(x.shape)
    assert ((ours - reference).abs() <= bound).all()
    assert not torch.equal(ours, random_hadamard_transform(x, rht_signs(1), 0).double())


def test_the_weight_gradient_gemm_takes_both_operands_transformed_then_blocked_along_the_tokens():
    """The layer's weight gradient, bit for bit: the output gradient and the input transformed along the tokens,
    each then quantised by torchao's nvfp4_quantize (blocks of 16 along the tokens, its tensor scale from the
    transformed amax). The input gradient is plain NVFP4's: the transform touches the weight-gradient GEMM only."""
    from torchao.prototype.mx_formats.kernels import f4_unpacked_to_f32, unpack_uint4
    from torchao.prototype.mx_formats.nvfp4_tensor import nvfp4_quantize, per_tensor_amax_to_scale

    def torchao_along_tokens(t):  # (tokens, features) blocked along the tokens: torchao blocks its last dimension
        rows = t.t().contiguous()
        scale_t = per_tensor_amax_to_scale(rows.abs().amax())
        scale, data = nvfp4_quantize(rows, 16, scale_t)
        elements = f4_unpacked_to_f32(unpack_uint4(data)).reshape(rows.shape)
        return (elements.reshape(rows.shape[0], -1, 16)
                * (scale_t * scale.float()).unsqueeze(-1)).reshape(rows.shape).t()

    layer, plain = _nvfp4_linear(rht=True), _nvfp4_linear()
    x = torch.randn(40, 64, generator=torch.Generator().manual_seed(1)).requires_grad_()  # 40 tokens: padded to 48
    upstream = torch.randn(40, 48, generator=torch.Generator().manual_seed(2))
    layer(x).backward(upstream)
    transformed = [random_hadamard_transform(t, rht_signs(None), 0) for t in (upstream, x.detach())]
    expected = torchao_along_tokens(transformed[0]).t() @ torchao_along_tokens(transformed[1])
    assert torch.equal(layer.weight.grad, expected)
    x_grad = x.grad.clone()
    x.grad = None
    plain(x).backward(upstream)
    assert torch.equal(x.grad, x_grad)
    assert not torch.equal(plain.weight.grad, layer.weight.grad)


# --- 16 x 16 weight tiles ---------------------------------------------------------------------------------------

def _tile_reference(w: torch.Tensor):
    """Each 16 x 16 tile's E4M3 scale and E2M1 elements by the definition, cast by ml_dtypes: s = E4M3(clamp(tile
    amax / 6 / t, 2^-6, 448)) under t = tensor amax / 2688 (floored at 2^-121), elements RNE(x * ((1 / t) / s))."""
    t = np.float32(max(np.float32(np.abs(w.numpy()).max()) / np.float32(2688.0), np.float32(2.0**-121)))
    rows, cols = w.shape
    scales = np.zeros((rows // 16, cols // 16), np.float32)
    values = np.zeros_like(w.numpy())
    for i in range(rows // 16):
        for j in range(cols // 16):
            tile = w.numpy()[16 * i:16 * i + 16, 16 * j:16 * j + 16]
            wanted = np.clip(np.float32(np.abs(tile).max()) / np.float32(6.0) / t, 2.0**-6, 448.0).astype(np.float32)
            s = wanted.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
            scaled = np.clip(tile * ((np.float32(1.0) / t) / s), -6, 6).astype(np.float32)
            values[16 * i:16 * i + 16, 16 * j:16 * j + 16] = \
                scaled.astype(ml_dtypes.float4_e2m1fn).astype(np.float32) * (s * t)
            scales[i, j] = s
    return torch.from_numpy(scales), torch.from_numpy(values)


def _adversarial_weights():
    """The conformance's families for 16-blocks, laid out as weights of whole 16 x 16 tiles."""
    from bench.tools.conformance import families

    for name, x in families("fp4_e2m1", 16, count=2**14).items():
        flat = x.float()[x.float().isfinite().all(-1)].flatten()
        usable = flat[: flat.numel() // 256 * 256]
        if usable.numel():
            yield name, usable.reshape(-1, 64) if usable.numel() % 1024 == 0 else usable.reshape(-1, 16)


@pytest.mark.parametrize("name,w", list(_adversarial_weights()), ids=lambda v: v if isinstance(v, str) else "")
def test_each_tile_scale_is_the_e4m3_encoding_of_its_amax_over_six_under_the_tensor_scale(name, w):
    blocked = nvfp4_tile_quantise(w, nvfp4_tensor_scale(w))
    scales, values = _tile_reference(w)
    assert torch.equal(blocked.scale, scales), name
    assert torch.equal(blocked.values, values), name


def test_tiled_weights_serve_the_forward_and_the_input_gradient_gemm_alike():
    layer = _nvfp4_linear(weight_blocks="16x16")
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(3)).requires_grad_()
    upstream = torch.randn(32, 48, generator=torch.Generator().manual_seed(4))
    tiled = nvfp4_tile_quantise(layer.weight.detach(), nvfp4_tensor_scale(layer.weight)).values
    from bench.numerics.blocks import nvfp4_quantise

    def nv(t, dim):
        return nvfp4_quantise(t, nvfp4_tensor_scale(t), dim).values

    y = layer(x)
    assert torch.equal(y, nv(x.detach(), -1) @ tiled.t() + layer.bias.detach())
    y.backward(upstream)
    assert torch.equal(x.grad, nv(upstream, -1) @ tiled)
    assert not torch.equal(x.grad, nv(upstream, -1) @ nv(layer.weight.detach(), 0))  # what 1 x 16 blocks give


# --- stochastic gradients ---------------------------------------------------------------------------------------

def test_stochastic_rounding_of_the_gradients_is_unbiased_on_the_gradient_path():
    """The mean of the input gradient over 4,000 stochastic roundings of the gradient against the exact product of the
    unrounded gradient and the quantised weight (stochastic rounding inside the blocks' range is unbiased: E[SR(g)] = g,
    and each block's scale is deterministic). Each of the 64 checked elements' z-score against its own spread must stay
    under 5.6: for a random seed the chance that an unbiased rounding fails is under 1.4e-6 (Bonferroni over 64 normal
    tails of 2.2e-8 each). Round-to-nearest fails the same test. Every block of 16 of the gradient has amax 1 (so does
    the tensor): its E4M3 scale 448 is exact and no element saturates, which would bias any rounding (a block whose
    scale rounds down clips its largest elements to 6, as in Transformer Engine)."""
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(5))
    upstream = (torch.randn(16, 48, generator=torch.Generator().manual_seed(6)) * 0.3).clamp(-0.9, 0.9)
    upstream[:, ::16] = torch.where(upstream[:, ::16] < 0, -1.0, 1.0)

    def input_gradients(rounding, draws):
        """One backward pass over `draws` copies of the batch: each row of the gradient is its own blocks (so its
        own draws), under the same tensor scale (every copy has amax 1)."""
        layer = _nvfp4_linear(weight_blocks="16x16", rounding=rounding)
        weight = nvfp4_tile_quantise(layer.weight.detach(), nvfp4_tensor_scale(layer.weight)).values
        copies = x.detach().repeat(draws, 1).requires_grad_()
        torch.manual_seed(0)
        layer(copies).backward(upstream.repeat(draws, 1))
        samples = copies.grad.reshape(draws, *x.shape)[:, :4, :16].reshape(draws, -1)
        return samples.double(), (upstream @ weight)[:4, :16].flatten().double()

    samples, exact = input_gradients("stochastic", 4000)
    z = (samples.mean(0) - exact) / (samples.std(0) / math.sqrt(len(samples)))
    assert z.abs().max() < 5.6, z.abs().max()
    nearest, exact = input_gradients("nearest", 2)
    assert torch.equal(nearest[0], nearest[1]) and (nearest[0] - exact).abs().max() > 1e-3  # biased, deterministic


# --- keep_high_precision ------------------------------------------------------------------------------------------

LINEARS = ["h.0.attn.c_attn", "h.0.mlp.c_fc", "h.1.attn.c_attn", "h.1.mlp.c_fc", "lm_head"]


@pytest.mark.parametrize("patterns,kept", [
    (("first:1",), ["h.0.attn.c_attn"]),
    (("last:2",), ["h.1.mlp.c_fc", "lm_head"]),
    (("*.c_fc", "lm_head"), ["h.0.mlp.c_fc", "h.1.mlp.c_fc", "lm_head"]),
    (("first:1", "h.0.*"), ["h.0.attn.c_attn", "h.0.mlp.c_fc"]),
    (("head",), ["lm_head"]),
    (("last_blocks:1",), ["h.1.attn.c_attn", "h.1.mlp.c_fc"]),
    (("head", "first_blocks:1"), ["h.0.attn.c_attn", "h.0.mlp.c_fc", "lm_head"]),
    (("first_blocks:2",), LINEARS[:4]),
])
def test_keep_high_precision_selects_layers_by_position_block_head_or_glob(patterns, kept):
    assert kept_layers(LINEARS, patterns, blocks="h") == kept


def test_the_paper_layer_choice_on_the_char_lm_keeps_its_head_and_last_block(make_cfg, text_file):
    """format=nvfp4_recipe's default: the output head and the last of the char-LM's 4 blocks in BF16 (the paper
    keeps its head, and whole blocks); keep_high_precision=null quantises them; [head] keeps the head alone."""
    from bench.running.run import build_task, preflight

    def kept(*overrides):
        cfg = make_cfg("model=charlm", f"model.data.path={text_file}", "model.data.source=local",
                       "model.data.sha256=null", *overrides)
        _, precision = preflight(cfg)
        task = build_task(cfg.model, torch.device("cpu"), 0)
        precision.prepare(task.model, cfg.model.task.blocks)
        return (precision.conversion or {}).get("kept_by_request", [])

    assert kept("format=nvfp4_recipe") == [f"h.3.{m}" for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc",
                                                                 "mlp.c_proj")] + ["lm_head"]
    assert kept("format=nvfp4") == []  # plain NVFP4 quantises every Linear, as its pinned runs did
    assert kept("format=nvfp4", "format.keep_high_precision=[head]") == ["lm_head"]
    assert kept("format=nvfp4_recipe", "format.keep_high_precision=null", "format.pad_weights=true") == []


@pytest.mark.parametrize("patterns,message", [
    (("*.c_proj",), r"'\*.c_proj' matches no Linear layer; valid: first:<n>, last:<n>, head, or a glob over these: "
                    "h.0"),
    (("last:9",), "last:9 asks for 9 Linear layers; the model has 5"),
    (("last_blocks:3",), r"last_blocks:3 asks for 3 blocks; the model has 2 \(h.\*\)"),
])
def test_a_keep_high_precision_pattern_that_keeps_nothing_is_refused(patterns, message):
    with pytest.raises(PrecisionError, match=message):
        kept_layers(LINEARS, patterns, blocks="h")


def test_counting_blocks_of_a_model_that_declares_none_is_refused_naming_the_valid_choices():
    with pytest.raises(PrecisionError, match=r"last_blocks:1 counts blocks, and this model declares none "
                                             r"\(model.task.blocks\); valid: first:<n>, last:<n>, head"):
        kept_layers(["7", "9", "11"], ("last_blocks:1",))


def test_kept_layers_compute_outside_the_format_and_the_record_says_their_share_of_the_gemm_flops(make_cfg):
    from bench.running.run import run_cell

    record = run_cell(make_cfg("model=lenet", "format=nvfp4", "format.keep_high_precision=[last:1]",
                               "train.max_steps=3", "train.log_every=1"))
    assert record["status"] == "ok", record["reason"]
    kept = record["env"]["precision"]["keep_high_precision"]
    assert kept["layers"] == ["11"] and kept["asked"] == ["last:1"] and kept["computes_in"] == "bf16"
    # LeNet's Linears see the same rows: each one's share is in x out over the sum (400x120, 120x84, 84x10)
    assert kept["gemm_flop_share"] == pytest.approx(84 * 10 / (400 * 120 + 120 * 84 + 84 * 10), rel=1e-9)
    assert "11" in record["env"]["precision"]["block"]["kept_in_high_precision"]


def test_every_recipe_switch_is_recorded(make_cfg):
    from bench.running.run import run_cell

    record = run_cell(make_cfg("model=lenet", "format=nvfp4_recipe", "format.keep_high_precision=[first:1]",
                               "format.pad_weights=true", "format.rht_seed=3", "train.max_steps=2",
                               "train.log_every=1"))
    assert record["status"] == "ok", record["reason"]
    block = record["env"]["precision"]["block"]
    assert block["weight_blocks"] == "16x16" and block["rounding_of_gradients"] == "stochastic"
    assert (block["rht"]["seed"] == 3
            and block["rht"]["signs"] == torch.diag(rht_matrix(3) @ hadamard(16).t()).int().tolist())
    assert block["rht"]["output"] == "bf16"  # BF16 elsewhere: Transformer Engine's transform writes BF16


# --- identity and place -------------------------------------------------------------------------------------------

def test_the_switches_enter_a_runs_identity_and_place_only_when_not_default(make_cfg):
    from omegaconf import OmegaConf

    from bench.running.identity import cell_path, run_id

    def ident(*overrides):
        cfg = make_cfg("format=nvfp4", *overrides)
        return run_id(OmegaConf.to_container(cfg, resolve=True)), cell_path(cfg, {}, list(overrides))

    plain = ident()
    assert ident("format.rht=false", "format.weight_blocks=1x16", "format.pad_weights=false") == plain
    assert ident("format.rht=true")[0] != plain[0] and "format.rht=True" in ident("format.rht=true")[1]
    full = make_cfg("format=nvfp4_recipe")
    less = make_cfg("format=nvfp4_recipe", "format.rht=false")
    assert cell_path(full, {}, []) != cell_path(less, {}, ["format.rht=false"])


# --- bad input ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("overrides,message", [
    (["format=mxfp8", "format.rht=true"], r"format.rht=True needs a format in blocks of 16 \(nvfp4, nvfp4_recipe\), "
                                          "not format=mxfp8; valid there: format.rht=False"),
    (["format=fp8", "format.weight_blocks=16x16"], "needs a format in blocks of 16"),
    (["format=nvfp4", "format.weight_blocks=32x32"], "valid: 1x16, 16x16"),
    (["format=bf16", "format.keep_high_precision=[last:1]"], "applies to the formats of the GEMM operands only"),
    (["format=nvfp4", "format.keep_high_precision=[last:0]"], "first_blocks:<n> or last_blocks:<n> with n >= 1"),
    (["format=nvfp4", "format.keep_high_precision=[last_blocks:x]"], "last_blocks:<n> with n >= 1, head"),
    (["format=nvfp4", "format.rht_seed=4"], "valid: format.rht=true with it"),
])
def test_switches_that_do_not_apply_are_refused_naming_the_valid_choices(make_cfg, overrides, message):
    with pytest.raises(ConfigError, match=message):
        check(make_cfg("model=lenet", *overrides))


@pytest.mark.parametrize("overrides,message", [
    (["format=nvfp4", "format.weight_blocks=16x16"],
     r"format.weight_blocks=16x16: 7 is 120 x 400, not whole 16 x 16 tiles .*valid: format.pad_weights=true"),
    pytest.param(["format=nvfp4", "format.keep_high_precision=[last_blocks:1]"],
                 r"last_blocks:1 counts blocks, and this model declares none \(model.task.blocks\)",
                 marks=pytest.mark.slow),
    pytest.param(["format=nvfp4", "format.keep_high_precision=[conv*]"],
                 "'conv\\*' matches no Linear layer; valid: first:<n>, last:<n>, head, or a glob over these: 7, 9, 11",
                 marks=pytest.mark.slow),  # the same preflight path as above; kept_layers' message is tested fast
])
def test_mistakes_only_the_model_shows_exit_2_before_training_writing_nothing(tmp_path, overrides, message):
    """A sweep (two seeds): refused by its preflight, which builds the model where the format names layers."""
    done = subprocess.run([sys.executable, "-m", "bench.run", "-m", "model=lenet", "seed=0,1",
                           f"results_dir={tmp_path}", *overrides],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    assert re.search(message, done.stdout + done.stderr)
    assert not any(tmp_path.iterdir())


def test_a_padded_16x16_weight_trains(make_cfg):
    from bench.running.run import run_cell

    record = run_cell(make_cfg("model=lenet", "format=nvfp4", "format.weight_blocks=16x16", "format.pad_weights=true",
                               "train.max_steps=3", "train.log_every=1"))
    assert record["status"] == "ok", record["reason"]
    assert record["env"]["precision"]["block"]["pad_weights"] is True
