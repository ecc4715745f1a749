"""DistilBERT/IMDb and BERT/SQuAD through the same runner, offline: tiny models, shipped fixtures and vocabulary."""

import json
from pathlib import Path

import datasets
import pytest
import torch

from bench.config import DATA_DIR
from bench.run import run_cell
from bench.tasks.imdb import pooled_split


def _record(cfg, tmp_path):
    run_cell(cfg)
    return json.loads((Path(tmp_path) / cfg.cell / "result.json").read_text())


@pytest.mark.parametrize("model,fmt,scaling", [
    ("distilbert_tiny", "fp8", "per_tensor"), ("distilbert_tiny", "bf16-true", "unit"),
    ("distilbert_tiny", "fp16-true", "static"), ("bert_tiny", "fp16", "dynamic"), ("bert_tiny", "fp8", "unit"),
    ("bert_tiny", "tf32", "per_tensor"),
])
def test_short_runs_write_complete_records(make_cfg, tmp_path, model, fmt, scaling):
    record = _record(make_cfg(f"model={model}", f"format={fmt}", f"scaling={scaling}", "train.max_steps=3",
                              "device=cpu"), tmp_path)
    assert record["status"] == "ok", record.get("traceback")
    metrics = record["metrics"]
    if model == "bert_tiny":
        assert 0 <= metrics["exact_match"] <= 100 and 0 <= metrics["f1"] <= 100 and metrics["dev_examples"] == 40
    else:
        assert 0 <= metrics["test_accuracy"] <= 1 and metrics["per_epoch"][0]["val_accuracy"] is not None
    if scaling == "unit":
        assert record["numerics"]["unit_conversion"]["preserve_function"] is False


def test_tiny_distilbert_learns_the_fixture_sentiment(make_cfg, tmp_path):
    record = _record(make_cfg("model=distilbert_tiny"), tmp_path)
    assert record["metrics"]["test_accuracy"] >= 0.75  # chance is 0.5
    assert [e["epoch"] for e in record["metrics"]["per_epoch"]] == [0, 1, 2]


def test_imdb_hub_path_pools_labelled_splits_like_raschka(make_cfg, tmp_path, monkeypatch):
    rows = datasets.load_dataset("json", data_files=str(DATA_DIR / "fixtures/imdb_tiny.jsonl"))["train"]
    hub = datasets.DatasetDict({"train": rows.select(range(200)), "test": rows.select(range(200, 400)),
                                "unsupervised": rows.select(range(50))})
    asked = []
    monkeypatch.setattr(datasets, "load_dataset", lambda name: asked.append(name) or hub)
    record = _record(make_cfg("model=distilbert_tiny", "model.data.source=hub", "train.max_steps=2"), tmp_path)
    assert asked == ["stanfordnlp/imdb"] and record["status"] == "ok", record.get("traceback")
    assert record["metrics"]["test_examples"] == 80  # 20% of the 400 labelled reviews; unsupervised left out
    train, val, test = pooled_split(hub, [0.7, 0.1, 0.2], seed=123)
    assert (len(train), len(val), len(test)) == (280, 40, 80)
    again = pooled_split(hub, [0.7, 0.1, 0.2], seed=123)[2]
    assert list(again["text"]) == list(test["text"])  # the split is fixed by its seed


def test_unit_conversion_of_a_pretrained_checkpoint_keeps_its_function(make_cfg, tmp_path):
    """A checkpoint saved locally stands in for the hub: from_pretrained reads the directory."""
    from transformers import BertConfig, BertForQuestionAnswering, BertTokenizer

    checkpoint = tmp_path / "checkpoint"
    tokenizer = BertTokenizer(vocab=str(DATA_DIR / "vocab.txt"))
    torch.manual_seed(0)
    BertForQuestionAnswering(BertConfig(vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2,
                                        num_attention_heads=2, intermediate_size=128)).save_pretrained(checkpoint)
    tokenizer.save_pretrained(checkpoint)
    cfg = make_cfg("model=bert_tiny", "model.pretrained=true", f"model.hub_name={checkpoint}", "scaling=unit",
                   "train.max_steps=2")
    conversion = _record(cfg, tmp_path)["numerics"]["unit_conversion"]
    assert conversion["preserve_function"] is True
    assert conversion["max_rel_output_diff"] < 1e-5, conversion
