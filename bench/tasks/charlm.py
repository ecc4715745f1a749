"""A character-level GPT on Tiny Shakespeare, as nanoGPT's `shakespeare_char` example trains it.

Data as nanoGPT's data/shakespeare_char/prepare.py: the vocabulary is every distinct character of the whole
text (sorted), the first 90% is training, the last 10% validation. Training batches as nanoGPT's get_batch:
`batch_size` windows of `block_size` characters at uniformly random offsets, the targets shifted by one.

Validation differs on purpose: nanoGPT estimates the loss on `eval_iters` random batches (20 in its CPU
command, so its ~1.88 carries a few hundredths of sampling noise); here it is the mean over the *whole*
validation split, cut into consecutive windows of `block_size` (1,742 windows, 111,488 of the 111,540
characters on Tiny Shakespeare). Each character is predicted from 0 to block_size-1 characters of context,
the same mix as random windows give, so the expectation is nanoGPT's and the only noise left is training's.
"""

from __future__ import annotations

import hashlib
import math
import os
import tempfile
import urllib.request
from pathlib import Path

import torch
from omegaconf import DictConfig
from torch import nn

from bench.errors import ConfigError, check_choice
from bench.numerics.ops import Add, CausalAttention, Residual
from bench.tasks.base import Task, built_on


class CausalSelfAttention(nn.Module):
    def __init__(self, embedding: int, heads: int, bias: bool, dropout: float):
        super().__init__()
        self.heads = heads
        self.c_attn = nn.Linear(embedding, 3 * embedding, bias=bias)
        self.c_proj = nn.Linear(embedding, embedding, bias=bias)
        self.attend = CausalAttention(dropout)
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x):
        batch, length, channels = x.shape
        q, k, v = (t.view(batch, length, self.heads, channels // self.heads).transpose(1, 2)
                   for t in self.c_attn(x).split(channels, dim=2))
        y = self.attend(q, k, v)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).contiguous().view(batch, length, channels)))


class MLP(nn.Module):
    def __init__(self, embedding: int, bias: bool, dropout: float):
        super().__init__()
        self.c_fc, self.gelu = nn.Linear(embedding, 4 * embedding, bias=bias), nn.GELU()
        self.c_proj, self.dropout = nn.Linear(4 * embedding, embedding, bias=bias), nn.Dropout(dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class TransformerBlock(nn.Module):
    """pre-norm (nanoGPT, GPT-2): x + f(LN(x)); post-norm (the original transformer): LN(x + f(x))."""

    def __init__(self, embedding: int, heads: int, bias: bool, dropout: float, norm: str):
        super().__init__()
        self.norm = norm
        self.ln_1, self.ln_2 = nn.LayerNorm(embedding, bias=bias), nn.LayerNorm(embedding, bias=bias)
        self.attn = CausalSelfAttention(embedding, heads, bias, dropout)
        self.mlp = MLP(embedding, bias, dropout)
        self.attn_residual, self.mlp_residual = Residual(), Residual()

    def forward(self, x):
        if self.norm == "pre":
            x = self.attn_residual(x, lambda h: self.attn(self.ln_1(h)))
            return self.mlp_residual(x, lambda h: self.mlp(self.ln_2(h)))
        x = self.ln_1(self.attn_residual(x, self.attn))
        return self.ln_2(self.mlp_residual(x, self.mlp))


NORMS = ("pre", "post")
SHAKESPEARE_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"  # Tiny Shakespeare
# its 65 distinct characters, sorted (nanoGPT's shakespeare_char vocabulary): all a trace of a char-LM needs of the text
SHAKESPEARE_CHARACTERS = "\n !$&',-.3:;?ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"


class CharGPT(nn.Module):
    """nanoGPT's GPT: token + position embeddings, `layers` blocks, final LayerNorm (pre-norm only: a post-norm
    stack already ends in one), a bias-free head tied to the token embedding; N(0, 0.02) init, the residual
    projections N(0, 0.02 / sqrt(2 * layers)) (GPT-2)."""

    def __init__(self, vocab: int, block_size: int, layers: int, heads: int, embedding: int, bias: bool = False,
                 dropout: float = 0.0, norm: str = "pre"):
        super().__init__()
        if norm not in NORMS:
            raise ValueError(f"model.arch.norm={norm!r} is not valid; valid: {', '.join(NORMS)}")
        self.block_size = block_size
        self.wte, self.wpe = nn.Embedding(vocab, embedding), nn.Embedding(block_size, embedding)
        self.embedding_sum = Add()
        self.drop = nn.Dropout(dropout)
        self.h = nn.ModuleList(TransformerBlock(embedding, heads, bias, dropout, norm) for _ in range(layers))
        self.ln_f = nn.LayerNorm(embedding, bias=bias) if norm == "pre" else nn.Identity()
        self.lm_head = nn.Linear(embedding, vocab, bias=False)
        self.wte.weight = self.lm_head.weight  # tied, as nanoGPT
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * layers))

    def forward(self, idx):
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.embedding_sum(self.wte(idx), self.wpe(positions)))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def check_config(model: DictConfig) -> None:
    check_choice(model.arch.norm, NORMS, "model.arch.norm")
    check_text_source(model.data)
    if model.arch.embedding % model.arch.heads:
        raise ConfigError(f"model.arch.embedding={model.arch.embedding} must be a multiple of "
                          f"model.arch.heads={model.arch.heads}")


def check_text_source(data: DictConfig) -> None:
    """`load_text`'s keys: a local source names its path, a download none."""
    if (data.source == "local") != bool(data.path):
        raise ConfigError("model.data.source=local reads model.data.path (set both; or neither, to download "
                          f"{data.url})")


def describe(model_cfg: dict) -> tuple[str, str]:
    """(dataset, label): Tiny Shakespeare is known by its checksum, other text is `char_text`; the label gives
    depth, width and norm placement."""
    dataset = "shakespeare_char" if model_cfg["data"].get("sha256") == SHAKESPEARE_SHA256 else "char_text"
    arch = model_cfg["arch"]
    return dataset, f"charlm ({arch['layers']}L×{arch['embedding']} {arch['norm']}-norm, {dataset})"


def text_cache(data: DictConfig) -> Path:
    """Where `data.url` is kept once downloaded: the user's cache (XDG_CACHE_HOME), precision-bench/<file name>."""
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "precision-bench" / Path(data.url).name


def text_file(data: DictConfig) -> Path:
    """Where `data`'s text is read from: `data.path` (source=local), else its download's place in the cache."""
    return Path(data.path) if data.source == "local" else text_cache(data)


def stand_in_text(data: DictConfig, length: int) -> Path | None:
    """For a trace, which reads no values: a file of `length` characters cycling through Tiny Shakespeare's
    vocabulary, where `data` names Tiny Shakespeare (its sha256) and the text is not here; None otherwise."""
    if data.get("sha256") != SHAKESPEARE_SHA256 or text_file(data).is_file():
        return None
    path = Path(tempfile.gettempdir()) / f"precision-bench-stand-in-{length}.txt"
    if not path.is_file():
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text("".join(SHAKESPEARE_CHARACTERS[i % len(SHAKESPEARE_CHARACTERS)] for i in range(length)))
        tmp.replace(path)
    return path


def load_text(data: DictConfig) -> str:
    """`data.path` (source=local), else `data.url` (downloaded once into the user's cache); checked against
    `data.sha256` when that is set, so a different or truncated file never trains silently."""
    path = text_file(data)
    if not path.is_file() and data.source == "local":
        raise ConfigError(f"model.data.path={data.path}: no such file")
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            with urllib.request.urlopen(data.url, timeout=60) as response:
                body = response.read()
        except OSError as e:
            raise ConfigError(f"could not download {data.url} ({e}); without internet, pass model.data.source=local "
                              "model.data.path=<a local copy> (other text: model.data.sha256=null too)") from e
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(body)
        tmp.replace(path)
    raw = path.read_bytes()
    if data.sha256 and hashlib.sha256(raw).hexdigest() != data.sha256:
        raise ConfigError(f"{path}: sha256 {hashlib.sha256(raw).hexdigest()} is not the expected {data.sha256} "
                          "(set model.data.sha256=null to train on other text)")
    return raw.decode("utf-8")


def encode(text: str, train_fraction: float) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """(train ids, validation ids, vocabulary): nanoGPT's prepare.py."""
    vocabulary = sorted(set(text))
    index = {ch: i for i, ch in enumerate(vocabulary)}
    ids = torch.tensor([index[ch] for ch in text], dtype=torch.long)
    split = int(len(ids) * train_fraction)
    return ids[:split], ids[split:], vocabulary


def validation_windows(ids: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The validation split as consecutive, non-overlapping windows (inputs, targets shifted by one)."""
    windows = (len(ids) - 1) // block_size
    span = windows * block_size
    return ids[:span].view(windows, block_size), ids[1:span + 1].view(windows, block_size)


def charlm_task(cfg: DictConfig, device: torch.device, seed: int) -> Task:
    arch = cfg.arch
    train_ids, val_ids, vocabulary = encode(load_text(cfg.data), cfg.data.train_fraction)
    train_ids = train_ids.to(device)
    val_x, val_y = (t.to(device) for t in validation_windows(val_ids, arch.block_size))
    model = built_on(device, lambda: CharGPT(len(vocabulary), arch.block_size, arch.layers, arch.heads, arch.embedding,
                                             arch.bias, arch.dropout, arch.norm))
    batch_size, block = cfg.batch_size, arch.block_size

    def train_batches(epoch: int):
        """`iterations` batches at random offsets (nanoGPT's get_batch), a pure function of seed and epoch."""
        generator = torch.Generator().manual_seed(seed * 100_003 + epoch)
        offsets = torch.randint(len(train_ids) - block, (cfg.iterations, batch_size), generator=generator).to(device)
        steps = torch.arange(block, device=device)
        for row in offsets:
            positions = row[:, None] + steps
            yield train_ids[positions], train_ids[positions + 1]

    def forward(model, batch, cast_inputs):
        x, y = batch
        return model(x).float(), y

    def loss(logits, targets, cross_entropy):
        return cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))

    @torch.no_grad()
    def evaluate(model, cast_inputs) -> dict:
        """Mean loss over every validation window, each window's by the task's own loss (`task.compute_loss`: the one
        training minimises, with the cross-entropy unit scaling or u-μP swapped in, its softmax multiplier
        included); also the spread of the per-window means, from which the noise of nanoGPT's estimate (eval_iters
        batches of batch_size random windows) follows: val_window_loss_std / sqrt(eval_iters * batch_size)."""
        model.eval()
        per_window = []
        for start in range(0, len(val_x), cfg.eval_batch_size):
            logits = model(val_x[start:start + cfg.eval_batch_size]).float()
            per_window += [task.compute_loss(window, targets)
                           for window, targets in zip(logits, val_y[start:start + cfg.eval_batch_size])]
        model.train()
        per_window = torch.stack(per_window).double()
        mean = float(per_window.mean())  # every window has block_size characters: the mean over all characters
        return {"val_loss": mean, "val_bpc": mean / math.log(2), "val_tokens": val_y.numel(),
                "val_window_loss_std": float(per_window.std()), "vocabulary": len(vocabulary)}

    task = Task(model=model, train_batches=train_batches, forward=forward, loss=loss, evaluate=evaluate,
                batch_size=batch_size, steps_per_epoch=cfg.iterations, validate=evaluate)
    return task
