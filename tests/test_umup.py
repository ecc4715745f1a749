"""scaling=umup against the unit-scaling library it is built from: the Linear it rewrites (bit for bit against
unit_scaling.Linear / LinearReadout), the whole converted char-LM (one training step equal to a model written
directly from unit_scaling's modules, trained by unit_scaling.optim.AdamW, bit for bit), each op's scales, and the
run's wiring (config errors, records, FP8 plain cast)."""

import math

import pytest
import torch
import unit_scaling as uu
import unit_scaling.functional as U
from omegaconf import OmegaConf
from torch import nn

from bench.errors import ConfigError
from bench.numerics.umup import UmupHyper, UmupLinear, UmupReadout, umup_parameter_groups, umup_scale
from bench.running.run import run_cell
from bench.tasks.charlm import CharGPT
from bench.tasks.lenet import LeNet5
from bench.tasks.optimizer import build_optimizer


@pytest.mark.parametrize("ours, library", [(UmupLinear, uu.Linear), (UmupReadout, uu.LinearReadout)])
def test_the_linear_is_the_librarys_bit_for_bit_forward_and_backward(ours, library):
    torch.manual_seed(0)
    mine = ours(48, 80, bias=False)
    theirs = library(48, 80)
    theirs.load_state_dict(mine.state_dict())
    assert theirs.weight.mup_type == mine.weight.mup_type
    x = torch.randn(6, 10, 48)
    xs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
    ys = [mine(xs[0]), theirs(xs[1])]
    assert torch.equal(ys[0], ys[1])
    grad = torch.randn_like(ys[0])
    for y in ys:
        y.backward(grad)
    assert torch.equal(xs[0].grad, xs[1].grad)
    assert torch.equal(mine.weight.grad, theirs.weight.grad)


class LibraryBlock(nn.Module):
    """charlm's pre-norm block written from unit_scaling's modules and functions, as its u-μP demo writes one."""

    def __init__(self, width: int, heads: int, index: int, layers: int):
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = uu.LayerNorm(width), uu.LayerNorm(width)
        self.qkv, self.out = uu.Linear(width, 3 * width), uu.Linear(width, width)
        self.up, self.act, self.down = uu.Linear(width, 4 * width), uu.GELU(), uu.Linear(4 * width, width)
        rule = uu.transformer_residual_scaling_rule()
        self.attn_tau, self.mlp_tau = rule(2 * index, 2 * layers), rule(2 * index + 1, 2 * layers)

    def forward(self, x):
        batch, length, width = x.shape
        residual, skip = U.residual_split(x, self.attn_tau)
        q, k, v = (t.view(batch, length, self.heads, width // self.heads).transpose(1, 2)
                   for t in self.qkv(self.ln_1(residual)).split(width, dim=2))
        y = U.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = U.residual_add(self.out(y.transpose(1, 2).contiguous().view(batch, length, width)), skip, self.attn_tau)
        residual, skip = U.residual_split(x, self.mlp_tau)
        return U.residual_add(self.down(self.act(self.up(self.ln_2(residual)))), skip, self.mlp_tau)


class LibraryCharLM(nn.Module):
    def __init__(self, vocab: int, block: int, layers: int, heads: int, width: int):
        super().__init__()
        self.wte, self.wpe = uu.Embedding(vocab, width), uu.Embedding(block, width)
        self.h = uu.DepthModuleList([LibraryBlock(width, heads, i, layers) for i in range(layers)])
        self.ln_f, self.head = uu.LayerNorm(width), uu.LinearReadout(width, vocab)

    def forward(self, idx):
        x = U.add(self.wte(idx), self.wpe(torch.arange(idx.shape[1])), constraint=None)
        for block in self.h:
            x = block(x)
        return self.head(self.ln_f(x))


OPTIMIZER = OmegaConf.create({"name": "adamw", "lr": 0.5, "beta2": 0.99, "weight_decay": 0.0,
                              "decay_matrices_only": True})


def test_a_converted_charlm_trains_one_step_exactly_as_the_library_built_model_and_optimiser():
    """Same weights (ours copied over, in order), same batch: logits, every gradient and every weight after one
    AdamW step (unit_scaling.optim.AdamW, torch's fused kernel in both) are equal bit for bit."""
    vocab, block, layers, heads, width = 23, 16, 3, 2, 32
    torch.manual_seed(0)
    ours = umup_scale(CharGPT(vocab, block, layers, heads, width))
    reference = LibraryCharLM(vocab, block, layers, heads, width)
    ours_params, reference_params = list(ours.parameters()), list(reference.parameters())
    assert [p.shape for p in ours_params] == [p.shape for p in reference_params]
    assert [(p.mup_type, p.mup_scaling_depth) for p in ours_params] == \
        [(p.mup_type, p.mup_scaling_depth) for p in reference_params]
    with torch.no_grad():
        for mine, theirs in zip(ours_params, reference_params):
            theirs.copy_(mine)
    idx, targets = torch.randint(vocab, (4, block)), torch.randint(vocab, (4, block))
    optimizers = [build_optimizer(OPTIMIZER, ours.parameters(), parameter_groups=umup_parameter_groups),
                  uu.optim.AdamW(reference.parameters(), lr=0.5, betas=(0.9, 0.99), weight_decay=0.0, fused=True)]
    logits = []
    for model, _optimizer in zip((ours, reference), optimizers):
        out = model(idx)
        logits.append(out)
        U.cross_entropy(out.view(-1, vocab), targets.view(-1)).backward()
    assert torch.equal(logits[0], logits[1])
    for mine, theirs in zip(ours_params, reference_params):
        assert torch.equal(mine.grad, theirs.grad)
    for optimizer in optimizers:
        optimizer.step()
    for mine, theirs in zip(ours_params, reference_params):
        assert torch.equal(mine, theirs)


def test_the_learning_rates_follow_u_mup_rules_by_type_width_and_depth():
    """Adam under u-μP: hidden weights lr / sqrt(fan_in) / sqrt(depth), embeddings lr / sqrt(width), the readout
    lr; written out from the paper's Table 2, not read from the library."""
    layers, width = 4, 64
    model = umup_scale(CharGPT(30, 16, layers, 2, width))
    optimizer = build_optimizer(OPTIMIZER, model.parameters(), parameter_groups=umup_parameter_groups)
    lr_of = {id(p): group["lr"] for group in optimizer.param_groups for p in group["params"]}
    lr = OPTIMIZER.lr
    assert lr_of[id(model.wte.weight)] == pytest.approx(lr / math.sqrt(width))
    assert lr_of[id(model.lm_head.weight)] == pytest.approx(lr)
    assert lr_of[id(model.h[0].attn.c_attn.weight)] == pytest.approx(lr / math.sqrt(width) / math.sqrt(layers))
    assert lr_of[id(model.h[2].mlp.c_proj.weight)] == pytest.approx(lr / math.sqrt(4 * width) / math.sqrt(layers))
    assert model.wte.weight is not model.lm_head.weight  # untied


def test_scales_at_initialisation_do_not_depend_on_width():
    """At initialisation a u-μP model's residual stream and its weight gradients have the same scale, about 1, at
    widths 64 and 256 (the library's rules are approximate: within a factor of 2 of 1), and its logits shrink as
    1/width^1/2 (the readout's 1/fan_in on unit inputs): μP's output, which SP's N(0, 0.02) init does not keep."""
    torch.manual_seed(0)
    scales = {}
    for width in (64, 256):
        model = umup_scale(CharGPT(65, 64, 2, 2, width))
        stream = {}
        model.h[1].register_forward_hook(lambda m, i, o: stream.update(out=o.detach()))  # (returns None)
        idx = torch.randint(65, (16, 64))
        logits = model(idx)
        U.cross_entropy(logits.view(-1, 65), idx.view(-1)).backward()
        scales[width] = {"stream": float(stream["out"].std()),
                         "logits x sqrt(width)": float(logits.detach().std()) * width**0.5,
                         **{name: float(model.get_parameter(name).grad.std())
                            for name in ("h.0.attn.c_attn.weight", "h.1.mlp.c_fc.weight", "h.1.mlp.c_proj.weight")}}
    for key, narrow in scales[64].items():
        assert 0.5 < narrow < 2 and 0.5 < scales[256][key] < 2, (key, scales)
        assert scales[256][key] == pytest.approx(narrow, rel=0.25), (key, scales)


def test_the_hyper_parameters_reach_their_ops():
    hyper = UmupHyper(residual_mult=2.0, residual_attn_ratio=0.5, attn_softmax_mult=3.0, ffn_act_mult=4.0)
    model = umup_scale(CharGPT(30, 16, 2, 2, 32), hyper)
    rule = uu.transformer_residual_scaling_rule(2.0, 0.5)
    assert [model.h[i].attn_residual.ratio for i in range(2)] == [rule(0, 4), rule(2, 4)]
    assert [model.h[i].mlp_residual.ratio for i in range(2)] == [rule(1, 4), rule(3, 4)]
    assert model.h[0].attn.attend.mult == 3.0 and model.h[0].mlp.gelu.mult == 4.0


def test_a_model_with_a_layer_u_mup_has_no_rule_for_is_refused_naming_it():
    with pytest.raises(ConfigError, match="scaling=umup has no rule for Conv2d"):
        umup_scale(LeNet5())


def _charlm(make_cfg, text_file, *overrides):
    return make_cfg("model=charlm", "model.data.source=local", f"model.data.path={text_file}", "model.data.sha256=null",
                    "model.iterations=30", "model.arch.layers=2", "model.arch.embedding=32", "model.arch.block_size=16",
                    "train.log_every=10", "scaling=umup", *overrides)


@pytest.mark.parametrize("overrides", [["format=fp32"], ["format=fp8"], ["format=bf16"]])
def test_a_umup_charlm_cell_trains_and_records_its_parametrisation(make_cfg, text_file, overrides):
    """FP8 is the plain cast (no per-tensor scale) of every GEMM input, emulated; its defaults put u-μP's optimiser
    in place of nanoGPT's."""
    cfg = _charlm(make_cfg, text_file, *overrides)
    assert (cfg.model.optimizer.lr, cfg.model.optimizer.weight_decay, cfg.model.optimizer.grad_clip) == (2.0, 0.0, None)
    record = run_cell(cfg)
    assert record["status"] == "ok", record["reason"]
    assert record["metrics"]["val_loss"] < math.log(record["metrics"]["vocabulary"])
    conversion = record["numerics"]["unit_conversion"]
    assert conversion["parametrisation"] == "u-μP" and conversion["hyper"]["attn_softmax_mult"] == 1.0
    if overrides == ["format=fp8"]:
        assert record["env"]["precision"]["backend"] == "emulated"
        assert record["numerics"]["quantisation"]["activations"]["values_sampled"] > 0  # GEMM inputs rounded


def test_umup_on_a_model_it_does_not_cover_exits_before_training_with_nothing_recorded(make_cfg, tmp_path):
    cfg = make_cfg("model=lenet", "scaling=umup", "train.max_steps=2")
    with pytest.raises(ConfigError, match="no rule for Conv2d"):
        run_cell(cfg)
    assert not list(tmp_path.rglob("result.json"))


def _charlm_record(width, scaling, lr, loss, experiment, setting="32-true", seed=0, fmt="fp32", options=None):
    from test_aggregate import record

    from bench.running.config import CharDataConfig

    rec = record(scaling=scaling, seed=seed, metrics={"val_loss": loss}, setting=setting, fmt=fmt,
                 mode="true" if setting == "32-true" else "mixed")
    rec["config"]["format"] |= options or {}
    rec["config"]["model"] = {"name": "charlm", "arch": {"layers": 4, "embedding": width, "norm": "pre"},
                              "optimizer": {"lr": lr}, "data": {"source": "local", "sha256": CharDataConfig.sha256}}
    rec["config"]["experiment_name"] = experiment
    return rec


def test_lr_transfer_finds_each_widths_best_learning_rate_and_the_claims_beside_the_paper(tmp_path):
    """Two widths x three learning rates per parametrisation, losses chosen so that SP's best moves down one factor
    of 2 and u-μP's stays: the table's best, neighbours and shift, vs_published's claim rows, and one figure in place
    of the plots per learning rate."""
    from bench.aggregate import main
    from bench.running.record import write_json_atomic

    losses = {("none", 64): {2e-3: 2.10, 4e-3: 2.00, 8e-3: 2.05}, ("none", 256): {2e-3: 1.90, 4e-3: 1.95, 8e-3: 2.20},
              ("umup", 64): {0.5: 2.08, 1.0: 2.01, 2.0: 2.04}, ("umup", 256): {0.5: 1.93, 1.0: 1.85, 2.0: 1.88}}
    root = tmp_path / "runs"
    for (scaling, width), by_lr in losses.items():
        for lr, loss in by_lr.items():
            write_json_atomic(root / f"{scaling}-{width}-{lr}" / "result.json",
                              _charlm_record(width, scaling, lr, loss, "umup_lr_transfer"))
    out = tmp_path / "tables"
    assert main([str(root), "--out", str(out)]) == 0
    folder = out / "umup_lr_transfer"
    table = (folder / "lr_transfer.md").read_text()
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in table.splitlines() if "charlm (" in line]
    assert [(r[0], r[1].split(" ")[1], r[3], r[4], r[5], r[6], r[7]) for r in rows] == [
        ("standard (SP)", "(4L×64", "0.004", "2.000 (n=1)", "2.100 (n=1) (lr 0.002)", "2.050 (n=1) (lr 0.008)", "+0"),
        ("standard (SP)", "(4L×256", "0.002", "1.900 (n=1)", "–", "1.950 (n=1) (lr 0.004)", "-1"),
        ("u-μP", "(4L×64", "1", "2.010 (n=1)", "2.080 (n=1) (lr 0.5)", "2.040 (n=1) (lr 2)", "+0"),
        ("u-μP", "(4L×256", "1", "1.850 (n=1)", "1.930 (n=1) (lr 0.5)", "1.880 (n=1) (lr 2)", "+0")]
    claims = {cells[4]: cells[6:8] for cells in ([c.strip() for c in line.split("|")[1:-1]] for line in
              (folder / "vs_published.md").read_text().splitlines() if "best_lr_shift" in line)}
    assert claims["umup"][0] == "0 (stays put as width grows)"
    assert claims["umup"][1].startswith("+0 (lr 1 at charlm (4L×64")
    assert claims["none"][0] == "≠ 0 (SP's optimum moves)" and claims["none"][1].startswith("-1 (lr 0.004 at")
    # and what the narrowest's best learning rate costs the widest (a shift of one step may be within the noise)
    assert claims["none"][1].endswith("; the widest at the narrowest's best lr: +0.0500 val_loss)")
    assert claims["umup"][1].endswith("; the widest at the narrowest's best lr: +0.0000 val_loss)")
    assert sorted(p.name for p in folder.glob("*.png")) == ["charlm_lr_transfer.png"]


def test_labelled_rows_pair_each_fp8_cell_with_its_own_parametrisations_fp32(tmp_path):
    """umup_fp8's table: u-μP FP8 against u-μP FP32, SP FP8 (plain cast and per-tensor, which has no FP32 cell of its
    own) against SP FP32, each at its own learning rate, by seed (differences 0.01, 0.02, 0.03; 0.10, 0.12, 0.14;
    0.00, 0.01, 0.02)."""
    from bench.aggregate import main
    from bench.running.record import write_json_atomic

    root = tmp_path / "runs"
    bf16 = {"elsewhere": "bf16"}
    for seed in range(3):
        for scaling, lr, fp32, fp8 in (("umup", 1.0, 1.80, 1.81 + 0.01 * seed),
                                       ("none", 4e-3, 1.90, 2.00 + 0.02 * seed)):
            write_json_atomic(root / f"{scaling}-fp32-{seed}" / "result.json",
                              _charlm_record(128, scaling, lr, fp32, "umup_fp8", seed=seed))
            write_json_atomic(root / f"{scaling}-fp8-{seed}" / "result.json",
                              _charlm_record(128, scaling, lr, fp8, "umup_fp8", "fp8-mixed", seed, "fp8", bf16))
        write_json_atomic(root / f"per_tensor-fp8-{seed}" / "result.json",  # paired with SP's FP32 (none)
                          _charlm_record(128, "per_tensor", 4e-3, 1.90 + 0.01 * seed, "umup_fp8", "fp8-mixed", seed,
                                         "fp8", bf16))
    assert main([str(root), "--out", str(tmp_path / "tables"), "--no-plots"]) == 0
    table = (tmp_path / "tables" / "umup_fp8" / "labelled_rows.md").read_text()
    rows = {line.split("|")[2].strip(): [c.strip() for c in line.split("|")[1:-1]] for line in table.splitlines()
            if "charlm (" in line}
    assert rows["u-μP, FP8 (plain cast)"][5].startswith("+0.020 [")  # mean of 0.01, 0.02, 0.03
    assert rows["SP, FP8 (plain cast)"][5].startswith("+0.120 [") and rows["SP, FP8 (plain cast)"][5].endswith("*")
    assert rows["u-μP, FP32"][5] == "baseline"
    assert rows["SP, FP8 per-tensor"][5].startswith("+0.010 [")  # 0.00, 0.01, 0.02 against SP's FP32


def test_a_umup_cell_interrupted_after_its_checkpoint_resumes_bit_for_bit(make_cfg, text_file,
                                                                          monkeypatch):
    """u-μP's one-group-per-parameter optimiser and its tagged parameters survive a checkpoint: interrupted after step
    20 and resumed, the cell ends with the weights and optimiser state of the same cell run straight through."""
    from tests.conftest import straight_and_resumed

    keep = ["train.checkpoint_every=20", "train.keep_checkpoint=true"]
    reference, resumed = straight_and_resumed(_charlm(make_cfg, text_file, *keep),
                                              _charlm(make_cfg, text_file, *keep, "experiment_name=interrupted"),
                                              monkeypatch, 20)
    assert reference["model"].keys() == resumed["model"].keys()
    assert all(torch.equal(reference["model"][k], resumed["model"][k]) for k in reference["model"])
    assert [g["lr"] for g in reference["optimizer"]["param_groups"]] == \
        [g["lr"] for g in resumed["optimizer"]["param_groups"]]


@pytest.mark.parametrize("value", ["0", "-1.0", "null"])
def test_a_multiplier_that_is_not_a_positive_number_is_refused_before_training(make_cfg, value):
    from bench.running.config import check

    with pytest.raises(ConfigError, match=r"scaling.attn_softmax_mult=.* must be a number > 0 under scaling=umup"):
        check(make_cfg("model=charlm", "scaling=umup", f"scaling.attn_softmax_mult={value}"))
