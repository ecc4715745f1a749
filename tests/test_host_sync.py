"""Ordinary training steps never make the host wait for the device (issue #16).

On a CPU nothing waits, so the test counts the calls that would wait on an accelerator: reading a tensor's
value on the host (`item`, `tolist`, `numpy`, `bool`/`float`/`int` of a tensor) and explicit synchronisation.
Each call is charged to the training step that made it, or to the end of an epoch; the data pipeline (host
work before a batch reaches the device) is not counted. Log steps, epoch ends and the end may read; the
steps in between must not. Reads made inside the transformers models are the model's own, not the
harness's (BERT's SDPA mask builder asks `padding_mask.all()` on every forward, to choose a kernel; a bare
loop makes it too): they are counted apart and allowed.
"""

import contextlib
import traceback

import pytest
import torch

import bench.running.device
from bench.running.run import build_cell, preflight
from bench.running.train import train

READS = ("item", "tolist", "numpy", "__bool__", "__float__", "__int__")
LOG_EVERY, STEPS = 10, 25


class SyncCounter:
    def __init__(self):
        self.step, self.steps_started, self.paused, self.by_step = -1, -1, False, {}

    def count(self, what: str) -> None:
        if self.paused:
            return
        in_model = any("/transformers/" in frame.filename for frame in traceback.extract_stack())
        self.by_step.setdefault(self.step, []).append(f"{what} (transformers model)" if in_model else what)


@contextlib.contextmanager
def counting_syncs(monkeypatch, counter: SyncCounter):
    def wrap(original, what):
        def counted(*args, **kwargs):
            counter.count(what)
            return original(*args, **kwargs)
        return counted

    for name in READS:
        monkeypatch.setattr(torch.Tensor, name, wrap(getattr(torch.Tensor, name), f"Tensor.{name}"))
    for module in (torch.cuda, bench.running.device):
        monkeypatch.setattr(module, "synchronize", wrap(module.synchronize, f"{module.__name__}.synchronize"))
    monkeypatch.setattr("bench.running.train.synchronize",
                        wrap(bench.running.device.synchronize, "bench.running.train.synchronize"))
    yield counter


def run_counted(make_cfg, monkeypatch, *overrides) -> tuple[dict, int, list[int]]:
    """({step or epoch end: the sync calls charged to it}, steps trained, the steps during which torch.compile
    compiled: tracing reads values on the host once, which no later step repeats)"""
    cfg = make_cfg(*overrides, f"train.max_steps={STEPS}", f"train.log_every={LOG_EVERY}")
    _, precision = preflight(cfg)
    cell = build_cell(cfg, precision)
    task = cell.task
    counter = SyncCounter()
    batches = task.train_batches

    def charged_batches(epoch):
        stream = batches(epoch)
        while True:
            counter.paused = True  # the data pipeline runs on the host before the step: not counted
            try:
                batch = next(stream)
            except StopIteration:
                counter.step = f"end of epoch {epoch}"  # validation and the epoch's settling read here
                return
            finally:
                counter.paused = False
            counter.steps_started += 1  # the loop takes the next batch only when it starts a step
            counter.step = counter.steps_started
            yield batch

    task.train_batches = charged_batches
    with counting_syncs(monkeypatch, counter):
        outcome = train(task, precision, cell.scaler, cell.optimizer, cell.schedule, cfg.train, precision.device,
                        lambda row: None, count_memory=False)
    assert outcome.steps == min(STEPS, task.steps_per_epoch * cfg.train.epochs) and outcome.diverged_at_step is None
    return counter.by_step, outcome.steps, outcome.compile_steps


CELLS = {
    "lenet-fp32-sgd": ["model=lenet"],
    "lenet-fp32-sgd-compiled": ["model=lenet", "train.compile=true"],
    "lenet-fp16-static": ["model=lenet", "format=fp16", "scaling=static"],
    "lenet-fp16-true-dynamic": ["model=lenet", "format=fp16-true", "scaling=dynamic"],
    "lenet-fp8-per_tensor": ["model=lenet", "format=fp8", "scaling=per_tensor"],
    "lenet-fp8-unit": ["model=lenet", "format=fp8", "scaling=unit"],
    "bert_tiny-fp8-dynamic-adamw": ["model=bert_tiny", "format=fp8", "scaling=dynamic"],
    "bert_tiny-bf16-dynamic": ["model=bert_tiny", "format=bf16", "scaling=dynamic"],
    # AdamW with matrix-only decay, nanoGPT's cosine schedule and gradient clipping after unscaling
    "charlm-fp16-static-clipped": ["model=charlm", "format=fp16", "scaling=static", "model.data.source=local",
                                   "model.data.path={text}", "model.data.sha256=null", "model.arch.layers=1",
                                   "model.arch.embedding=16", "model.arch.block_size=8", "model.batch_size=4"],
}


@pytest.mark.parametrize("cell", CELLS)
def test_ordinary_steps_make_no_host_sync(make_cfg, monkeypatch, tmp_path, cell):
    text = tmp_path / "text.txt"
    text.write_text("to be, or not to be: that is the question.\n" * 200)
    by_step, steps, compiling = run_counted(make_cfg, monkeypatch, *(o.format(text=text) for o in CELLS[cell]))
    harness = {step: made for step, calls in by_step.items()
               if (made := [c for c in calls if not c.endswith("(transformers model)")])}
    ordinary = {step: calls for step, calls in harness.items()
                if isinstance(step, int) and 0 <= step < steps and step % LOG_EVERY and step not in compiling}
    assert compiling == ([0] if "train.compile=true" in CELLS[cell] else [])  # no memory counting here: step 0
    assert ordinary == {}, f"host syncs on ordinary steps: {ordinary}"
    # the counter sees the reads the loop does make: on log steps (losses, scaler flags)
    assert all(harness.get(step) for step in range(0, steps, LOG_EVERY)), harness


def test_a_divergence_noticed_at_the_next_log_step_records_the_step_it_happened_at(make_cfg):
    """The loss goes NaN at step 13; the loop reads losses at log steps (every 10), so it stops after step 20
    and records step 13 and its loss."""
    cfg = make_cfg("model=lenet", "train.max_steps=50", f"train.log_every={LOG_EVERY}")
    _, precision = preflight(cfg)
    cell = build_cell(cfg, precision)
    task, calls = cell.task, []
    compute_loss = task.compute_loss

    def nan_from_step_13(outputs, targets):
        calls.append(None)
        loss = compute_loss(outputs, targets)
        return loss * float("nan") if len(calls) == 14 else loss

    task.compute_loss = nan_from_step_13
    rows = []
    outcome = train(task, precision, cell.scaler, cell.optimizer, cell.schedule, cfg.train, precision.device,
                    rows.append, count_memory=False)
    assert outcome.diverged_at_step == 13 and outcome.steps == 21 and outcome.final_loss != outcome.final_loss
    assert [row["step"] for row in rows] == [0, 10]  # nothing logged for the log step that found it
    assert len(outcome.step_s) == 21


def test_cuda_step_times_come_from_events_read_only_at_collect(monkeypatch):
    """StepTimer on CUDA, with torch.cuda.Event stood in for: events around each step, no wait until collect(),
    which waits once (for the last event) and returns each step's elapsed time in seconds."""
    from bench.running.device import StepTimer

    clock, waits = iter(range(0, 1000, 5)), []

    class Event:
        def __init__(self, enable_timing):
            assert enable_timing
            self.at = None

        def record(self):
            self.at = next(clock)  # milliseconds on the device's timeline

        def synchronize(self):
            waits.append(self.at)

        def elapsed_time(self, end):
            assert waits, "read before the device was waited for"
            return end.at - self.at

    monkeypatch.setattr(torch.cuda, "Event", Event)
    timer = StepTimer(torch.device("cuda"))
    assert timer.method == "cuda_events"
    for _ in range(3):
        timer.start()
        timer.stop()
    assert waits == []
    assert timer.collect() == [0.005, 0.005, 0.005] and waits == [25]
    assert timer.collect() == [] and waits == [25]
