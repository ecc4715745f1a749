"""DistilBERT/IMDb and BERT/SQuAD through the same runner, offline: tiny models, shipped fixtures and vocabulary."""

import json
from pathlib import Path

import datasets
import pytest
import torch

from bench.running.config import DATA_DIR
from bench.running.run import run_cell
from bench.tasks.imdb import pooled_split


def _record(cfg, tmp_path):
    run_cell(cfg)
    return json.loads((Path(tmp_path) / cfg.cell / "result.json").read_text())


@pytest.mark.parametrize("model,fmt,scaling", [
    ("distilbert_tiny", "fp8", "per_tensor"), ("distilbert_tiny", "bf16-true", "dynamic"),
    ("distilbert_tiny", "fp16-true", "static"), ("bert_tiny", "fp16", "dynamic"), ("bert_tiny", "fp8", "none"),
    ("bert_tiny", "tf32", "per_tensor"),
])
def test_short_runs_write_complete_records(make_cfg, tmp_path, model, fmt, scaling):
    """Emulated on every machine (on a CPU with AMX-FP16, `auto` runs 16-true natively, where Adam's eps
    underflows in fp16 and the run diverges at step 1, as it should)."""
    record = _record(make_cfg(f"model={model}", f"format={fmt}", f"scaling={scaling}", "train.max_steps=3",
                              "device=cpu", "format.backend=emulated"), tmp_path)
    assert record["status"] == "ok", record.get("traceback")
    metrics = record["metrics"]
    if model == "bert_tiny":
        assert 0 <= metrics["exact_match"] <= 100 and 0 <= metrics["f1"] <= 100 and metrics["dev_examples"] == 40
    else:
        assert 0 <= metrics["test_accuracy"] <= 1 and metrics["per_epoch"][0]["val_accuracy"] is not None


@pytest.mark.parametrize("model, attention", [("distilbert_tiny", "distilbert.transformer.layer.0.attention."
                                               "scaled_attention"),
                                              ("bert_tiny", "bert.encoder.layer.0.attention.self.scaled_attention")])
def test_unit_scaling_from_scratch_scales_the_hub_models_attention(make_cfg, tmp_path, model, attention):
    """transformers computes attention inside its attention modules, through its attention-function registry: from
    scratch, unit scaling points that registry at unit_scaling's attention (bench/numerics/unit.py), so the cell
    trains with every attention op scaled and its record names where."""
    record = _record(make_cfg(f"model={model}", "scaling=unit", "train.max_steps=2", "device=cpu"), tmp_path)
    assert record["status"] == "ok", record.get("traceback")
    assert attention in record["numerics"]["unit_conversion"]["scaled_attention"]


def test_tiny_distilbert_learns_the_fixture_sentiment(make_cfg, tmp_path):
    record = _record(make_cfg("model=distilbert_tiny"), tmp_path)
    assert record["metrics"]["test_accuracy"] >= 0.75  # chance is 0.5
    assert [e["epoch"] for e in record["metrics"]["per_epoch"]] == [0, 1, 2]


def test_imdb_hub_path_pools_labelled_splits_like_raschka(make_cfg, tmp_path, monkeypatch, hub_answers):
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


@pytest.mark.parametrize("model,arch", [("bert_tiny", "bert"), ("distilbert_tiny", "bert"),
                                        ("distilbert_tiny", "distilbert"), ("bert_tiny", "distilbert")])
def test_unit_conversion_of_a_pretrained_checkpoint_keeps_its_function(make_cfg, make_checkpoint, tmp_path, model,
                                                                       arch):
    """A hub-layout checkpoint with non-zero biases and LayerNorm weights != 1, loaded from a local directory
    as from the hub: every layer's output and the task outputs stay within float rounding after conversion."""
    cfg = make_cfg(f"model={model}", "model.pretrained=true", f"model.hub_name={make_checkpoint(arch)}",
                   "scaling=unit", "train.max_steps=2")
    record = _record(cfg, tmp_path)
    conversion = record["numerics"]["unit_conversion"]
    assert conversion["max_rel_output_diff"] < 1e-5, conversion
    assert record["status"] == "ok", record.get("reason")
    assert conversion["preserve_function"] is True and conversion["layers_compared"] > 20
    assert conversion["max_rel_layer_diff"] < 1e-5, conversion


def test_a_conversion_that_changes_the_function_fails_the_cell_naming_the_layer(make_cfg, make_checkpoint, tmp_path,
                                                                                 monkeypatch):
    """The conversion as it was (bias kept while the output is multiplied by alpha) must not be recorded ok."""
    import bench.numerics.unit

    def carry_weight_only(new, old, output_scale):
        with torch.no_grad():
            new.weight.copy_(old.weight / output_scale)
            new.bias.copy_(old.bias)
        return new

    monkeypatch.setattr(bench.numerics.unit, "_carry_weights", carry_weight_only)
    cfg = make_cfg("model=bert_tiny", "model.pretrained=true", f"model.hub_name={make_checkpoint('bert')}",
                   "scaling=unit", "train.max_steps=2")
    record = _record(cfg, tmp_path)
    assert record["status"] == "failed" and "ConversionError" in record["reason"]
    assert "bert.encoder.layer.0.attention.self.query" in record["reason"]
    assert "conversion_tolerance" in record["reason"]
    conversion = record["numerics"]["unit_conversion"]
    assert conversion["max_rel_output_diff"] > 1e-2
    assert conversion["first_layer_over_tolerance"] == "bert.encoder.layer.0.attention.self.query"


@pytest.mark.parametrize("model,arch,architecture,head", [
    ("distilbert_tiny", "distilbert", "DistilBertForSequenceClassification",
     ["classifier.bias", "classifier.weight", "pre_classifier.bias", "pre_classifier.weight"]),
    ("distilbert_tiny", "bert", "BertForSequenceClassification", ["classifier.bias", "classifier.weight"]),
    ("bert_tiny", "bert", "BertForQuestionAnswering", ["qa_outputs.bias", "qa_outputs.weight"]),
    ("bert_tiny", "distilbert", "DistilBertForQuestionAnswering", ["qa_outputs.bias", "qa_outputs.weight"]),
])
def test_any_bert_family_checkpoint_loads_into_each_task_and_the_record_names_it(make_cfg, make_checkpoint, tmp_path,
                                                                                 model, arch, architecture, head):
    checkpoint = make_checkpoint(arch)
    record = _record(make_cfg(f"model={model}", "model.pretrained=true", f"model.hub_name={checkpoint}",
                              "train.max_steps=2"), tmp_path)
    assert record["status"] == "ok", record.get("reason")
    source = record["model_source"]
    assert source["pretrained"] is True and source["checkpoint"] == str(checkpoint)
    assert source["path"] == str(checkpoint.resolve()) and source["architecture"] == architecture
    assert source["initialised_head"] == head
    assert source["discarded"] and all(k.startswith(("cls.", "vocab_", "bert.pooler.")) for k in source["discarded"])


def test_the_loaded_weights_are_the_checkpoints(make_cfg, make_checkpoint):
    """Not only the names: the encoder's tensors equal the checkpoint's, bit for bit."""
    from transformers import BertForPreTraining

    from bench.tasks.squad import squad_task

    checkpoint = make_checkpoint("bert")
    cfg = make_cfg("model=bert_tiny", "model.pretrained=true", f"model.hub_name={checkpoint}")
    task = squad_task(cfg.model, torch.device("cpu"), 0)
    saved = BertForPreTraining.from_pretrained(checkpoint).bert.state_dict()
    loaded = task.model.bert.state_dict()
    assert set(loaded) <= set(saved)
    assert all(torch.equal(loaded[k], saved[k]) for k in loaded)


def test_a_checkpoint_of_another_architecture_is_a_config_error_naming_the_weights(make_cfg, make_checkpoint,
                                                                                   tmp_path):
    """DistilBERT weights under a BERT config.json (a mislabelled or converted-wrong checkpoint): no record."""
    import shutil

    from bench.running.config import ConfigError

    bert, distil = make_checkpoint("bert"), make_checkpoint("distilbert")
    shutil.copy(distil / "model.safetensors", bert / "model.safetensors")
    cfg = make_cfg("model=distilbert_tiny", "model.pretrained=true", f"model.hub_name={bert}", "train.max_steps=2")
    with pytest.raises(ConfigError, match=r"encoder are missing from the checkpoint.*bert\.embeddings"):
        run_cell(cfg)
    assert not (Path(tmp_path) / cfg.cell / "result.json").exists()


def test_a_checkpoint_with_more_layers_than_its_config_is_a_config_error(make_cfg, make_checkpoint, tmp_path):
    """Weights the model has a module for but did not load (here a third layer) are refused too."""
    import json as json_

    from bench.running.config import ConfigError

    checkpoint = make_checkpoint("bert", num_hidden_layers=3)  # fixture's size, one layer more
    config = json_.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json_.dumps(config | {"num_hidden_layers": 2}))
    cfg = make_cfg("model=bert_tiny", "model.pretrained=true", f"model.hub_name={checkpoint}", "train.max_steps=2")
    with pytest.raises(ConfigError, match=r"not loaded into modules the model has: bert\.encoder\.layer\.2"):
        run_cell(cfg)
