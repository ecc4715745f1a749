"""BERT-base fine-tuned on SQuAD v1.1 (the Unit Scaling paper's evaluation; google-research/bert's recipe).

max_seq_length 384, doc_stride 128, batch 12, AdamW lr 3e-5 with linear decay, 2 epochs; n-best 20,
max answer length 30; exact match and F1 on the whole dev set as the official v1.1 scorer computes them (offline).
The loss is the mean of the start and end cross-entropies, as BertForQuestionAnswering computes it.
"""

from __future__ import annotations

import torch
from omegaconf import DictConfig

from bench.errors import ConfigError
from bench.tasks.base import Task
from bench.tasks.squad_processing import (
    postprocess_predictions,
    prepare_eval_features,
    prepare_train_features,
    squad_scores,
)
from bench.tasks.text import batches, build_model, check_config, load_splits, load_tokenizer, require_hub


def check_squad(model: DictConfig) -> None:
    check_config(model)
    if not 0 < model.doc_stride < model.max_length // 2:
        raise ConfigError(f"model.doc_stride={model.doc_stride} must be in (0, max_length/2 = {model.max_length // 2}):"
                          " the window must hold the question, the stride and new context")


def squad_task(cfg: DictConfig, device: torch.device, seed: int) -> Task:
    require_hub(cfg)
    tokenizer = load_tokenizer(cfg)
    splits = load_splits(cfg.data)
    train, dev = splits["train"], splits["validation"]
    train_features = train.map(lambda ex: prepare_train_features(ex, tokenizer, cfg.max_length, cfg.doc_stride),
                               batched=True, remove_columns=train.column_names)
    dev_features = dev.map(lambda ex: prepare_eval_features(ex, tokenizer, cfg.max_length, cfg.doc_stride),
                           batched=True, remove_columns=dev.column_names)
    model_inputs = tuple(tokenizer.model_input_names)  # DistilBERT and RoBERTa take no token_type_ids
    train_t = {k: torch.tensor(train_features[k]) for k in (*model_inputs, "start_positions", "end_positions")}
    dev_t = {k: torch.tensor(dev_features[k]) for k in model_inputs}
    arch = cfg.arch
    model, source = build_model(cfg, device, "AutoModelForQuestionAnswering", "BertForQuestionAnswering", "BertConfig",
                                dict(num_hidden_layers=arch.layers, hidden_size=arch.hidden,
                                     intermediate_size=arch.intermediate, num_attention_heads=arch.heads,
                                     max_position_embeddings=max(512, cfg.max_length)),
                                vocab_size=len(tokenizer))

    def train_batches(epoch: int):
        return batches(train_t, cfg.batch_size, torch.Generator().manual_seed(seed * 100_003 + epoch), device)

    def forward(model, batch, cast_inputs):
        out = model(**{k: batch[k] for k in model_inputs})
        return (out.start_logits.float(), out.end_logits.float()), (batch["start_positions"], batch["end_positions"])

    def loss(outputs, positions, cross_entropy):
        return (cross_entropy(outputs[0], positions[0]) + cross_entropy(outputs[1], positions[1])) / 2

    @torch.no_grad()
    def evaluate(model, _) -> dict:
        model.eval()
        starts, ends = [], []
        for batch in batches(dev_t, cfg.eval_batch_size, None, device):
            out = model(**batch)
            starts.append(out.start_logits.float().cpu())
            ends.append(out.end_logits.float().cpu())
        model.train()
        predictions = postprocess_predictions(dev, dev_features, torch.cat(starts).numpy(), torch.cat(ends).numpy(),
                                              cfg.n_best, cfg.max_answer_length)
        return {**squad_scores(dev, predictions), "dev_examples": len(dev), "dev_windows": len(dev_features)}

    return Task(model=model, train_batches=train_batches, forward=forward, loss=loss, evaluate=evaluate,
                batch_size=cfg.batch_size, steps_per_epoch=len(train_features) // cfg.batch_size, source=source)

