"""The character-level GPT and its data, against nanoGPT's own definitions (prepare.py, model.py, get_lr), on text
the test generates (Tiny Shakespeare itself is never part of the project)."""

import hashlib
import math

import pytest
import torch
from omegaconf import OmegaConf

from bench.numerics.scaling import LossScaler
from bench.running.config import ConfigError, check
from bench.running.record import read_record
from bench.running.run import run_cell
from bench.running.train import build_schedule
from bench.tasks.charlm import CharGPT, encode, load_text, validation_windows
from bench.tasks.optimizer import build_optimizer
from tests.conftest import char_data as _data


def test_load_text_reads_a_path_and_checks_its_checksum(text_file):
    digest = hashlib.sha256(text_file.read_bytes()).hexdigest()
    assert load_text(_data(path=str(text_file), sha256=digest)) == text_file.read_text()
    with pytest.raises(ConfigError, match="sha256 .* is not the expected 86c4"):  # set-up problems: exit 2, no record
        load_text(_data(path=str(text_file), sha256="86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"))
    with pytest.raises(ConfigError, match="model.data.path"):
        load_text(_data(path=str(text_file) + ".missing"))


def test_load_text_downloads_once_into_the_cache(text_file, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    digest = hashlib.sha256(text_file.read_bytes()).hexdigest()
    data = _data(url=text_file.as_uri(), sha256=digest)
    assert load_text(data) == text_file.read_text()
    cached = tmp_path / "precision-bench" / text_file.name
    assert cached.read_bytes() == text_file.read_bytes()
    with pytest.raises(ConfigError) as refused:  # both keys, as `make doctor` says (a newcomer set the path alone)
        load_text(_data(url=(tmp_path / "nowhere.txt").as_uri()))
    assert "model.data.source=local model.data.path=" in str(refused.value)
    monkeypatch.setattr("urllib.request.urlopen", lambda *a, **k: pytest.fail("downloaded twice"))
    assert load_text(data) == text_file.read_text()


def test_encoding_and_split_follow_nanogpt_prepare(text_file):
    text = text_file.read_text()
    train, val, vocabulary = encode(text, 0.9)
    # nanoGPT's data/shakespeare_char/prepare.py, written out independently
    chars = sorted(list(set(text)))
    stoi = {ch: i for i, ch in enumerate(chars)}
    n = len(text)
    assert vocabulary == chars
    assert train.tolist() == [stoi[c] for c in text[:int(n * 0.9)]]
    assert val.tolist() == [stoi[c] for c in text[int(n * 0.9):]]
    x, y = validation_windows(val, 64)
    assert x.shape == y.shape == ((len(val) - 1) // 64, 64)
    assert torch.equal(x.reshape(-1)[1:], y.reshape(-1)[:-1]) and y.reshape(-1)[-1] == val[x.numel()]


def test_the_model_has_nanogpts_size_ties_its_head_and_is_causal():
    torch.manual_seed(0)
    model = CharGPT(vocab=65, block_size=64, layers=4, heads=4, embedding=128)
    # nanoGPT prints "number of parameters: 0.80M" for this config (position embeddings excluded, head tied):
    # per block c_attn 128x384, attn c_proj 128x128, c_fc 128x512, mlp c_proj 512x128, two LayerNorm weights
    n_params = sum(p.numel() for p in model.parameters()) - model.wpe.weight.numel()
    per_block = 128 * 384 + 128 * 128 + 128 * 512 + 512 * 128 + 2 * 128
    assert n_params == 4 * per_block + 65 * 128 + 128 == 795_904 and f"{n_params / 1e6:.2f}M" == "0.80M"
    assert model.lm_head.weight is model.wte.weight
    assert float(model.h[0].attn.c_proj.weight.std()) == pytest.approx(0.02 / math.sqrt(8), rel=0.05)
    idx = torch.randint(0, 65, (2, 64))
    changed = idx.clone()
    changed[:, 40:] = (changed[:, 40:] + 1) % 65
    assert torch.equal(model(idx)[:, :40], model(changed)[:, :40]) and not torch.equal(model(idx), model(changed))
    post = CharGPT(vocab=65, block_size=64, layers=2, heads=4, embedding=128, norm="post")
    assert isinstance(post.ln_f, torch.nn.Identity) and post(idx).shape == (2, 64, 65)


def test_cosine_schedule_is_nanogpts_get_lr():
    cfg = OmegaConf.create({"schedule": "cosine", "lr": 1e-3, "warmup_steps": 100, "min_lr": 1e-4})
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=cfg.lr)
    schedule = build_schedule(cfg, optimizer, total_steps=2000)

    def get_lr(it, learning_rate=1e-3, warmup_iters=100, lr_decay_iters=2000, min_lr=1e-4):  # nanoGPT train.py
        if it < warmup_iters:
            return learning_rate * (it + 1) / (warmup_iters + 1)
        if it > lr_decay_iters:
            return min_lr
        decay_ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
        return min_lr + 0.5 * (1.0 + math.cos(math.pi * decay_ratio)) * (learning_rate - min_lr)

    for it in range(2000):
        assert optimizer.param_groups[0]["lr"] == pytest.approx(get_lr(it), rel=1e-12), it
        optimizer.step()
        schedule.step()


def test_weight_decay_on_matrices_only_and_clipping_after_unscaling():
    model = CharGPT(vocab=20, block_size=8, layers=1, heads=2, embedding=8)
    cfg = OmegaConf.create({"name": "adamw", "lr": 1e-3, "beta2": 0.99, "weight_decay": 0.1,
                            "decay_matrices_only": True})
    decayed, plain = build_optimizer(cfg, model.parameters()).param_groups
    assert decayed["weight_decay"] == 0.1 and all(p.dim() == 2 for p in decayed["params"])
    assert plain["weight_decay"] == 0.0 and {p.dim() for p in plain["params"]} == {1}  # the LayerNorm weights
    assert decayed["betas"] == (0.9, 0.99)
    p = torch.nn.Parameter(torch.zeros(4))
    p.grad = torch.full((4,), 5.0 * 1024)  # norm 10 after unscaling by 1024
    LossScaler("static", init_scale=1024.0, max_grad_norm=1.0).step(torch.optim.SGD([p], lr=1.0), [p])
    assert float(p.detach().norm()) == pytest.approx(1.0, rel=1e-5)


def test_a_bad_norm_or_a_path_without_source_local_is_refused_before_training(make_cfg, text_file):
    with pytest.raises(ConfigError, match="model.arch.norm='mid' is not valid; valid: pre, post"):
        check(make_cfg("model=charlm", "model.arch.norm=mid"))
    with pytest.raises(ConfigError, match="model.data.source=local reads model.data.path"):
        check(make_cfg("model=charlm", f"model.data.path={text_file}"))


@pytest.mark.parametrize("overrides", [["format=fp32"], ["format=fp8", "scaling=dynamic", "model.arch.norm=post"],
                                       ["format=fp16", "scaling=unit"],
                                       ["format=fp8", "scaling=unit", "model.arch.norm=post"],
                                       ["format=mxfp8", "scaling=unit"]])
def test_a_charlm_cell_trains_and_reports_validation_loss_and_bpc(make_cfg, text_file, tmp_path, overrides):
    cfg = make_cfg("model=charlm", "model.data.source=local", f"model.data.path={text_file}", "model.data.sha256=null",
                   "model.iterations=30", "model.arch.layers=2", "model.arch.embedding=32", "model.arch.block_size=16",
                   "train.log_every=10", *overrides)
    record = run_cell(cfg)
    assert record["status"] == "ok", record["reason"]
    metrics = record["metrics"]
    assert metrics["val_bpc"] == pytest.approx(metrics["val_loss"] / math.log(2))
    assert metrics["val_loss"] < math.log(metrics["vocabulary"])  # learnt something in 30 steps
    assert record["timing"]["steps"] == 30
    assert read_record(tmp_path / cfg.cell / "result.json")["config"]["model"]["arch"]["norm"] == cfg.model.arch.norm


def test_validation_is_the_mean_over_every_window_of_the_split(text_file):
    from bench.tasks.charlm import charlm_task

    cfg = OmegaConf.create({"iterations": 2, "batch_size": 4, "eval_batch_size": 7,
                            "arch": {"layers": 1, "heads": 2, "embedding": 16, "block_size": 32, "dropout": 0.0,
                                     "bias": False, "norm": "pre"},
                            "data": _data(path=str(text_file))})
    task = charlm_task(cfg, torch.device("cpu"), seed=0)
    metrics = task.evaluate(task.model, lambda x: x)
    _, val, vocabulary = encode(text_file.read_text(), 0.9)
    x, y = validation_windows(val, 32)
    with torch.no_grad():
        losses = torch.nn.functional.cross_entropy(task.model(x).transpose(1, 2), y, reduction="none").double()
    assert metrics["val_loss"] == pytest.approx(float(losses.mean()), rel=1e-6)
    assert metrics["val_window_loss_std"] == pytest.approx(float(losses.mean(1).std()), rel=1e-6)
    assert metrics["val_tokens"] == y.numel() and metrics["vocabulary"] == len(vocabulary)


def test_a_steps_flops_count_the_causal_attention_on_cpu(make_cfg, text_file):
    """The traced step counts charlm's causal attention as one fused op per layer with torch's SDPA formulas: 2 GEMMs
    of 2·b·h·s²·d forward, 5 backward (by hand); the rest of its FLOPs are its Linears' three GEMMs each."""
    from bench.running.run import build_cell, preflight

    cfg = make_cfg("model=charlm", "model.data.source=local", f"model.data.path={text_file}", "model.data.sha256=null",
                   "model.arch.layers=2", "model.arch.heads=2", "model.arch.embedding=32", "model.arch.block_size=16",
                   "model.batch_size=3")
    cell = build_cell(cfg, preflight(cfg)[1])
    attention = [o for o in cell.trace.ops if o.kind == "attention"]
    b, h, s, d = 3, 2, 16, 32 // 2
    assert len(attention) == 2 * 2 and sum(o.flops for o in attention) == 2 * (2 + 5) * 2 * b * h * s * s * d
    tokens, width = b * s, 32
    linears = (2 * (3 * width * width + width * width + 2 * 4 * width * width)
               + width * cell.task.model.lm_head.out_features)
    assert sum(o.flops for o in cell.trace.ops if o.kind == "gemm") == 3 * 2 * tokens * linears


