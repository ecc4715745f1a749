"""Compose the real configs (conf/) with Hydra's compose API, as the runner would."""

import os
import random
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import bench.running.config  # noqa: F401 - registers the schema and the `lower` resolver
from bench.numerics import fused

CONF = Path(__file__).resolve().parents[1] / "conf"
# The suite runs the eager quantisers, the reference (and no compile per new shape); tests/test_fused.py switches the
# fused ones on, and holds them and a fused training run to it. Set before any test, so launched ranks inherit it.
os.environ.setdefault(fused.SWITCH, "0")
# Where a test switches them on, each layout compiles on its first call, as a long run's steady state: a test of when
# a graph pays for itself (tests/test_fused.py) asks for that itself
os.environ[fused.COMPILE_WHEN] = fused.AT_ONCE


@pytest.fixture
def make_cfg(tmp_path):
    """make_cfg("format=fp16", ...) -> the composed DictConfig, writing under tmp_path."""

    def _make(*overrides):
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            return compose("config", overrides=[f"results_dir={tmp_path}", *overrides])

    return _make


def _look_pretrained(model, seed: int):
    """Weights as a trained checkpoint has them, unlike a fresh init: non-zero biases everywhere, LayerNorm
    weights away from 1, matrices with per-tensor scales other than the init's."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=generator)
            if "LayerNorm" in name or "layer_norm" in name:
                p.copy_(0.8 + 0.3 * noise if name.endswith("weight") else 0.1 * noise)
            elif name.endswith("bias"):
                p.copy_(0.2 * noise)
            else:
                p.copy_((0.03 + 0.04 * torch.rand((), generator=generator)) * noise)
    return model


@pytest.fixture
def make_checkpoint(tmp_path):
    """make_checkpoint("bert" | "distilbert") -> a local directory laid out as the hub's checkpoints are
    (BertForPreTraining / DistilBertForMaskedLM weights, config.json, the shipped WordPiece vocabulary), with
    weights that look pretrained."""
    from transformers import BertConfig, BertForPreTraining, BertTokenizer, DistilBertConfig, DistilBertForMaskedLM

    def _make(arch: str, seed: int = 0, **size):
        tokenizer = BertTokenizer(vocab=str(Path(bench.running.config.DATA_DIR) / "vocab.txt"), do_lower_case=True)
        if arch == "bert":
            config = BertConfig(**{"vocab_size": len(tokenizer), "hidden_size": 64, "num_hidden_layers": 2,
                                   "num_attention_heads": 2, "intermediate_size": 128, **size})
            model = BertForPreTraining(config)
        else:
            config = DistilBertConfig(**{"vocab_size": len(tokenizer), "dim": 64, "n_layers": 2, "n_heads": 2,
                                         "hidden_dim": 128, **size})
            model = DistilBertForMaskedLM(config)
        directory = tmp_path / f"{arch}-checkpoint-{seed}"
        _look_pretrained(model, seed).save_pretrained(directory)
        tokenizer.save_pretrained(directory)
        return directory

    return _make


@pytest.fixture
def hub_answers(monkeypatch):
    """For tests whose stand-ins replace the hub's loaders: the hub counts as reachable (bench.data.hub's probe)."""
    import bench.data.hub

    monkeypatch.setattr(bench.data.hub, "reachable", lambda *a, **k: True)


def interrupted_at_checkpoint_then_resumed(cfg, monkeypatch, step: int) -> dict:
    """Run `cfg`'s cell, interrupt it (KeyboardInterrupt, as Ctrl-C) right after its checkpoint at `step`, then run
    it again; returns the resumed run's record."""
    import bench.running.checkpoint as checkpoint
    from bench.running.run import run_cell

    after_step = checkpoint.Checkpointer.after_step

    def stop_after_the_checkpoint(self, at, save):
        after_step(self, at, save)
        if at == step:
            raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint.Checkpointer, "after_step", stop_after_the_checkpoint)
    with pytest.raises(KeyboardInterrupt):
        run_cell(cfg)
    monkeypatch.setattr(checkpoint.Checkpointer, "after_step", after_step)
    return run_cell(cfg)


def straight_and_resumed(straight, interrupted, monkeypatch, step: int) -> tuple[dict, dict]:
    """The final checkpoints of `straight` run through and of `interrupted` (the same cell under another
    experiment_name) stopped right after its checkpoint at `step` and resumed: a bit-for-bit resume makes them equal."""
    from pathlib import Path

    import torch

    from bench.running.run import run_cell

    assert run_cell(straight)["status"] == "ok"
    record = interrupted_at_checkpoint_then_resumed(interrupted, monkeypatch, step)
    assert record["status"] == "ok" and record["resumed_from"]["step"] == step
    return tuple(torch.load(Path(c.results_dir) / c.cell / "checkpoint.pt", weights_only=False)
                 for c in (straight, interrupted))


@pytest.fixture(scope="session")
def text_file(tmp_path_factory):
    """(the char-LM tests') ~60k characters of made-up verse: 40-odd distinct characters, newlines, capitals,
    punctuation."""
    rng = random.Random(7)
    words = ["thou", "art", "more", "lovely", "and", "temperate", "rough", "winds", "do", "shake", "the", "darling",
             "buds", "of", "may", "summer's", "lease", "hath", "all", "too", "short", "a", "date"]
    lines = []
    for _ in range(2000):
        line = " ".join(rng.choice(words) for _ in range(rng.randint(3, 8)))
        lines.append(line.capitalize() + rng.choice([",", ".", ";", "!", "?", ":"]))
    path = tmp_path_factory.mktemp("text") / "verse.txt"
    path.write_text("\n".join(lines) + "\n")
    return path


def char_data(**kw):
    """A char-LM's `model.data` node: local where a path is given."""
    return OmegaConf.create({"source": "local" if kw.get("path") else "download", "path": None, "url": "",
                             "sha256": None, "train_fraction": 0.9} | kw)


@pytest.fixture
def predicted_memory():
    """predicted_memory(cfg) -> bench.predict's memory of the cell's step by category, as its table gives it on an
    H100 (a distributed cell's: one rank's, of its share of the batch)."""
    def _predicted(cfg) -> dict:
        from bench.reporting.predict_cells import _rank_share, _traced, memory_of
        from bench.speed.model import recipe_on
        from bench.speed.profiles import shipped_gpus

        trace = _traced(_rank_share(cfg))
        return memory_of(cfg, trace, recipe_on(cfg, trace, shipped_gpus()["H100"]))

    return _predicted


def eager_tensor_core_kernels(monkeypatch) -> None:
    """The tensor-core model (bench/numerics/tensor_cores.py) on its eager kernels, as on a device inductor does not
    build for: compiling each GEMM shape costs seconds, and tests/test_tensor_cores.py holds the compiled kernels to
    these bit for bit."""
    from bench.numerics import tensor_cores

    monkeypatch.setattr(tensor_cores, "_kernels", lambda step, device: (tensor_cores.split, step.chain))
