"""What the transformer tasks share: tokenizer, datasets and models, from the hub or offline.

model.pretrained=true loads `model.hub_name` (a hub id or a local directory) through transformers' Auto
classes, so any BERT-family checkpoint works for a task (BERT, DistilBERT, RoBERTa, MiniLM, ...), and
checks what the load did: only the task head may be freshly initialised, and only other heads (a
pre-training head, a pooler the task does not use) may be left out; anything else is a ConfigError
before training. model.pretrained=false builds the architecture from its config class, randomly
initialised, at the size in `model.arch`, with the tokenizer built from `model.vocab` (the repository
ships bench/data/vocab.txt).
data.source=hub loads `data.name` through datasets; local loads `data.files` (json/jsonl/csv/parquet in
the hub schema) through datasets' file loaders.
"""

from __future__ import annotations

import sys
from pathlib import Path

import datasets
import torch
from omegaconf import DictConfig

from bench.data import hub
from bench.errors import ConfigError
from bench.tasks.base import built_on, checkpoint_marks, hub_dataset, on_device

_LOADERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}


def describe(model_cfg: dict) -> tuple[str, str]:
    """(dataset, label) for tables: the hub dataset by its published name, or `<dataset>_fixture` for local files;
    the checkpoint, or the size of a randomly initialised model."""
    data = model_cfg["data"]
    dataset = hub_dataset(data) if data["source"] == "hub" else f"{data['name'].rsplit('/', 1)[-1]}_fixture"
    if model_cfg.get("pretrained", True):
        return dataset, f"{model_cfg['name']} ({model_cfg.get('hub_name', 'pretrained')}, {dataset})"
    arch = model_cfg.get("arch") or {}
    return dataset, f"{model_cfg['name']} ({arch.get('layers', '?')}L×{arch.get('hidden', '?')} random init, {dataset})"


def check_config(model: DictConfig) -> None:
    """What every transformer task needs: local files where the data is local, consistent sizes."""
    if model.data.source == "local" and not model.data.files:
        raise ConfigError("model.data.source=local needs model.data.files ({split: path})")
    if min(model.arch.layers, model.arch.hidden, model.arch.heads, model.arch.intermediate) < 1 \
            or model.arch.hidden % model.arch.heads:
        raise ConfigError("model.arch sizes must be >= 1, with hidden divisible by heads")


def require_hub(cfg: DictConfig) -> None:
    """Fail fast, naming the fixes, when the checkpoint or dataset must come from an unreachable hub."""
    hub.require(models=[cfg.hub_name] if cfg.pretrained else [],
                data=[cfg.data.name] if cfg.data.source == "hub" else [])


def load_tokenizer(cfg: DictConfig):
    from transformers import AutoTokenizer, BertTokenizer

    if cfg.pretrained:
        return AutoTokenizer.from_pretrained(cfg.hub_name)
    return BertTokenizer(vocab=str(cfg.vocab), do_lower_case=True)


def load_splits(data: DictConfig) -> datasets.DatasetDict:
    if not sys.stderr.isatty():
        datasets.disable_progress_bars()  # no `Map:` bars in sweep logs and SLURM output
    if data.source == "hub":
        return datasets.load_dataset(data.name)
    files = {split: str(path) for split, path in data.files.items()}
    if missing := [f"{split}: {path}" for split, path in files.items() if not Path(path).is_file()]:
        raise ConfigError(f"model.data.files: no such file ({'; '.join(missing)})")
    suffixes = {Path(p).suffix for p in files.values()}
    if len(suffixes) != 1 or next(iter(suffixes)) not in _LOADERS:
        raise ConfigError(f"model.data.files must share one suffix of {', '.join(_LOADERS)}; got {sorted(suffixes)}")
    return datasets.load_dataset(_LOADERS[suffixes.pop()], data_files=files)


def build_model(cfg: DictConfig, device: torch.device, auto_class: str, model_class: str, config_class: str,
                config_kwargs: dict, vocab_size: int, **model_kwargs) -> tuple[torch.nn.Module, dict]:
    """(model on `device`, what it was built from).

    pretrained: `auto_class.from_pretrained(hub_name)`, checked by `check_loading`. Otherwise
    `model_class(config_class(...))` at `cfg.arch` size, randomly initialised.
    """
    import transformers

    if cfg.pretrained:
        model, loading = getattr(transformers, auto_class).from_pretrained(cfg.hub_name, output_loading_info=True,
                                                                           **model_kwargs)
        return on_device(model, device), {
            "pretrained": True, **checkpoint_source(cfg.hub_name), "architecture": type(model).__name__,
            **check_loading(model, loading, cfg.hub_name), **checkpoint_marks(model.config.to_dict())}
    if (rows := cfg.arch.get("vocab_size")) is not None and rows < vocab_size:
        raise ConfigError(f"model.arch.vocab_size={rows} is under the tokenizer's {vocab_size} pieces (null: its)")
    config = getattr(transformers, config_class)(vocab_size=rows or vocab_size, **config_kwargs, **model_kwargs)
    return built_on(device, lambda: getattr(transformers, model_class)(config)), {
        "pretrained": False, "architecture": model_class, "size": dict(config_kwargs)}


def checkpoint_source(name: str) -> dict:
    """Where a checkpoint came from: a local directory, or a hub id and the commit of its cached snapshot."""
    if Path(name).is_dir():
        return {"checkpoint": name, "path": str(Path(name).resolve()), "commit": None}
    from transformers.utils import cached_file

    config_path = Path(cached_file(name, "config.json"))
    commit = config_path.parent.name if config_path.parent.parent.name == "snapshots" else None
    return {"checkpoint": name, "path": str(config_path.parent), "commit": commit}


def check_loading(model: torch.nn.Module, loading: dict, name: str) -> dict:
    """The task head that was initialised and the checkpoint weights left out; ConfigError if the load is wrong.

    transformers names weights relative to the task model: the base model's under `base_model_prefix`
    (e.g. `bert.`), the task head's outside it. A missing weight outside the base model is the task head,
    expected when fine-tuning; a missing weight inside it means the checkpoint is of another architecture
    or size and the encoder would train from random weights. A checkpoint weight the model does not use is
    expected when it belongs to a module the task model does not have (a pre-training head, or the pooler
    that a QA model drops); one that belongs to a module the model has means it was not loaded.
    """
    prefix = model.base_model_prefix
    base = getattr(model, prefix)

    def in_base(key: str) -> bool:
        return key.startswith(prefix + ".")

    def belongs_to_a_module_the_model_lacks(key: str) -> bool:
        owner, rest = (base, key[len(prefix) + 1:]) if in_base(key) else (model, key)
        return rest.split(".")[0] not in dict(owner.named_children())

    missing = sorted(loading["missing_keys"])
    unexpected = sorted(loading["unexpected_keys"])
    problems = []
    def listed(keys: list[str]) -> str:
        return f"{', '.join(keys[:8])}{' ...' if len(keys) > 8 else ''}"

    if encoder := [k for k in missing if in_base(k)]:
        problems.append(f"{len(encoder)} weights of the {type(model).__name__} encoder are missing from the checkpoint"
                        f" and would be randomly initialised: {listed(encoder)}")
    if unused := [k for k in unexpected if not belongs_to_a_module_the_model_lacks(k)]:
        problems.append(f"{len(unused)} checkpoint weights were not loaded into modules the model has: "
                        f"{listed(unused)}")
    if loading.get("mismatched_keys"):
        problems.append(f"weights with mismatched shapes: {loading['mismatched_keys']}")
    if loading.get("error_msgs"):
        problems.append("; ".join(map(str, loading["error_msgs"])))
    if problems:
        raise ConfigError(f"checkpoint {name!r} does not fit {type(model).__name__}: " + "; ".join(problems)
                          + ". Name a checkpoint of a BERT-family architecture for this task, or set"
                            " model.pretrained=false to train from a random initialisation on purpose.")
    return {"initialised_head": [k for k in missing if not in_base(k)],
            "discarded": [k for k in unexpected if belongs_to_a_module_the_model_lacks(k)]}


def batches(tensors: dict[str, torch.Tensor], batch_size: int, generator: torch.Generator | None,
            device: torch.device, trim_padding: bool = False):
    """Yield dict batches (shuffled with `generator`, full batches only when shuffling); with trim_padding,
    cut each batch to its longest sequence (pad-to-longest, as Raschka's collate), except on XLA: there every new
    length is a new graph to compile, so batches keep the fixed model.data.max_length (the masked positions add
    exact zeros)."""
    n = len(next(iter(tensors.values())))
    order = torch.randperm(n, generator=generator) if generator is not None else torch.arange(n)
    stop = n - n % batch_size if generator is not None else n
    for start in range(0, stop, batch_size):
        idx = order[start:start + batch_size]
        batch = {k: v[idx] for k, v in tensors.items()}
        if trim_padding and device.type != "xla":
            length = int(batch["attention_mask"].sum(1).max())
            batch = {k: (v[:, :length] if v.dim() == 2 else v) for k, v in batch.items()}
        yield {k: v.to(device) for k, v in batch.items()}


def full_length_batch(template: dict, batch_size: int, seq_len: int, vocab: int) -> dict:
    """A batch shaped like `template` (a text task's), every sequence at full length: random token ids, all-ones
    masks, the template's targets (make bench's native rows, and the speed model's traces of text models: the
    cost of a batch padded to its longest sequence, which most batches of long documents are)."""
    def fill(key, value):
        if value.dim() == 1:
            return value[:1].repeat(batch_size)
        if key == "input_ids":
            return torch.randint(0, vocab, (batch_size, seq_len), device=value.device)
        return torch.full((batch_size, seq_len), int(key == "attention_mask"), dtype=value.dtype, device=value.device)

    return {key: fill(key, value) for key, value in template.items()}
