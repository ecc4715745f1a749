"""DistilBERT fine-tuned on IMDb sentiment (Raschka's precision comparison).

Raschka's split: the 50,000 reviews (train + test) pooled, shuffled with a fixed seed, then
35,000 / 5,000 / 10,000 train / validation / test (model.data.split = [0.7, 0.1, 0.2]); max length 512
with truncation, padding to the longest review in each batch; batch 12, drop_last.
"""

from __future__ import annotations

import datasets
import torch
from omegaconf import DictConfig

from bench.errors import ConfigError
from bench.tasks.base import Task
from bench.tasks.text import batches, build_model, check_config, load_splits, load_tokenizer, require_hub


def pooled_split(splits: datasets.DatasetDict, fractions, seed: int) -> tuple[datasets.Dataset, ...]:
    """Pool every labelled split, shuffle with `seed`, cut by `fractions` (train, validation, test)."""
    pooled = datasets.concatenate_datasets([s for name, s in splits.items() if name != "unsupervised"])
    pooled = pooled.shuffle(seed=seed)
    n_train, n_val = (round(f * len(pooled)) for f in fractions[:2])
    return (pooled.select(range(n_train)), pooled.select(range(n_train, n_train + n_val)),
            pooled.select(range(n_train + n_val, len(pooled))))


def check_imdb(model: DictConfig) -> None:
    check_config(model)
    if len(model.data.split) != 3 or abs(sum(model.data.split) - 1) > 1e-9:
        raise ConfigError(f"model.data.split={list(model.data.split)} must be 3 fractions summing to 1")


def imdb_task(cfg: DictConfig, device: torch.device, seed: int) -> Task:
    require_hub(cfg)
    tokenizer = load_tokenizer(cfg)
    train, val, test = pooled_split(load_splits(cfg.data), list(cfg.data.split), cfg.data.seed)

    def encode(split):
        enc = tokenizer(list(split["text"]), truncation=True, max_length=cfg.max_length, padding="max_length")
        return {"input_ids": torch.tensor(enc["input_ids"]), "attention_mask": torch.tensor(enc["attention_mask"]),
                "labels": torch.tensor(list(split["label"]))}

    train_t, val_t, test_t = encode(train), encode(val), encode(test)
    arch = cfg.arch
    model, source = build_model(cfg, device, "AutoModelForSequenceClassification",
                                "DistilBertForSequenceClassification", "DistilBertConfig",
                                dict(n_layers=arch.layers, dim=arch.hidden, hidden_dim=arch.intermediate,
                                     n_heads=arch.heads, max_position_embeddings=max(512, cfg.max_length)),
                                vocab_size=len(tokenizer), num_labels=2)

    def train_batches(epoch: int):
        generator = torch.Generator().manual_seed(seed * 100_003 + epoch)
        return batches(train_t, cfg.batch_size, generator, device, trim_padding=True)

    def forward(model, batch, cast_inputs):
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        return logits.float(), batch["labels"]

    @torch.no_grad()
    def accuracy(model, tensors) -> float:
        was_training = model.training
        model.eval()
        correct = 0
        for batch in batches(tensors, cfg.eval_batch_size, None, device, trim_padding=True):
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            correct += (logits.argmax(-1) == batch["labels"]).sum().item()
        model.train(was_training)
        return correct / len(tensors["labels"])

    return Task(
        model=model, train_batches=train_batches, forward=forward,
        loss=lambda logits, labels, cross_entropy: cross_entropy(logits, labels),
        evaluate=lambda model, _: {"test_accuracy": accuracy(model, test_t), "test_examples": len(test)},
        validate=lambda model, _: {"val_accuracy": accuracy(model, val_t)},
        batch_size=cfg.batch_size, steps_per_epoch=len(train) // cfg.batch_size, source=source,
    )

