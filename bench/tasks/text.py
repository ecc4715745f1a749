"""What the transformer tasks share: tokenizer, datasets and models, from the hub or offline.

model.pretrained=true loads `model.hub_name` through transformers (hub or HF cache);
model.pretrained=false builds the architecture from its config class, randomly initialised, at the size
in `model.arch`, with the tokenizer built from `model.vocab` (the repository ships bench/data/vocab.txt).
data.source=hub loads `data.name` through datasets; local loads `data.files` (json/jsonl/csv/parquet in
the hub schema) through datasets' file loaders.
"""

from __future__ import annotations

from pathlib import Path

import datasets
import torch
from omegaconf import DictConfig

_LOADERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}


def load_tokenizer(cfg: DictConfig):
    from transformers import AutoTokenizer, BertTokenizer

    if cfg.pretrained:
        return AutoTokenizer.from_pretrained(cfg.hub_name)
    return BertTokenizer(vocab=str(cfg.vocab), do_lower_case=True)


def load_splits(data: DictConfig) -> datasets.DatasetDict:
    if data.source == "hub":
        return datasets.load_dataset(data.name)
    files = {split: str(path) for split, path in data.files.items()}
    suffixes = {Path(p).suffix for p in files.values()}
    if len(suffixes) != 1 or next(iter(suffixes)) not in _LOADERS:
        raise ValueError(f"model.data.files must share one suffix of {', '.join(_LOADERS)}; got {sorted(suffixes)}")
    return datasets.load_dataset(_LOADERS[suffixes.pop()], data_files=files)


def build_model(cfg: DictConfig, model_class: str, config_class: str, config_kwargs: dict, vocab_size: int,
                **model_kwargs) -> torch.nn.Module:
    """`model_class.from_pretrained(hub_name)`, or `model_class(config_class(...))` at `cfg.arch` size."""
    import transformers

    cls = getattr(transformers, model_class)
    if cfg.pretrained:
        return cls.from_pretrained(cfg.hub_name, **model_kwargs)
    config = getattr(transformers, config_class)(vocab_size=vocab_size, **config_kwargs, **model_kwargs)
    return cls(config)


def batches(tensors: dict[str, torch.Tensor], batch_size: int, generator: torch.Generator | None,
            device: torch.device, trim_padding: bool = False):
    """Yield dict batches (shuffled with `generator`, full batches only when shuffling); with trim_padding,
    cut each batch to its longest sequence (pad-to-longest, as Raschka's collate)."""
    n = len(next(iter(tensors.values())))
    order = torch.randperm(n, generator=generator) if generator is not None else torch.arange(n)
    stop = n - n % batch_size if generator is not None else n
    for start in range(0, stop, batch_size):
        idx = order[start:start + batch_size]
        batch = {k: v[idx] for k, v in tensors.items()}
        if trim_padding:
            length = int(batch["attention_mask"].sum(1).max())
            batch = {k: (v[:, :length] if v.dim() == 2 else v) for k, v in batch.items()}
        yield {k: v.to(device) for k, v in batch.items()}
