"""Masked-language-model pretraining from scratch: BERT's objective (the Unit Scaling paper's pretraining step,
small).

Data: the char-LM's text (Tiny Shakespeare by default, read from `model.data.path` or downloaded once; its first
90% training, the last 10% validation), tokenised by BERT's WordPiece tokenizer with the vocabulary the repository
ships (`model.vocab`, bench/data/vocab.txt: 303 pieces, lowercased; most words come out letter by letter, a few
punctuation marks as [UNK]), so that a pretrained checkpoint fine-tunes on the SQuAD-style fixture through the QA
task with the same tokenizer.

Masking as BERT's create_pretraining_data.py: each position is chosen with probability `mask_rate` (0.15); a chosen
one becomes [MASK] 80% of the time, a random piece (never a special token) 10%, itself 10%; the loss and the
accuracy are over the chosen positions only. Training windows are `block_size` pieces at random offsets (the
char-LM's batches), masked afresh each step from a generator seeded by (seed, epoch); validation is every
consecutive window of the held-out split, masked once by a generator of its own, so every cell is scored on the
same positions.

The encoder is transformers' BertForMaskedLM or DistilBertForMaskedLM from its config class at `model.arch` size,
randomly initialised (transformers' init), its attention through transformers' attention-function registry (which
scaling=unit points at unit_scaling's attention: bench/numerics/unit.py). Its output head is tied to the word
embeddings, as BERT ties it (`model.tie_embeddings`).
"""

from __future__ import annotations

import torch
from omegaconf import DictConfig

from bench.errors import ConfigError, check_choice
from bench.tasks.base import Task, built_on
from bench.tasks.charlm import SHAKESPEARE_SHA256, check_text_source, load_text

IGNORED = -100  # a label the loss skips (transformers' and torch's ignore_index)
# (masked-LM class, its config class, how the config names depth, width, heads, FFN width; its two dropouts)
ENCODERS = {
    "bert": ("BertForMaskedLM", "BertConfig",
             dict(layers="num_hidden_layers", hidden="hidden_size", heads="num_attention_heads",
                  intermediate="intermediate_size"), ("hidden_dropout_prob", "attention_probs_dropout_prob")),
    "distilbert": ("DistilBertForMaskedLM", "DistilBertConfig",
                   dict(layers="n_layers", hidden="dim", heads="n_heads", intermediate="hidden_dim"),
                   ("dropout", "attention_dropout")),
}


def mask_tokens(ids: torch.Tensor, rate: float, mask_id: int, candidates: torch.Tensor, generator: torch.Generator,
                keep: float = 0.1, replace: float = 0.1) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, labels) for masked-LM training, BERT's rule: each position chosen with probability `rate`; a chosen
    one becomes `mask_id` with probability 1 - keep - replace, a random one of `candidates` (the vocabulary less its
    special tokens) with probability `replace`, and stays itself with probability `keep`. Labels hold the original
    id at chosen positions, IGNORED elsewhere. Draws come from `generator` only, on the CPU, so a batch is a
    function of it."""
    cpu = ids.cpu()
    chosen = torch.rand(cpu.shape, generator=generator) < rate
    fate = torch.rand(cpu.shape, generator=generator)  # < keep: unchanged; < keep + replace: random; else [MASK]
    random_ids = candidates[torch.randint(len(candidates), cpu.shape, generator=generator)]
    inputs = torch.where(chosen & (fate >= keep + replace), mask_id, cpu)
    inputs = torch.where(chosen & (fate >= keep) & (fate < keep + replace), random_ids, inputs)
    labels = torch.where(chosen, cpu, IGNORED)
    return inputs.to(ids.device), labels.to(ids.device)


def check_config(model: DictConfig) -> None:
    check_choice(model.arch.family, tuple(ENCODERS), "model.arch.family")
    if not 0 < model.mask_rate < 1:
        raise ConfigError(f"model.mask_rate={model.mask_rate} must be in (0, 1) (BERT's: 0.15)")
    check_text_source(model.data)
    arch = model.arch
    if min(arch.layers, arch.hidden, arch.heads, arch.intermediate, arch.block_size) < 1 or arch.hidden % arch.heads:
        raise ConfigError("model.arch sizes must be >= 1, with hidden divisible by heads")
    if arch.get("dropout") is not None and not 0 <= arch.dropout < 1:
        raise ConfigError(f"model.arch.dropout={arch.dropout} must be in [0, 1) (null: transformers' 0.1, BERT's)")


def describe(model_cfg: dict) -> tuple[str, str]:
    """(dataset, label): the text by its checksum (Tiny Shakespeare, or any other `text`), the encoder's family and
    size."""
    dataset = "tiny_shakespeare" if model_cfg["data"].get("sha256") == SHAKESPEARE_SHA256 else "text"
    arch = model_cfg["arch"]
    return dataset, f"{model_cfg['name']} ({arch['family']} {arch['layers']}L×{arch['hidden']} MLM, {dataset})"


def build_encoder(cfg: DictConfig, tokenizer) -> torch.nn.Module:
    """transformers' masked-LM model of `model.arch.family`, from its config class at `model.arch` size (random init,
    transformers' own: N(0, 0.02) matrices and embeddings), for `tokenizer`'s vocabulary."""
    import transformers

    model_class, config_class, names, dropouts = ENCODERS[cfg.arch.family]
    sizes = {names[key]: cfg.arch[key] for key in names}
    if cfg.arch.get("dropout") is not None:
        sizes |= dict.fromkeys(dropouts, cfg.arch.dropout)
    config = getattr(transformers, config_class)(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                                                 max_position_embeddings=cfg.arch.block_size,
                                                 tie_word_embeddings=cfg.tie_embeddings, **sizes)
    return getattr(transformers, model_class)(config)


def tokenizer_of(cfg: DictConfig):
    """BERT's WordPiece tokenizer with the vocabulary `model.vocab` (lowercasing, as bench/tasks/text.py's)."""
    from transformers import BertTokenizer

    return BertTokenizer(vocab=str(cfg.vocab), do_lower_case=True)


def non_special_ids(tokenizer) -> torch.Tensor:
    """The ids a random replacement draws from: the vocabulary less its special tokens."""
    special = set(tokenizer.all_special_ids)
    return torch.tensor([i for i in range(len(tokenizer)) if i not in special])


def mlm_task(cfg: DictConfig, device: torch.device, seed: int) -> Task:
    arch = cfg.arch
    text = load_text(cfg.data)
    split = int(len(text) * cfg.data.train_fraction)
    tokenizer = tokenizer_of(cfg)
    train_ids, val_ids = (torch.tensor(tokenizer(part, add_special_tokens=False)["input_ids"])
                          for part in (text[:split], text[split:]))
    candidates, mask_id = non_special_ids(tokenizer), tokenizer.mask_token_id
    block, batch_size = arch.block_size, cfg.batch_size
    windows = len(val_ids) // block
    val_inputs, val_labels = mask_tokens(val_ids[:windows * block].view(windows, block), cfg.mask_rate, mask_id,
                                         candidates, torch.Generator().manual_seed(2**31 - 1))  # one set for all cells
    val_inputs, val_labels = val_inputs.to(device), val_labels.to(device)
    model = built_on(device, lambda: build_encoder(cfg, tokenizer))

    def train_batches(epoch: int):
        """`iterations` batches of windows at random offsets, masked afresh: a pure function of seed and epoch."""
        generator = torch.Generator().manual_seed(seed * 100_003 + epoch)
        steps = torch.arange(block)
        for _ in range(cfg.iterations):
            offsets = torch.randint(len(train_ids) - block + 1, (batch_size,), generator=generator)
            inputs, labels = mask_tokens(train_ids[offsets[:, None] + steps], cfg.mask_rate, mask_id, candidates,
                                         generator)
            yield inputs.to(device), labels.to(device)

    def forward(model, batch, cast_inputs):
        inputs, labels = batch
        chosen = labels != IGNORED
        return model(input_ids=inputs).logits[chosen].float(), labels[chosen]  # the chosen positions only

    def loss(logits, targets, cross_entropy):
        return cross_entropy(logits, targets)

    @torch.no_grad()
    def evaluate(model, cast_inputs) -> dict:
        """Loss (the task's own: unit scaling's cross-entropy where it trained with it) and accuracy over every
        masked position of the validation split."""
        model.eval()
        total_loss, correct, count = 0.0, 0, 0
        for start in range(0, windows, cfg.eval_batch_size):
            logits, targets = forward(model, (val_inputs[start:start + cfg.eval_batch_size],
                                              val_labels[start:start + cfg.eval_batch_size]), cast_inputs)
            total_loss += float(task.compute_loss(logits, targets)) * len(targets)
            correct += int((logits.argmax(-1) == targets).sum())
            count += len(targets)
        model.train()
        return {"val_mlm_loss": total_loss / count, "val_mlm_accuracy": correct / count, "val_masked": count,
                "vocabulary": len(tokenizer)}

    task = Task(model=model, train_batches=train_batches, forward=forward, loss=loss, evaluate=evaluate,
                batch_size=batch_size, steps_per_epoch=cfg.iterations, validate=evaluate,
                loss_terms=lambda batch: (batch[1] != IGNORED).sum(),
                source={"pretrained": False, "architecture": type(model).__name__,
                        "size": dict(arch), "tied_embeddings": cfg.tie_embeddings})
    return task
