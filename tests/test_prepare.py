"""`make prepare` fetches exactly what the configs name (the hub is replaced by recording stand-ins)."""

import datasets
import transformers

from bench.tools import prepare


def test_prepare_fetches_every_configured_model_and_dataset(monkeypatch, hub_answers):
    fetched = []
    record = lambda kind: (lambda name, *a, **k: fetched.append((kind, name)))
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", record("tokenizer"))
    monkeypatch.setattr(transformers.AutoModelForSequenceClassification, "from_pretrained", record("classifier"))
    monkeypatch.setattr(transformers.AutoModelForQuestionAnswering, "from_pretrained", record("qa"))
    monkeypatch.setattr(datasets, "load_dataset", record("dataset"))
    assert prepare.main() == 0
    assert sorted(fetched) == sorted([
        ("tokenizer", "distilbert-base-uncased"), ("classifier", "distilbert-base-uncased"),
        ("tokenizer", "bert-base-uncased"), ("qa", "bert-base-uncased"),
        ("dataset", "ylecun/mnist"), ("dataset", "stanfordnlp/imdb"), ("dataset", "rajpurkar/squad")])
