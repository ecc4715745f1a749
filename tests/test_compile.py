"""train.compile: a compiled cell trains as the eager one does (to a documented tolerance), keeps its checkpoints'
keys, resumes bit for bit, keeps compile time out of its step times, and says what it compiled."""

import json
from pathlib import Path

import pytest
import torch

from bench.running.compile import compile_wanted
from bench.running.config import ConfigError, check
from bench.running.identity import run_id
from bench.running.run import run_cell
from tests.conftest import interrupted_at_checkpoint_then_resumed

# inductor fuses the forward and reorders its reductions, and computes a chain of 16-bit pointwise ops in FP32
# without rounding between them: the same cell's losses agree to these relative errors over 30 steps, not bit for
# bit (measured on LeNet: FP32 1e-7, bf16-mixed 1.2e-5, emulated FP8 within 1e-5 by step 29, emulated FP16 1.1e-6
# over 20 steps (4.7e-5 while inductor dropped its roundings: formats._rounds_by_cast); MXFP8 1.1e-4 where
# its convolutions, BF16 under autocast, are emulated (a CPU without BF16 units, bench/numerics/autocast.py): their
# rounding to BF16 is then a cast inductor fuses into the ReLU after it)
LOSS_TOLERANCE = {"fp32": 1e-5, "bf16": 1e-3}
SIXTEEN_BIT_CELLS = ("format=bf16", "format=mxfp8")
STEPS = ["train.max_steps=30", "train.log_every=1"]


def _losses(record_dir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (record_dir / "metrics.jsonl").read_text().splitlines()
            if "loss" in json.loads(line)]


def _trained(make_cfg, *overrides):
    cfg = make_cfg(*STEPS, *overrides)
    record = run_cell(cfg)
    assert record["status"] == "ok", record["reason"]
    return record, _losses(Path(cfg.results_dir) / cfg.cell)


@pytest.mark.parametrize("cell", [
    ["model=lenet"],
    pytest.param(["model=lenet", "format=bf16", "scaling=dynamic"], marks=pytest.mark.slow),
    pytest.param(["model=lenet", "format=fp8"], marks=pytest.mark.slow),
    # FP16 is emulated on a CPU: its roundings in the compiled step keep their bits (they had vanished, 4.7e-5 apart)
    pytest.param(["model=lenet", "format=fp16", "scaling=static"], marks=pytest.mark.slow),
    pytest.param(["model=lenet", "format=mxfp8"], marks=pytest.mark.slow),
], ids=lambda cell: " ".join(cell[1:]) or "fp32")
def test_a_compiled_cell_trains_as_the_eager_one(make_cfg, cell):
    compiled, compiled_losses = _trained(make_cfg, *cell, "train.compile=true", "experiment_name=compiled")
    eager, eager_losses = _trained(make_cfg, *cell, "train.compile=false", "experiment_name=eager")
    assert len(compiled_losses) == len(eager_losses) == 30
    tolerance = LOSS_TOLERANCE["bf16" if set(SIXTEEN_BIT_CELLS) & set(cell) else "fp32"]
    assert all(abs(c - e) <= tolerance * abs(e) for c, e in zip(compiled_losses, eager_losses)), \
        [abs(c - e) / abs(e) for c, e in zip(compiled_losses, eager_losses)]
    described = compiled["env"]["compile"]
    assert described["compiled"] and described["backend"] == "inductor" and described["eager_because"] is None
    # what falls back to eager past dynamo's recompile limit is the telemetry of sampled steps (every step here):
    # its observers, and the rounding sites' code resumed after each observation (one frame per site: emulation.py's
    # casts, whose tensors' ranks differ from site to site, and precision.py's), never the model or the loss
    assert all(any(f"bench/numerics/{home}.py" in where for home in ("telemetry", "emulation", "precision"))
               for where in described["recompile_limit_hit_by"]), described["recompile_limit_hit_by"]
    assert eager["env"]["compile"] == {"requested": False, "compiled": False, "per_block": False, "graphs": 0,
                                      "eager_because": "train.compile=False on cpu",
                                      "backend": None, "mode": None, "graph_breaks": 0, "graph_break_reasons": {},
                                      "recompile_limit_hit_by": []}
    # step 0 counts memory eagerly; step 1 compiles (a block format's step 2 recompiles once): reported apart
    assert compiled["timing"]["compile"]["steps"][0] == 1 and max(compiled["timing"]["compile"]["steps"]) <= 2
    assert compiled["timing"]["compile"]["seconds"] > compiled["timing"]["step_median_s"] * 10
    assert compiled["timing"]["train_s_without_compile"] < compiled["timing"]["train_s"]
    assert eager["timing"]["compile"] == {"steps": [], "seconds": 0, "in_validation_s": 0.0}
    assert compiled["memory"]["step"] == eager["memory"]["step"]  # counted on the eager first step either way


def test_a_function_past_dynamos_recompile_limit_is_named_in_the_record():
    """The record's env.compile.recompile_limit_hit_by reads dynamo's warning; the compiled-cell test's check of it
    would pass on an empty list if that warning's wording changed. Here a function recompiles past a limit of 2 (a
    global it guards on changes every call) and must be named."""
    import torch

    from bench.running.compile import CompiledStep

    def forward_and_loss(model, batch):
        return model(batch)

    with torch._dynamo.config.patch(recompile_limit=2):
        step = CompiledStep(True, torch.device("cpu"), forward_and_loss)
        for k in range(4):
            step(lambda x, k=k: x.sum() * k, torch.ones(3))  # a new closure constant each call: a recompile each
        hits = step.describe()["recompile_limit_hit_by"]
    assert len(hits) == 1 and hits[0].startswith("'forward_and_loss' (") and "test_compile.py" in hits[0]


def test_under_auto_a_path_that_cannot_compile_runs_eagerly_and_says_why(make_cfg):
    """Emulated FP8 with delayed per-tensor scales keeps its amax state across the autograd.Function of each emulated
    layer: dynamo breaks the graph there and runs the layer eagerly (the step's losses are the eager step's). A step
    whose compile fails outright runs eagerly from then on under auto, with the reason; under true it raises."""
    from bench.running.compile import CompiledStep
    from bench.running.run import build_cell, device_preflight

    cfg = make_cfg("format=fp8", "scaling=per_tensor", "train.max_steps=5")
    losses = {}
    for setting in (False, "auto"):
        torch.manual_seed(0)
        precision = device_preflight(cfg)[1]
        task = build_cell(cfg, precision).task
        step = CompiledStep.for_task(setting, torch.device("cuda"), task, precision)
        batch = next(iter(task.train_batches(0)))
        with precision.autocast():
            losses[setting] = step(task.model, batch)
    described = step.describe()
    assert described["compiled"] and described["graph_breaks"] > 0, described
    assert "Unsafe side effect" in " ".join(described["graph_break_reasons"]), described
    assert losses["auto"].item() == pytest.approx(losses[False].item(), rel=1e-6)

    def refused(model, batch):
        raise RuntimeError("dynamo refused this step")

    step._compiled = refused
    with precision.autocast():
        assert torch.isfinite(step(task.model, batch))
    assert step.describe()["eager_because"] == "RuntimeError: dynamo refused this step"
    strict = CompiledStep.for_task(True, torch.device("cpu"), task, precision)
    strict._compiled = refused
    with pytest.raises(RuntimeError, match="dynamo refused"):
        with precision.autocast():
            strict(task.model, batch)


@pytest.mark.slow
def test_a_compiled_cell_checkpoints_plain_keys_and_resumes_bit_for_bit(make_cfg, monkeypatch):
    """Interrupted after its checkpoint at step 20 and resumed (compiling again), a compiled cell ends with the
    weights of the same cell run straight through."""
    overrides = ["train.compile=true", "train.checkpoint_every=20", "train.keep_checkpoint=true"]
    straight = make_cfg(*STEPS, *overrides)
    assert run_cell(straight)["status"] == "ok"
    reference = torch.load(Path(straight.results_dir) / straight.cell / "checkpoint.pt", weights_only=False)
    assert not any(key.startswith("_orig_mod") for key in reference["model"])

    interrupted = make_cfg(*STEPS, *overrides, "experiment_name=interrupted")
    record = interrupted_at_checkpoint_then_resumed(interrupted, monkeypatch, 20)
    assert record["status"] == "ok" and record["resumed_from"] == {"checkpoint": "checkpoint.pt", "step": 20}
    resumed = torch.load(Path(interrupted.results_dir) / interrupted.cell / "checkpoint.pt", weights_only=False)
    assert all(torch.equal(reference["model"][k], resumed["model"][k]) for k in reference["model"])
    assert record["timing"]["compile"]["steps"] == [1, 20]  # compiled again after the resume


def test_compile_is_a_documented_choice_and_auto_is_null(make_cfg):
    with pytest.raises(ConfigError, match="train.compile='yes' is not a choice; valid: null, auto, true, false"):
        check(make_cfg("train.compile=yes"))
    from omegaconf import OmegaConf

    ids = {value: run_id(OmegaConf.to_container(make_cfg(f"train.compile={value}"), resolve=True))
           for value in ("null", "auto", "true", "false")}
    assert ids["null"] == ids["auto"] and len(set(ids.values())) == 3
    assert compile_wanted(None, torch.device("cuda")) and compile_wanted("auto", torch.device("cuda"))
    assert not compile_wanted(None, torch.device("cpu")) and compile_wanted(True, torch.device("cpu"))


def test_under_auto_a_backward_that_fails_to_compile_reruns_the_step_eagerly(make_cfg, monkeypatch):
    """AOTAutograd compiles the backward at the first backward: a failure there must not fail the cell under auto.
    Stand-in: the compiled forward's loss carries a backward that raises, as a failed backward compile does."""
    import bench.running.compile as compile_module

    class BrokenBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            raise RuntimeError("backward compile failed (stand-in)")

    def fake_compile(fn, **kwargs):
        return lambda model, batch: BrokenBackward.apply(fn(model, batch))

    eager, _ = _trained(make_cfg, "train.compile=false", "experiment_name=eager")
    monkeypatch.setattr(compile_module, "compile_wanted", lambda setting, device: True)  # auto as on a GPU
    monkeypatch.setattr(compile_module.torch, "compile", fake_compile)
    graphs = iter(range(100))
    monkeypatch.setattr(compile_module, "dynamo_graphs", lambda: next(graphs))  # every call "compiled"
    record, _ = _trained(make_cfg, "train.compile=auto", "experiment_name=auto")
    assert record["env"]["compile"]["eager_because"] == "RuntimeError: backward compile failed (stand-in)"
    assert not record["env"]["compile"]["compiled"]
    assert record["metrics"] == eager["metrics"]  # the failed step ran again eagerly: nothing of it was kept
