"""Masked-LM pretraining from scratch (bench/tasks/mlm.py) and unit scaling of transformers encoders, attention
included (bench/numerics/unit.py's registry route): the masking rule, unit scale at initialisation against a plain
model, one converted forward and backward against the same model written from unit_scaling's functional ops."""

import math
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import unit_scaling.functional as U
from omegaconf import OmegaConf
from unit_scaling.core.functional import scale_elementwise

from bench.data import DATA_DIR
from bench.errors import ConfigError
from bench.numerics.unit import UnitAttention, unit_cross_entropy, unit_scale
from bench.tasks.mlm import IGNORED, build_encoder, mask_tokens, non_special_ids, tokenizer_of

TOKENIZER = tokenizer_of(OmegaConf.create({"vocab": str(DATA_DIR / "vocab.txt")}))
VOCABULARY, MASK_ID, CANDIDATES = len(TOKENIZER), TOKENIZER.mask_token_id, non_special_ids(TOKENIZER)
FIRST = int(CANDIDATES.min())  # the shipped vocabulary's special tokens come first


def _encoder(family: str, layers: int = 2, dropout: float | None = None):
    cfg = OmegaConf.create({"arch": {"family": family, "layers": layers, "hidden": 64, "heads": 2,
                                     "intermediate": 128, "block_size": 64, "dropout": dropout},
                            "tie_embeddings": True})
    return build_encoder(cfg, TOKENIZER)


@pytest.mark.parametrize("family", ["distilbert", "bert"])
def test_the_encoders_dropout_is_transformers_unless_set_and_set_it_reaches_every_dropout(family):
    def rates(model):  # the hidden states' and the attention probabilities'
        return {m.p for m in model.modules() if isinstance(m, torch.nn.Dropout)}

    assert rates(_encoder(family)) == {0.1}
    assert rates(_encoder(family, dropout=0.0)) == {0.0}


def _mask(ids, seed):
    return mask_tokens(ids, 0.15, MASK_ID, CANDIDATES, torch.Generator().manual_seed(seed))


def test_masking_follows_berts_rule():
    """15% of positions chosen; of those 80% [MASK], 10% a random piece, 10% unchanged (BERT's
    create_pretraining_data.py); labels only where chosen; the same generator state gives the same batch. Tolerances
    are 5 binomial standard deviations on 1,000,000 positions."""
    ids = torch.randint(FIRST, VOCABULARY, (1000, 1000), generator=torch.Generator().manual_seed(1))
    inputs, labels = _mask(ids, 0)
    chosen = labels != IGNORED
    n, k = ids.numel(), int(chosen.sum())

    def near(count, total, p):
        return abs(count - total * p) <= 5 * math.sqrt(total * p * (1 - p))

    assert near(k, n, 0.15)
    assert torch.equal(labels[chosen], ids[chosen]) and torch.equal(inputs[~chosen], ids[~chosen])
    masked = inputs[chosen] == MASK_ID
    unchanged = inputs[chosen] == ids[chosen]
    replaced = ~masked & ~unchanged
    assert near(int(masked.sum()), k, 0.8)
    # "unchanged" also counts random draws that happened to hit the same piece (1 in 298 of the 10%)
    assert near(int(unchanged.sum()), k, 0.1 + 0.1 / len(CANDIDATES))
    assert near(int(replaced.sum()), k, 0.1 * (1 - 1 / len(CANDIDATES)))
    assert not (inputs[chosen & (inputs != MASK_ID)] < FIRST).any()  # a replacement is never a special token
    again = _mask(ids, 0)
    assert torch.equal(again[0], inputs) and torch.equal(again[1], labels)


def _scales(model, loss_fn):
    """{module name: (output std, output-gradient std)} of every module with a floating-point output, one batch,
    the loss over every position (so the logits' gradient is the loss's own scale, not diluted by unmasked
    positions), eval mode (no dropout)."""
    model.eval()
    found = {}

    def hook(name):
        def record(_module, _inputs, output):
            t = output[0] if isinstance(output, tuple) else getattr(output, "logits", output)
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad:
                found[name] = [float(t.detach().std()), None]
                t.register_hook(lambda g: found[name].__setitem__(1, float(g.std())))
        return record

    for name, module in model.named_modules():
        module.register_forward_hook(hook(name or "<model>"))
    ids = torch.randint(FIRST, VOCABULARY, (32, 64), generator=torch.Generator().manual_seed(0))
    inputs, _ = _mask(ids, 1)
    logits = model(input_ids=inputs).logits
    loss_fn(logits.reshape(-1, VOCABULARY), ids.reshape(-1)).backward()
    return found


# The band, [1/16, 4], and its exceptions, measured (bench/numerics/unit.py says why each is what it is):
# - a position or segment embedding's output is one (1, length, hidden) lookup broadcast over the batch: its gradient
#   sums the batch's 32 rows (std ~ sqrt(32) x the rest);
# - inside each residual branch (tau = 0.02), the branch's output and every gradient in it carry its weight
#   r = 0.14 in both passes: the lowest, ~0.08-0.12 (unit scaling would keep them at 1 with a split at the
#   branch's start, which post-norm transformers code has no place for);
# - BERT's attention outputs reach std 3.2: a one-segment batch adds the same segment vector at every position, a
#   shared part that averaging over positions does not shrink (unit_scaling's attention scale assumes independent
#   values). Without the branch weight they reach 4.7 and the queries' gradients 0.02.
# A plain model: more than half of them below 1/16 (its attention's query and key gradients ~4e-9).
BAND = (1 / 16, 4)
BROADCAST = ("position_embeddings", "token_type_embeddings")


def _outside(found: dict, band: tuple[float, float]) -> dict:
    """The modules of `found` (`_scales`) whose output or gradient std lies outside `band`, broadcast ones apart."""
    low, high = band
    return {name: stds for name, stds in found.items() if not name.endswith(BROADCAST)
            and not all(low <= s <= high for s in stds if s is not None)}


@pytest.mark.parametrize("family", ["distilbert", "bert"])
def test_unit_scaled_encoder_is_unit_scaled_at_initialisation_and_a_plain_one_is_not(family):
    torch.manual_seed(0)
    unit = _scales(unit_scale(_encoder(family)), unit_cross_entropy)
    torch.manual_seed(0)
    plain = _scales(_encoder(family), F.cross_entropy)

    def outside(found):
        return _outside(found, BAND)

    assert len(unit) > 30 and any(name.endswith("scaled_attention") for name in unit)  # attention measured too
    assert outside(unit) == {}, outside(unit)
    assert len(outside(plain)) > len(plain) // 2  # gradients around 1e-4 and below: most of the model


def _distilbert_from_unit_scaling_ops(model, ids):
    """DistilBERT's masked-LM forward written from unit_scaling's functional ops with `model`'s weights: embeddings
    (U.embedding) summed, U.layer_norm; per layer U.linear constrained to the geometric mean inside the stack,
    U.scaled_dot_product_attention, the post-norm residual adds as DistilBERT writes them, each branch weighted by
    sqrt(tau / (1 - tau)); the head's U.linear unconstrained. GELU by the library's scale_elementwise with the
    paper's factors (ours: the library's own gelu now uses an empirical model instead, 1.767 both ways)."""
    d = model.distilbert
    hidden = d.embeddings.word_embeddings.weight.shape[1]
    gelu = scale_elementwise(F.gelu, 1.701, 1.481, constraint=None)  # the paper's GELU factors
    r = math.sqrt(0.02 / 0.98)  # each residual branch's weight, tau = 0.02 (bench/numerics/unit.py)
    positions = torch.arange(ids.shape[1])[None]
    x = d.embeddings.word_embeddings
    h = U.embedding(ids, x.weight, x.padding_idx) + U.embedding(positions, d.embeddings.position_embeddings.weight)
    h = U.layer_norm(h, (hidden,), d.embeddings.LayerNorm.weight, d.embeddings.LayerNorm.bias, 1e-12)
    for layer in d.transformer.layer:
        a = layer.attention
        heads = a.n_heads

        def split(t):
            return t.view(t.shape[0], t.shape[1], heads, -1).transpose(1, 2)

        q, k, v = (split(U.linear(h, lin.weight, lin.bias, constraint="gmean")) for lin in (a.q_lin, a.k_lin, a.v_lin))
        attended = U.scaled_dot_product_attention(q, k, v, mult=q.shape[-1] ** 0.5)
        attended = attended.transpose(1, 2).reshape(h.shape)
        h = U.layer_norm(U.linear(attended, a.out_lin.weight, a.out_lin.bias, constraint="gmean") * r + h, (hidden,),
                         layer.sa_layer_norm.weight, layer.sa_layer_norm.bias, 1e-12)
        f = layer.ffn
        inner = gelu(U.linear(h, f.lin1.weight, f.lin1.bias, constraint="gmean"))
        h = U.layer_norm(U.linear(inner, f.lin2.weight, f.lin2.bias, constraint="gmean") * r + h, (hidden,),
                         layer.output_layer_norm.weight, layer.output_layer_norm.bias, 1e-12)
    h = gelu(U.linear(h, model.vocab_transform.weight, model.vocab_transform.bias, constraint=None))
    h = U.layer_norm(h, (hidden,), model.vocab_layer_norm.weight, model.vocab_layer_norm.bias, 1e-12)
    return U.linear(h, model.vocab_projector.weight, model.vocab_projector.bias, constraint=None)


def _assert_one_step_equals(model, written_forward, loss_fn):
    """One masked-LM step of `model` and of `written_forward(model, inputs)`, its forward written from the library's
    ops with the same weights: the logits, the loss (`loss_fn`) and every parameter's gradient, bit for bit."""
    ids = torch.randint(FIRST, VOCABULARY, (4, 64), generator=torch.Generator().manual_seed(0))
    inputs, labels = _mask(ids, 1)
    chosen = labels != IGNORED

    def step(forward):
        model.zero_grad()
        logits = forward()
        loss = loss_fn(logits[chosen], labels[chosen])
        loss.backward()
        return logits.detach(), loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    ours = step(lambda: model(input_ids=inputs).logits)
    reference = step(lambda: written_forward(model, inputs))
    assert torch.equal(ours[0], reference[0]) and torch.equal(ours[1], reference[1])
    assert ours[2].keys() == reference[2].keys()
    assert {n for n in ours[2] if not torch.equal(ours[2][n], reference[2][n])} == set()


def test_one_converted_step_equals_the_model_written_from_unit_scalings_ops():
    torch.manual_seed(0)
    _assert_one_step_equals(unit_scale(_encoder("distilbert")).eval(), _distilbert_from_unit_scaling_ops,
                            unit_cross_entropy)


def test_the_attention_route_is_what_computes_attention():
    """The converted encoder computes attention in UnitAttention (parameter-free: the state dict is unchanged); a
    plain copy of the same weights routed back to torch's SDPA gives other outputs."""
    torch.manual_seed(0)
    model = _encoder("bert")
    keys = set(model.state_dict())
    unit_scale(model)
    assert set(model.state_dict()) == keys
    calls = []
    for module in model.modules():
        if isinstance(module, UnitAttention):
            module.register_forward_hook(lambda *_: calls.append(1))
    model(input_ids=torch.randint(FIRST, VOCABULARY, (2, 16)))
    assert len(calls) == 2  # one per layer


@pytest.mark.parametrize("override, message", [
    ("model.mask_rate=0", "model.mask_rate=0.0 must be in (0, 1)"),
    ("model.mask_rate=1.5", "model.mask_rate=1.5 must be in (0, 1)"),
    ("model.arch.family=gpt2", "model.arch.family='gpt2' is not valid; valid: bert, distilbert"),
    ("model.arch.dropout=1", "model.arch.dropout=1.0 must be in [0, 1)"),
])
def test_bad_mlm_settings_are_refused_before_training(make_cfg, override, message):
    from bench.running.config import check

    with pytest.raises(ConfigError, match=re.escape(message)):
        check(make_cfg("model=bert_mlm_tiny", override))


@pytest.fixture(scope="module")
def pretrained_unit_encoder(tmp_path_factory):
    """A unit-scaled BERT pretrained a few steps by masked LM on made-up text, exported as a transformers checkpoint
    (the Unit Scaling paper's first step, tiny): (its cell's directory, the export)."""
    from hydra import compose, initialize_config_dir

    from bench.running.config import CONF_DIR
    from bench.running.run import run_cell
    from bench.tools.export_encoder import export

    root = tmp_path_factory.mktemp("pretrain")
    text = root / "text.txt"
    words = "to be or not to be that is the question whether tis nobler in the mind".split()
    text.write_text("\n".join(" ".join(words[(i * 7 + j) % len(words)] for j in range(12)) for i in range(400)))
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=[f"results_dir={root}", "model=bert_mlm_tiny", "scaling=unit",
                                           "model.data.source=local", f"model.data.path={text}",
                                           "model.data.sha256=null", "model.arch.block_size=128", "train.max_steps=3",
                                           "train.keep_checkpoint=true", "device=cpu"])
    run_cell(cfg)
    cell = root / cfg.cell
    return cell, export(cell, root / "encoder")


def test_a_unit_scaled_pretrained_encoder_fine_tunes_unit_scaled_on_squad(make_cfg, tmp_path, pretrained_unit_encoder):
    """The paper's second step through the QA task: the exported checkpoint loads (its MLM head discarded, the QA
    head initialised), is rebuilt unit-scaled around its pretrained weights (not converted as a standard checkpoint
    would be), and trains; the first encoder weight is the pretrained one exactly."""
    import json

    from bench.running.run import run_cell

    cell, encoder = pretrained_unit_encoder
    assert json.loads((encoder / "config.json").read_text())["precision_bench_parametrisation"] == "unit scaling"
    cfg = make_cfg("model=bert_tiny", "model.pretrained=true", f"model.hub_name={encoder}", "scaling=unit",
                   "train.max_steps=2", "device=cpu")
    run_cell(cfg)
    record = json.loads((tmp_path / cfg.cell / "result.json").read_text())
    assert record["status"] == "ok", record.get("traceback")
    conversion = record["numerics"]["unit_conversion"]
    assert conversion["why"].startswith("pretrained unit-scaled") and conversion["kept_weights"] > 30
    assert record["model_source"]["initialised_head"] == ["qa_outputs.bias", "qa_outputs.weight"]

    from bench.numerics.scaling_methods import build, transform_task
    from bench.tasks import build_task

    task = build_task(cfg.model, torch.device("cpu"), 0)
    transform_task(build(cfg.scaling), task, True, "adamw")
    pretrained = torch.load(cell / "checkpoint.pt", weights_only=False)["model"]
    name = "bert.encoder.layer.0.attention.self.query.weight"
    assert torch.equal(task.model.state_dict()[name], pretrained[name])
    # the relative rule as in pretraining (unit init against transformers' N(0, 0.02)), not against the loaded weights
    multiplier = task.lr_multipliers[dict(task.model.named_parameters())[name]]
    assert conversion["lr_rule"] == "relative" and multiplier == pytest.approx(50, rel=0.1)


def test_a_unit_scaled_checkpoint_is_refused_by_a_standard_scaling(make_cfg, pretrained_unit_encoder):
    """Refused with the config check, before anything is built (bench.run exits 2)."""
    from bench.running.config import check

    _, encoder = pretrained_unit_encoder
    with pytest.raises(ConfigError, match=r"pretrained in unit scaling, .* fine-tune it with scaling=unit"):
        check(make_cfg("model=bert_tiny", "model.pretrained=true", f"model.hub_name={encoder}", "scaling=dynamic",
                           "device=cpu"))


def test_the_relative_rule_gives_a_zero_initialised_bias_the_inverse_of_its_output_scale():
    """A unit-scaled matmul multiplies its bias by alpha: under the relative rule an Adam step moves the output by as
    much as the regular model's step moves its bias (1/alpha: sqrt(fan_in) for an unconstrained Linear, (fan_in *
    fan_out)^1/4 inside the stack); a bias with a value of its own keeps the RMS rule."""
    from bench.numerics.unit import relative_lr_multipliers

    torch.manual_seed(0)
    model = _encoder("bert")
    before = {name: float(p.detach().double().pow(2).mean().sqrt()) for name, p in model.named_parameters()}
    unit_scale(model)
    by_parameter = relative_lr_multipliers(before, model)
    multipliers = {name: by_parameter[p] for name, p in model.named_parameters()}
    assert multipliers["cls.predictions.transform.dense.bias"] == pytest.approx(64 ** 0.5)  # after the stack
    assert multipliers["bert.encoder.layer.0.intermediate.dense.bias"] == pytest.approx((64 * 128) ** 0.25)
    assert multipliers["bert.encoder.layer.0.attention.self.query.weight"] == pytest.approx(1 / 0.02, rel=0.05)


# u-μP on transformers encoders (bench/numerics/umup.py). The band is wider than unit scaling's, [2^-7, 2^3], for
# two measured departures, both of the model rather than of the conversion:
# - u-μP's logits are q k^T / d_head (μP's), so attention is near uniform at initialisation and the logits' gradients
#   small: the library's own attention gives query and key gradients of ~0.15 on independent inputs, and BERT's
#   inputs share part of their value across positions (the segment embedding, then each layer's attention output),
#   which uniform attention does not average away: query and key gradients 0.016-0.042 here;
# - for the same reason the attention outputs (the library scales them by its model of uniform attention over
#   independent values) reach std 4.9 (BERT) and 1.8 (DistilBERT).
# Without the post-norm branch weights the query gradients fall to 0.0013 and the attention outputs reach 8.0.
# A plain model: 46 of 48 (BERT) and 35 of 36 (DistilBERT) outside this band.
UMUP_BAND = (2**-7, 2**3)


@pytest.mark.parametrize("family", ["distilbert", "bert"])
def test_a_umup_encoder_is_unit_scaled_at_initialisation_and_a_plain_one_is_not(family):
    import functools

    from bench.numerics.umup import umup_scale

    torch.manual_seed(0)
    umup = _scales(umup_scale(_encoder(family)), functools.partial(U.cross_entropy, mult=1.0))
    torch.manual_seed(0)
    plain = _scales(_encoder(family), F.cross_entropy)

    def outside(found):
        return _outside(found, UMUP_BAND)

    assert len(umup) > 30 and any(name.endswith("scaled_attention") for name in umup)
    assert outside(umup) == {}, outside(umup)
    assert len(outside(plain)) > 0.9 * len(plain)


def test_a_umup_encoder_has_one_readout_its_own_head_and_every_parameter_typed_for_the_optimiser():
    """The readout is the MLM decoder (the last Linear), not the head's hidden dense that follows the stack too; the
    decoder is untied from the word embedding (u-μP types them apart) but the head's `bias` is still the decoder's;
    every parameter carries the library's u-μP type, the encoder layers' their depth; norms have no parameters."""
    from unit_scaling.optim import lr_scale_func_adam

    from bench.numerics.umup import UmupLinear, UmupReadout, umup_scale

    torch.manual_seed(0)
    model = umup_scale(_encoder("bert"))
    readouts = [name for name, m in model.named_modules() if isinstance(m, UmupReadout)]
    assert readouts == ["cls.predictions.decoder"]
    assert isinstance(model.cls.predictions.transform.dense, UmupLinear)
    head = model.cls.predictions
    assert head.decoder.weight is not model.bert.embeddings.word_embeddings.weight and head.bias is head.decoder.bias
    params = dict(model.named_parameters())
    assert all(hasattr(p, "mup_type") for p in params.values())
    assert not any("LayerNorm" in name for name in params)
    assert params["bert.encoder.layer.1.intermediate.dense.weight"].mup_scaling_depth == 2
    # Adam's lr scales (unit_scaling.optim): a hidden weight in the stack fan_in^-1/2 * depth^-1/2, the readout 1,
    # the embedding 1 (u-μP's Adam rule does not scale embeddings by width here: the library's, read off)
    assert lr_scale_func_adam(params["bert.encoder.layer.1.intermediate.dense.weight"]) == pytest.approx(
        64 ** -0.5 * 2 ** -0.5)
    assert lr_scale_func_adam(params["cls.predictions.decoder.weight"]) == 1.0
    # a training step leaves them untied (transformers' tie_weights is not called again behind our back)
    model(input_ids=torch.randint(FIRST, VOCABULARY, (2, 16))).logits.sum().backward()
    assert head.decoder.weight is not model.bert.embeddings.word_embeddings.weight


def _distilbert_from_umup_ops(model, ids):
    """DistilBERT's masked-LM forward written from unit_scaling's functional u-μP ops with `model`'s weights: the
    embeddings (U.embedding) summed and U.layer_norm without affine parameters; per layer U.linear with uu.Linear's
    constraint, U.scaled_dot_product_attention at u-μP's mult = 1 (logits / d_head), U.gelu, the post-norm residual
    adds as DistilBERT writes them with each branch weighted by sqrt(tau / (1 - tau)); the head's hidden U.linear,
    and U.linear_readout for the decoder. The library's dropout scales by sqrt(1 - p) in eval mode too (its expected
    value in training), so U.dropout stands where DistilBERT has a dropout module."""
    d = model.distilbert
    hidden = d.embeddings.word_embeddings.weight.shape[1]
    r = math.sqrt(0.02 / 0.98)
    positions = torch.arange(ids.shape[1])[None]
    x = d.embeddings.word_embeddings
    h = U.embedding(ids, x.weight, x.padding_idx) + U.embedding(positions, d.embeddings.position_embeddings.weight)
    h = U.dropout(U.layer_norm(h, (hidden,), None, None, 1e-12), 0.1, training=False)
    for layer in d.transformer.layer:
        a = layer.attention

        def split(t):
            return t.view(t.shape[0], t.shape[1], a.n_heads, -1).transpose(1, 2)

        q, k, v = (split(U.linear(h, lin.weight, lin.bias, constraint="to_output_scale"))
                   for lin in (a.q_lin, a.k_lin, a.v_lin))
        attended = U.scaled_dot_product_attention(q, k, v, mult=1.0).transpose(1, 2).reshape(h.shape)
        out = U.linear(attended, a.out_lin.weight, a.out_lin.bias, constraint="to_output_scale")
        h = U.layer_norm(out * r + h, (hidden,), None, None, 1e-12)
        f = layer.ffn
        inner = U.gelu(U.linear(h, f.lin1.weight, f.lin1.bias, constraint="to_output_scale"), mult=1.0)
        out = U.linear(inner, f.lin2.weight, f.lin2.bias, constraint="to_output_scale")
        h = U.layer_norm(U.dropout(out * r, 0.1, training=False) + h, (hidden,), None, None, 1e-12)
    t = model.vocab_transform
    h = U.gelu(U.linear(h, t.weight, t.bias, constraint="to_output_scale"), mult=1.0)
    h = U.layer_norm(h, (hidden,), None, None, 1e-12)
    return U.linear_readout(h, model.vocab_projector.weight, model.vocab_projector.bias, constraint=None)


def test_one_umup_step_equals_the_model_written_from_unit_scalings_umup_ops():
    """With the library's cross-entropy."""
    from bench.numerics.umup import umup_scale

    torch.manual_seed(0)
    _assert_one_step_equals(umup_scale(_encoder("distilbert")).eval(), _distilbert_from_umup_ops,
                            lambda logits, labels: U.cross_entropy(logits, labels, mult=1.0))


def test_umups_pre_norm_residual_rule_is_refused_on_a_post_norm_encoder():
    from bench.numerics.umup import UmupHyper, umup_scale

    with pytest.raises(ConfigError, match=r"scaling.residual_mult=2 and scaling.residual_attn_ratio=1: u-μP's "
                                          r"residual rule is for pre-norm stacks, and BertForMaskedLM is post-norm"):
        umup_scale(_encoder("bert"), UmupHyper(residual_mult=2.0))


def test_a_umup_masked_lm_cell_trains_from_scratch_and_records_its_conversion(make_cfg, text_file):
    """bert_mlm_tiny under scaling=umup (u-μP's optimiser defaults from conf/scaling/umup.yaml): the loss falls from
    its start, and the record names the readout, the routed attention and the weighted branches."""
    import json

    from bench.running.run import run_cell

    cfg = make_cfg("model=bert_mlm_tiny", "scaling=umup", "model.data.source=local", f"model.data.path={text_file}",
                   "model.data.sha256=null", "model.arch.block_size=32", "model.iterations=40", "train.log_every=20",
                   "device=cpu")
    run_cell(cfg)
    record = json.loads((Path(cfg.results_dir) / cfg.cell / "result.json").read_text())
    assert record["status"] == "ok", record.get("traceback")
    points = record["metrics"]["curve"]["points"]
    assert points[-1][1] < points[0][1] - 1.0, points  # from ~log(303) = 5.7
    conversion = record["numerics"]["unit_conversion"]
    assert conversion["parametrisation"] == "u-μP" and conversion["readout"] == "cls.predictions.decoder"
    assert len(conversion["scaled_attention"]) == 2 and len(conversion["post_norm_branches"]) == 4


def test_umup_refuses_a_pretrained_checkpoint_naming_what_is_valid():
    from bench.numerics.scaling_methods import scaling_class

    with pytest.raises(ConfigError, match=r"scaling=umup trains from scratch .* valid: model.pretrained=false, or "
                                          r"scaling=unit"):
        scaling_class("umup")(name="umup").transform(None, True, "adamw")
