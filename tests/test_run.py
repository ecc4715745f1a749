"""End to end: a few steps of every format x loss-scaling cell, and the record they write."""

import json
from pathlib import Path

import pytest

import bench
from bench.running.record import RECORD_KEYS, read_record
from bench.running.run import run_cell
from bench.speed.model import fingerprint

CELLS = [(f, m, s) for f, modes in [("fp32", ["true"]), ("tf32", ["true"]), ("fp16", ["mixed", "true"]),
                                    ("bf16", ["mixed", "true"]), ("fp8", ["mixed"])]
         for m in modes for s in ("none", "static", "dynamic", "per_tensor", "unit")]


@pytest.mark.parametrize("fmt,mode,scaling", CELLS)
def test_every_cell_writes_a_complete_record(make_cfg, tmp_path, fmt, mode, scaling):
    cfg = make_cfg(f"format={fmt}", f"format.mode={mode}", f"scaling={scaling}", "train.max_steps=4",
                   "train.log_every=2", "device=cpu")
    record = run_cell(cfg)
    path = Path(tmp_path) / cfg.cell / "result.json"
    assert read_record(path) == json.loads(path.read_text())
    assert set(RECORD_KEYS) <= set(record) and record["status"] == "ok", record.get("traceback")
    assert record["config"]["format"]["name"] == fmt and record["config"]["scaling"]["name"] == scaling
    env = record["env"]
    for key in ("device_name", "torch_version", "git_commit", "hostname"):
        assert key in env
    assert env["version"] == bench.__version__
    assert env["precision"]["backend"] in ("native", "emulated") and env["precision"]["backend_reason"]
    assert env["precision"]["fp32_precision_flags"]["cuda_matmul"] == ("tf32" if fmt == "tf32" else "ieee")
    metrics = record["metrics"]
    # an accuracy is a count of the 360 test digits (20% of sklearn's 1,797, stratified) that came out right
    assert metrics["test_examples"] == 360 and metrics["test_accuracy"] * 360 == pytest.approx(
        round(metrics["test_accuracy"] * 360), abs=1e-9)
    assert metrics["evaluated_in"] == env["precision"]["label"]  # evaluated as it trained (train.eval_precision)
    assert record["timing"]["steps"] == 4 and record["timing"]["train_s"] > 0
    assert record["timing"]["trace_s"] > 0 and record["timing"]["traced_on"] == "meta"
    h100 = record["predicted"]["H100"]  # the speed model on the step this cell traced (bench/speed/model.py)
    assert set(record["predicted"]) == {"V100", "A100", "H100", "H200", "B200"}
    assert record["predicted_by"] == fingerprint()  # the speed model that made them: a later one recomputes
    assert h100["compiled"]["step_s"] > 0 and h100["eager"]["step_s"] >= h100["compiled"]["step_s"] \
        if "compiled" in h100 else h100["no_native_path"]
    assert record["timing"]["step_median_s"] > 0 and record["timing"]["samples_per_s"] > 0
    assert record["memory"]["peak_bytes"] > 0 and "resident" in record["memory"]["measures"]
    numerics = record["numerics"]
    expected_scale = {"static": 2048.0, "dynamic": 65536.0}.get(scaling, 1.0)
    assert numerics["final_loss_scale"] == expected_scale and numerics["skipped_steps"] == 0
    assert numerics["loss_scale"]["history"][0] == [0, expected_scale]
    logged = [json.loads(line) for line in (path.parent / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in logged if "loss" in r]  # the log steps'; the rest are the quality curve's evaluations
    assert [r["step"] for r in rows] == [0, 2]
    curve = [r for r in logged if "loss" not in r]  # LeNet validates after each epoch: here one, of 4 steps
    assert [(r["step"], r["epoch"]) for r in curve] == [(4, 0)] and 0 <= curve[0]["val_accuracy"] <= 1
    assert metrics["curve"] == {"metric": "val_accuracy", "points": [[4, curve[0]["val_accuracy"]]]}  # as evaluated
    learning = numerics["learning"]  # what bench.running.learning's rule reads: its curve's early and final loss
    assert learning["steps"] == 4 and learning["final_loss"] == rows[-1]["loss"] > 0
    assert metrics["final_train_loss"] > 0 and "stalled" not in numerics  # a sweep, which knows the siblings, judges
    if env["precision"]["backend"] == "emulated":
        assert numerics["quantisation"]["weights"]["values_sampled"] > 0
        assert set(rows[0]["quantisation"]) == {"weights", "activations", "gradients"}


def test_the_recorded_test_accuracy_is_the_trained_weights_accuracy_on_the_test_digits(make_cfg, tmp_path):
    """An FP32 cell's test accuracy, recomputed by the test from the weights it kept (train.keep_checkpoint) on the
    same 360 test digits, with a LeNet-5 and a forward pass of its own."""
    import torch
    from torch import nn

    from bench.tasks.lenet import load_digits

    cfg = make_cfg("format=fp32", "train.max_steps=150", "train.keep_checkpoint=true", "device=cpu")
    record = run_cell(cfg)
    weights = torch.load(Path(tmp_path) / cfg.cell / "checkpoint.pt", weights_only=False)["model"]
    model = nn.Sequential(nn.Conv2d(1, 6, 5), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(6, 16, 5), nn.ReLU(),
                          nn.MaxPool2d(2), nn.Flatten(), nn.Linear(400, 120), nn.ReLU(), nn.Linear(120, 84), nn.ReLU(),
                          nn.Linear(84, 10))
    model.load_state_dict(weights)
    _, _, x_test, y_test = load_digits(0.2)
    with torch.no_grad():
        correct = int((model(x_test).argmax(1) == y_test).sum())
    assert record["metrics"]["test_accuracy"] == correct / len(y_test) and len(y_test) == 360
    assert 0.5 < correct / len(y_test) < 1.0  # 150 steps learn something, not everything


def test_nan_loss_gives_status_diverged_not_a_crash(make_cfg, tmp_path):
    cfg = make_cfg("model.optimizer.lr=1e8", "train.max_steps=50")  # forced blow-up
    run_cell(cfg)
    record = read_record(Path(tmp_path) / cfg.cell / "result.json")
    assert record["status"] == "diverged"
    step = record["numerics"]["diverged_at_step"]
    assert 0 < step < 50 and "non-finite loss" in record["reason"] and f"at step {step}" in record["reason"]
    assert record["metrics"]["final_train_loss"] in ("nan", "inf")


def test_a_failure_is_recorded_with_its_reason(make_cfg, monkeypatch):
    def broken(*_):
        raise RuntimeError("dataset exploded")

    monkeypatch.setattr("bench.running.run.build_task", broken)
    record = run_cell(make_cfg("train.max_steps=2"))
    assert record["status"] == "failed" and "dataset exploded" in record["reason"]
    assert "Traceback" in record["traceback"]


def test_fp32_digits_default_reaches_97_percent(make_cfg):
    record = run_cell(make_cfg())
    assert record["metrics"]["test_accuracy"] >= 0.97


def test_hub_mnist_loader_converts_the_hub_schema(make_cfg, monkeypatch, hub_answers):
    """data.source=hub goes through datasets.load_dataset by name; here a stand-in returns MNIST's schema."""
    import datasets
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)

    def split(n):
        return datasets.Dataset.from_dict({
            "image": [Image.fromarray(rng.integers(0, 255, (28, 28), dtype=np.uint8)) for _ in range(n)],
            "label": [int(i % 10) for i in range(n)]})

    asked = []
    monkeypatch.setattr(datasets, "load_dataset", lambda name: asked.append(name) or
                        datasets.DatasetDict({"train": split(64), "test": split(20)}))
    record = run_cell(make_cfg("model.data.source=hub", "train.max_steps=2"))
    assert asked == ["ylecun/mnist"] and record["status"] == "ok", record.get("traceback")
    assert record["metrics"]["test_examples"] == 20


def test_an_unreachable_wandb_never_fails_a_run(make_cfg, monkeypatch):
    def unreachable(*args, **kwargs):
        raise ConnectionError("no route to the W&B server")

    monkeypatch.setattr("bench.running.logger.WandbLogger", unreachable)
    assert run_cell(make_cfg("logger=wandb", "train.max_steps=2"))["status"] == "ok"


def test_a_logger_failing_mid_run_is_switched_off(make_cfg, monkeypatch):
    calls = []

    class Flaky:
        def __init__(self, *args, **kwargs):
            pass

        def log(self, row):
            calls.append(row["step"])
            raise TimeoutError("W&B stopped answering")

        def finish(self, record):
            calls.append("finish")

    monkeypatch.setattr("bench.running.logger.WandbLogger", Flaky)
    record = run_cell(make_cfg("logger=wandb", "train.max_steps=25"))
    assert record["status"] == "ok" and calls == [0]  # the first failure turns the logger off


def test_an_interrupted_run_leaves_no_record_so_it_resumes(make_cfg, tmp_path, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("bench.running.run.train", interrupted)
    cfg = make_cfg("train.max_steps=2")
    with pytest.raises(KeyboardInterrupt):
        run_cell(cfg)
    assert not (Path(tmp_path) / cfg.cell / "result.json").exists()


def test_threads_are_set_part_of_the_identity_and_the_timing_conditions_recorded(make_cfg, tmp_path):
    import torch
    from omegaconf import OmegaConf

    from bench.running.identity import run_id

    records = {}
    for threads in (1, 2):
        cfg = make_cfg(f"threads={threads}", "train.max_steps=3", f"results_dir={tmp_path}/t{threads}")
        run_cell(cfg)
        records[threads] = (json.loads((Path(cfg.results_dir) / cfg.cell / "result.json").read_text()),
                            run_id(OmegaConf.to_container(cfg, resolve=True)))
    for threads, (record, _) in records.items():
        conditions = record["timing"]["conditions"]
        assert conditions["threads"] == threads and conditions["cores"] >= 1
        assert isinstance(conditions["disturbed"], bool) and conditions["other_processes_cores"] >= 0
    assert records[1][1] != records[2][1]  # the thread count changes reduction order: another run
    torch.set_num_threads(1)


def test_a_device_the_cell_cannot_use_fails_at_once_here_and_is_recorded_on_a_compute_node(make_cfg, tmp_path,
                                                                                          monkeypatch):
    """device=cuda on a machine without a GPU: a config error where the user typed it; in a SLURM job, where the
    login node could not know what the node has, a failed record naming the reason."""
    from bench.running.run import DeviceError

    cfg = make_cfg("device=cuda", "train.max_steps=2")
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    with pytest.raises(DeviceError, match="no CUDA device is visible"):
        run_cell(cfg)
    assert not list(Path(tmp_path).rglob("result.json"))
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    record = run_cell(cfg)
    assert record["status"] == "failed" and "no CUDA device is visible" in record["reason"]
    assert read_record(Path(tmp_path) / cfg.cell / "result.json")["status"] == "failed"


@pytest.mark.parametrize("umask,mode", [(0o022, 0o644), (0o002, 0o664)])
def test_records_get_the_permissions_the_umask_gives_new_files(tmp_path, umask, mode):
    """A shared results folder: the team reads each other's records (mkstemp alone would make them 0600)."""
    import os
    import stat

    from bench.running.record import write_json_atomic

    old = os.umask(umask)
    try:
        write_json_atomic(tmp_path / "result.json", {"status": "ok"})
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "result.json").stat().st_mode) == mode


def test_flops_per_linear_are_its_three_gemms_counted_by_hand(make_cfg):
    """DistilBERT's q_lin, k_lin, v_lin and out_lin are 64 x 64 Linears on the same tokens: the traced step
    (bench/speed/trace.py) charges each 2·tokens·64·64 FLOPs forward and as much for each gradient GEMM, to that
    module alone (FlopCounterMode's backward attribution once gave v_lin the q_lin and k_lin gradients)."""
    from bench.running.run import build_cell, preflight

    cfg = make_cfg("model=distilbert_tiny", "model.batch_size=12")
    cell = build_cell(cfg, preflight(cfg)[1])
    tokens = next(iter(cell.task.train_batches(0)))["input_ids"].numel()
    root = "distilbert.transformer.layer.0.attention"
    for name in ("q_lin", "k_lin", "v_lin", "out_lin"):
        gemms = [o for o in cell.trace.ops if o.module == f"{root}.{name}" and o.kind == "gemm"]
        assert sorted(o.role for o in gemms) == ["grad_input", "grad_weight", "output"]
        assert sum(o.flops for o in gemms) == 3 * 2 * tokens * 64 * 64
    linears = sum(o.flops for o in cell.trace.ops if o.module_type == "Linear")
    assert linears < cell.trace.flops("forward") + cell.trace.flops("backward")


def test_a_record_made_in_another_checkout_is_the_same_run_for_a_resumed_sweep_and_the_tables(make_cfg):
    """Configs hold the shipped vocabulary and fixtures as absolute paths of the checkout. A sweep resumed from a
    re-clone refused every text-model cell ('holds a record of a different configuration'), and the tables put its
    old records in another design than the new ones, so a new cell had no FP32 to pair with."""
    import os

    from bench.data import DATA_DIR
    from bench.reporting.aggregate import to_frame
    from bench.running.identity import config_hash

    fp32 = make_cfg("model=bert_tiny", "train.max_steps=2")
    assert run_cell(fp32)["status"] == "ok"
    path = Path(fp32.results_dir) / fp32.cell / "result.json"
    elsewhere = json.loads(path.read_text().replace(str(DATA_DIR), f"{os.sep}elsewhere{os.sep}bench{os.sep}data"))
    assert elsewhere["config"]["model"]["vocab"] == "/elsewhere/bench/data/vocab.txt"
    elsewhere["run_id"] = config_hash(elsewhere["config"])  # as the other checkout's code stored it
    path.write_text(json.dumps(elsewhere))
    assert run_cell(fp32)["config"]["model"]["vocab"].startswith("/elsewhere")  # resumed: the record as it was
    fp8 = make_cfg("model=bert_tiny", "train.max_steps=2", "format=fp8", "scaling=per_tensor")
    assert run_cell(fp8)["status"] == "ok"
    frame = to_frame([read_record(Path(c.results_dir) / c.cell / "result.json") for c in (fp32, fp8)])
    assert frame["design_id"].nunique() == 1  # one design: the FP8 cell pairs with this FP32


def test_a_record_made_before_an_option_with_a_null_default_existed_is_the_same_run(make_cfg):
    """format.gradients came with a null default; a record from before it lacks the key. Its cell resumes and the
    tables pair it with new runs, instead of the whole results directory refusing to resume."""
    from bench.reporting.aggregate import to_frame
    from bench.running.identity import config_hash

    fp32 = make_cfg("model=lenet", "train.max_steps=2")
    assert run_cell(fp32)["status"] == "ok"
    path = Path(fp32.results_dir) / fp32.cell / "result.json"
    before = json.loads(path.read_text())
    assert before["config"]["format"].pop("gradients", "absent") is None
    before["run_id"] = config_hash(before["config"])
    path.write_text(json.dumps(before))
    assert "gradients" not in run_cell(fp32)["config"]["format"]  # resumed: the record as it was
    fp8 = make_cfg("model=lenet", "train.max_steps=2", "format=fp8")
    assert run_cell(fp8)["status"] == "ok"
    frame = to_frame([read_record(Path(c.results_dir) / c.cell / "result.json") for c in (fp32, fp8)])
    assert frame["design_id"].nunique() == 1


def test_hub_mnist_loader_keeps_labels_and_standardises_with_the_training_split(monkeypatch):
    """load_mnist against an independent computation on a stand-in hub split: labels as the hub gives them, each
    28x28 image upsampled to 32x32 (a constant image stays that constant), then standardised by the training split's
    mean and std (train: mean 0, std 1; test: by the same two numbers)."""
    import datasets
    import numpy as np
    from PIL import Image

    from bench.tasks.lenet import load_mnist

    levels = {"train": [0, 51, 102, 153, 204, 255, 30, 60], "test": [255, 0, 120]}

    def split(name):
        return datasets.Dataset.from_dict({
            "image": [Image.fromarray(np.full((28, 28), v, dtype=np.uint8)) for v in levels[name]],
            "label": [(7 * i + 3) % 10 for i in range(len(levels[name]))]})

    monkeypatch.setattr(datasets, "load_dataset", lambda name: datasets.DatasetDict(
        {"train": split("train"), "test": split("test")}))
    x_train, y_train, x_test, y_test = load_mnist("ylecun/mnist")
    assert y_train.tolist() == [(7 * i + 3) % 10 for i in range(8)] and y_test.tolist() == [3, 0, 7]
    assert x_train.shape == (8, 1, 32, 32) and x_test.shape == (3, 1, 32, 32)
    pixels = np.repeat(np.asarray(levels["train"], dtype=np.float64) / 255.0, 32 * 32)
    mean, std = pixels.mean(), pixels.std(ddof=1)
    expected_test = (np.asarray(levels["test"], dtype=np.float64) / 255.0 - mean) / std
    assert (x_train.mean().item() == pytest.approx(0.0, abs=1e-6)
            and x_train.std().item() == pytest.approx(1.0, rel=1e-5))
    assert x_test[:, 0, 0, 0].double().numpy() == pytest.approx(expected_test, rel=1e-5)
