"""Pieces of the loop that no other test reached: BERT's linear learning-rate schedule, LeNet's random shifts, and
the progress lines a cell writes to its run.log."""

import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from bench.running.run import run_cell
from bench.running.train import build_schedule


def test_the_linear_schedule_is_transformers_linear_decay_without_warm_up():
    """model.optimizer.schedule=linear (BERT's fine-tuning recipe) against transformers'
    get_linear_schedule_with_warmup(num_warmup_steps=0), step by step, to the end of the run and past it."""
    from transformers import get_linear_schedule_with_warmup

    def optimizer():
        return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=3e-5)

    ours, theirs = optimizer(), optimizer()
    mine = build_schedule(OmegaConf.create({"schedule": "linear", "lr": 3e-5}), ours, total_steps=7)
    reference = get_linear_schedule_with_warmup(theirs, num_warmup_steps=0, num_training_steps=7)
    seen = []
    for _ in range(9):
        assert ours.param_groups[0]["lr"] == pytest.approx(theirs.param_groups[0]["lr"], abs=1e-18)
        seen.append(ours.param_groups[0]["lr"])
        ours.step(), theirs.step(), mine.step(), reference.step()
    assert seen[0] == 3e-5 and seen[7] == seen[8] == 0.0 and seen == sorted(seen, reverse=True)


def test_lenets_random_shift_is_the_padded_image_sliced_at_the_drawn_offset():
    """model.data.augment_shift=2 (the default) gathers each batch's 32x32 window by index tensors (one graph on
    XLA): it must equal the slice [2 + dy, 2 + dx] of the batch padded by 2 with the training set's background, for
    the offsets the batch's generator draws, replayed here from the same seed."""
    from bench.tasks.lenet import lenet_task, load_digits, split_validation

    cfg = OmegaConf.create({"batch_size": 32, "data": {"source": "digits", "test_fraction": 0.2, "val_fraction": 0.1,
                                                        "augment_shift": 2, "name": ""}})
    batches = lenet_task(cfg, torch.device("cpu"), seed=3).train_batches(epoch=1)
    x_train, y_train, _, _ = load_digits(0.2)
    x_train, y_train, _, _ = split_validation(x_train, y_train, 0.1)
    generator = torch.Generator().manual_seed(3 * 100_003 + 1)  # the task's stream: its order, then each offset
    order = torch.randperm(len(y_train), generator=generator)
    shifted = 0
    for b in range(3):
        x, y = next(batches)
        index = order[b * 32:(b + 1) * 32]
        dx, dy = torch.randint(-2, 3, (2,), generator=generator).tolist()
        padded = F.pad(x_train[index], (2, 2, 2, 2), value=float(x_train.min()))
        assert torch.equal(x, padded[..., 2 + dy:34 + dy, 2 + dx:34 + dx]) and torch.equal(y, y_train[index])
        shifted += (dx, dy) != (0, 0)
    assert shifted  # the check saw a window that moved


def test_a_cell_writes_its_progress_to_run_log(make_cfg, tmp_path):
    """run.log: where the cell started, then one line per log step (step/total, loss, scale, steps/s, ETA), with or
    without a terminal; the loss is the one metrics.jsonl holds for that step."""
    import json

    cfg = make_cfg("format=fp16", "scaling=static", "train.max_steps=30", "train.log_every=10")
    run_cell(cfg)
    run_dir = Path(tmp_path) / cfg.cell
    lines = (run_dir / "run.log").read_text().splitlines()
    assert re.fullmatch(r"\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\] start on \S+ \(pid \d+\), from step 0", lines[0])
    progress = [line for line in lines if line.startswith("[progress]")]
    logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    logged = [row for row in logged if "loss" in row]  # the log steps' (the rest: the quality curve's evaluations)
    assert len(progress) == 3 == len(logged)
    for line, row in zip(progress, logged):
        match = re.fullmatch(r"\[progress\] step (\d+)/30 loss (\S+) scale 2048 (\S+) steps/s ETA (\S+)( s)?", line)
        assert match, line
        assert int(match[1]) == row["step"] and float(match[2]) == pytest.approx(row["loss"], rel=1e-3)
    assert progress[0].endswith("? steps/s ETA ?") and not progress[1].endswith("ETA ?")  # a rate needs two lines
