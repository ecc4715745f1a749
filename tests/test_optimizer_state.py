"""model.optimizer.state_format: Adam's moments stored in BF16, int8, int4 or FP8 (torchao's low-bit optimisers),
what they hold in a record's memory, and a cell interrupted and resumed with them (issue #55)."""

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from bench.errors import ConfigError
from bench.running.config import check
from bench.running.identity import cell_path, run_id
from bench.running.run import run_cell
from bench.tasks.optimizer import build_optimizer


def _adamw(state_format: str, lr: float = 1e-2):
    return OmegaConf.create({"name": "adamw", "lr": lr, "beta2": 0.99, "weight_decay": 0.1, "momentum": 0.0,
                             "decay_matrices_only": False, "state_format": state_format})


def test_bf16_states_round_the_moments_to_nearest_after_each_fp32_update():
    """Against Adam written out by hand: the moments updated in FP32 from their stored BF16 values, the step taken
    with the unrounded FP32 moments, then the moments stored to nearest BF16 (what torchao's step does for its own
    states). A tensor under 4,096 elements keeps FP32 moments, as torchao's and bitsandbytes' states do."""
    torch.manual_seed(0)
    big, small = torch.randn(64, 64) * 0.1, torch.randn(10) * 0.1
    params = [torch.nn.Parameter(big.clone()), torch.nn.Parameter(small.clone())]
    optimizer = build_optimizer(_adamw("bf16"), params)
    lr, (b1, b2), eps, wd = 1e-2, (0.9, 0.99), 1e-8, 0.1
    m, v, p = torch.zeros_like(big, dtype=torch.bfloat16), torch.zeros_like(big, dtype=torch.bfloat16), big.clone()
    for step in range(1, 4):
        grad = torch.randn(64, 64)
        params[0].grad, params[1].grad = grad.clone(), torch.randn(10)
        optimizer.step()
        p = p - lr * wd * p
        m32, v32 = m.float().lerp(grad, 1 - b1), v.float().lerp(grad.square(), 1 - b2)
        m, v = m32.bfloat16(), v32.bfloat16()
        p = p - lr * (m32 / (1 - b1**step)) / (v32.sqrt() / (1 - b2**step) ** 0.5 + eps)
    state = optimizer.state[params[0]]
    assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.bfloat16
    # torchao's step is compiled: inductor's lerp and fused multiply-adds may land an FP32 moment on the other side
    # of a BF16 rounding boundary from eager's, so a few stored moments differ by one BF16 step
    for ours, hand in ((state["exp_avg"], m), (state["exp_avg_sq"], v)):
        torch.testing.assert_close(ours.float(), hand.float(), rtol=2**-7, atol=0)
        assert (ours == hand).float().mean() > 0.99
    torch.testing.assert_close(params[0].detach(), p, rtol=0, atol=1e-6)  # the steps themselves are ~1e-2
    assert optimizer.state[params[1]]["exp_avg"].dtype == torch.float32


@pytest.mark.parametrize("state_format, kind", [("int8", "OptimState8bit"), ("int4", "OptimState4bit"),
                                                 ("fp8", "OptimStateFp8")])
def test_low_bit_states_are_torchaos_and_train_close_to_fp32_states(state_format, kind):
    """torchao's AdamW8bit, AdamW4bit and AdamWFp8 store the moments of tensors of 4,096 elements and more; after a
    few steps the weights stay within a small fraction of the FP32-state run's change (the states' rounding moves
    each step by a few percent at most)."""
    torch.manual_seed(0)
    start, grads = torch.randn(128, 128) * 0.1, [torch.randn(128, 128) for _ in range(5)]
    finals = {}
    for fmt in ("fp32", state_format):
        p = torch.nn.Parameter(start.clone())
        optimizer = build_optimizer(_adamw(fmt, lr=1e-3), [p])
        for g in grads:
            p.grad = g.clone()
            optimizer.step()
        finals[fmt] = p.detach()
        if fmt != "fp32":
            assert type(optimizer.state[p]["exp_avg"]).__name__ == kind
    moved = (finals["fp32"] - start).abs().mean()
    assert (finals[state_format] - finals["fp32"]).abs().mean() < 0.2 * moved
    assert not torch.equal(finals[state_format], finals["fp32"])  # the states' rounding reached the weights


def test_a_state_format_is_refused_where_it_has_no_optimiser(make_cfg):
    with pytest.raises(ConfigError, match="needs an Adam optimiser .* valid for sgd: fp32"):
        check(make_cfg("model=lenet", "model.optimizer.state_format=int8"))
    with pytest.raises(ConfigError, match="fp32, bf16, int8, int4, fp8"):
        check(make_cfg("model=charlm", "model.optimizer.state_format=int2"))


@pytest.mark.slow
def test_low_bit_states_take_u_mups_per_parameter_learning_rates(make_cfg, text_file):
    """u-μP sets its own optimiser groups (a learning rate per parameter type and depth): torchao's optimisers take
    them as they are, each group's rate its own."""
    cfg = _charlm(make_cfg, text_file, "scaling=umup", "model.optimizer.state_format=int8")
    record = run_cell(cfg)
    assert record["status"] == "ok", record["reason"]
    assert record["memory"]["step"]["optimizer_state"] < record["memory"]["step"]["parameters"]  # int8 moments


def test_fp32_states_are_todays_runs_and_a_low_bit_format_a_run_of_its_own(make_cfg):
    base = OmegaConf.to_container(make_cfg("model=charlm"), resolve=True)
    spelled = OmegaConf.to_container(make_cfg("model=charlm", "model.optimizer.state_format=fp32"), resolve=True)
    del base["model"]["optimizer"]["state_format"]  # a record made before the key existed
    assert run_id(spelled) == run_id(base)
    int8 = make_cfg("model=charlm", "model.optimizer.state_format=int8")
    assert run_id(OmegaConf.to_container(int8, resolve=True)) != run_id(base)
    assert cell_path(int8, overrides=["model.optimizer.state_format=int8"]).endswith(
        ",model.optimizer.state_format=int8")


def _charlm(make_cfg, text_file, *overrides):
    # embedding 64: every matrix has >= 4,096 elements, so torchao stores its moments in the low-bit format
    return make_cfg("model=charlm", "model.data.source=local", f"model.data.path={text_file}", "model.data.sha256=null",
                    "model.iterations=4", "model.arch.layers=1", "model.arch.embedding=64", "model.arch.block_size=16",
                    "model.batch_size=4", "train.log_every=2", *overrides)


def test_a_record_counts_the_bytes_low_bit_states_hold(make_cfg, text_file):
    """The record's optimiser state is what the states hold: int8 codes plus one FP32 scale per 256 elements (and
    a 256-entry code book per state) for the quantised tensors, FP32 for the rest: under a third of FP32 states."""
    records = {fmt: run_cell(_charlm(make_cfg, text_file, f"model.optimizer.state_format={fmt}",
                                     f"experiment_name={fmt}"))
               for fmt in ("fp32", "int8")}
    assert all(r["status"] == "ok" for r in records.values())
    fp32, int8 = (records[f]["memory"]["step"]["optimizer_state"] for f in ("fp32", "int8"))
    params = records["fp32"]["memory"]["step"]["parameters"] // 4
    assert 0 < fp32 - 2 * 4 * params <= 4 * 32  # two FP32 moments per parameter, and a step count per tensor
    assert int8 < fp32 / 3
    assert records["int8"]["memory"]["step"]["parameters"] == records["fp32"]["memory"]["step"]["parameters"]


@pytest.mark.slow
def test_a_cell_with_int8_states_interrupted_after_its_checkpoint_resumes_bit_for_bit(make_cfg, text_file,
                                                                                       monkeypatch):
    from tests.conftest import straight_and_resumed

    keep = ["train.checkpoint_every=2", "train.keep_checkpoint=true", "model.optimizer.state_format=int8"]
    reference, resumed = straight_and_resumed(_charlm(make_cfg, text_file, *keep),
                                              _charlm(make_cfg, text_file, *keep, "experiment_name=interrupted"),
                                              monkeypatch, 2)
    assert all(torch.equal(reference["model"][k], resumed["model"][k]) for k in reference["model"])
    for key, state in reference["optimizer"]["state"].items():
        for name in ("exp_avg", "exp_avg_sq"):
            ours, theirs = state[name], resumed["optimizer"]["state"][key][name]
            assert type(ours) is type(theirs) and torch.equal(ours.dequantize() if hasattr(ours, "dequantize")
                                                             else ours, theirs.dequantize()
                                                             if hasattr(theirs, "dequantize") else theirs)


def test_the_committed_ablation_tells_each_state_format_apart(tmp_path):
    """A state format is a column of the design, as the format is (design_id leaves it out), and a recipe option
    of the cell: each labelled row of experiment=optimizer_precision is its own runs, not the first row's again."""
    import shutil

    import pandas as pd

    from bench.reporting import committed

    folder = tmp_path / "optimizer_precision"
    shutil.copytree(Path(__file__).parents[1] / "results/tables/optimizer_precision", folder,
                    ignore=shutil.ignore_patterns("*.png", "*.svg", "*.csv", "*.md", "*.tex"))
    _, problems = committed.regenerate(folder, plots_too=False)
    assert not problems
    table = pd.read_csv(folder / "ablation.csv")
    assert len(table) == 16 and table["cell"].is_unique
    assert set(table["options"]) == {"–", "state_format=bf16", "state_format=int8", "state_format=int4",
                                     "state_format=fp8", "master_weights=bf16", "master_weights=bf16_stochastic",
                                     "master_weights=bf16_kahan"}
    means = dict(zip(table["cell"], table["mean ± std"]))
    assert means["FP32, int4 states"] != means["FP32, FP32 states"]
    paired = dict(zip(table["cell"], table["Δ vs FP32, FP32 states"]))  # paired by seed across state formats
    assert all("(n=3)" in paired[f"FP32, {s} states"] for s in ("BF16", "int8", "int4", "FP8"))


def test_the_speed_model_prices_the_optimiser_step_by_the_bytes_its_moments_and_weights_move(make_cfg, text_file):
    """The fused FP32 AdamW step reads each weight, gradient and moment and writes weights and moments (4 bytes
    each); int8 moments move 1 + 4/256 bytes, BF16 master weights 2, a Kahan compensation adds a read and a write of
    2: the bytes per element the model streams are those, by hand, and the predicted optimiser part follows them."""
    from bench.speed.model import _optimizer_bytes_per_element, predict, recipe_on
    from bench.speed.profiles import gpu
    from bench.speed.trace import trace_cell

    h100 = gpu("H100")

    def traced(*overrides):  # 4 blocks x 512: a step moving ~0.3 GB, past a kernel's floor
        cfg = make_cfg("model=charlm", "model.data.source=local", f"model.data.path={text_file}",
                       "model.data.sha256=null", "model.arch.embedding=512", "format=fp32", *overrides)
        trace = trace_cell(cfg)
        return trace, predict(trace, recipe_on(cfg, trace, h100), h100, compiled=True).optimizer

    (fp32, fp32_s), (int8, int8_s), (kahan, kahan_s) = (
        traced(), traced("model.optimizer.state_format=int8"), traced("train.master_weights=bf16_kahan"))
    params = fp32.parameters
    traffic = sum(sum(o.reads) + sum(o.writes) for o in fp32.ops if o.phase == "optimizer" and o.kind != "view")
    moments = traffic - 3 * params
    assert _optimizer_bytes_per_element(fp32, 4.0) == 4.0
    assert _optimizer_bytes_per_element(int8, 4.0) * traffic == pytest.approx(3 * params * 4 + moments * (1 + 4 / 256))
    assert _optimizer_bytes_per_element(kahan, 4.0) * traffic == pytest.approx(3 * params * 2 + moments * 4
                                                                               + 2 * params * 2)
    assert int8_s < kahan_s < fp32_s


def test_under_fsdp2_a_record_counts_the_shards_as_the_run_stores_them(make_cfg, text_file):
    """FSDP2's parameters, gradients and optimiser states are DTensors: each rank's shard, counted as the run holds it
    (int8 states' codes and scales, BF16 master weights' two bytes), not at the DTensor's FP32 (a newcomer's trial,
    2026-11-30: FSDP2 with int8 states and BF16 master weights was recorded as FP32's bytes). One rank's shard is
    the whole tensor, so its counts are the one-device cell's."""
    settings = ("model.optimizer.state_format=int8", "train.master_weights=bf16")
    one, sharded = (run_cell(_charlm(make_cfg, text_file, *settings, *wrapper, f"experiment_name={name}"))
                    for name, wrapper in (("one", ()), ("fsdp2", ("parallel=fsdp2", "parallel.world_size=1"))))
    assert one["status"] == sharded["status"] == "ok", (one["reason"], sharded["reason"])
    assert sharded["config"]["parallel"]["name"] == "fsdp2"
    counted = ("parameters", "gradients", "optimizer_state")
    assert {k: sharded["memory"]["step"][k] for k in counted} == {k: one["memory"]["step"][k] for k in counted}
    step = one["memory"]["step"]  # two int8 moments a BF16 parameter, not FP32's eight bytes (scales aside)
    assert step["optimizer_state"] < 1.5 * step["parameters"]


def test_bench_predict_keeps_the_moments_torchao_keeps_in_fp32_and_counts_each_code_book(make_cfg, text_file,
                                                                                        predicted_memory):
    """torchao stores a moment low-bit only from 4,096 elements in whole blocks: none of LeNet's (its records'
    int8 and FP32 states are alike), BERT-MLM tiny's matrices but its 303-row embedding; each int8 moment holds its
    256-entry FP32 code book. bench.predict's optimiser state equals the record's, byte for byte."""
    data = ["model.data.source=local", f"model.data.path={text_file}", "model.data.sha256=null", "train.max_steps=1"]
    for model in (["model=lenet", "model.optimizer.name=adamw"], ["model=bert_mlm_tiny", *data]):
        cfg = make_cfg(*model, "model.optimizer.state_format=int8")
        record = run_cell(cfg)
        assert record["status"] == "ok"
        assert predicted_memory(cfg)["optimizer_state"] == record["memory"]["step"]["optimizer_state"], model


def test_fsdp2_shards_of_uneven_rows_train_with_low_bit_states_alike_on_every_rank(make_cfg, text_file,
                                                                                  predicted_memory):
    """BERT-MLM tiny's 303-row embedding splits 152/151 over two ranks: torchao's compiled update of an unevenly
    sharded DTensor failed ('expected size 152==151'), and its rule gave rank 0's shard int8 moments and rank 1's
    FP32 ones. Each rank now updates its shard, both keep that tensor's moments in FP32, and bench.predict's state
    per rank is within 2% of the record's (rank 0's shards are the larger)."""
    cfg = make_cfg("model=bert_mlm_tiny", "model.data.source=local", f"model.data.path={text_file}",
                   "model.data.sha256=null", "train.max_steps=2", "model.optimizer.state_format=int8", "parallel=fsdp2")
    record = run_cell(cfg)
    assert record["status"] == "ok", record.get("reason")
    assert predicted_memory(cfg)["optimizer_state"] == pytest.approx(record["memory"]["step"]["optimizer_state"],
                                                                      rel=0.02)


def test_the_step_torchao_compiles_its_update_in_is_timed_apart(make_cfg):
    """torchao's low-bit AdamW compiles its update on the first step (seconds): that step is a compile step, out of
    the median and of train_s_without_compile, as torch.compile's and the fused graphs' are (it counted as training:
    LeNet's train_s 3.3 s against 0.13 with FP32 states)."""
    torch._dynamo.reset()  # a graph an earlier test compiled in this process would not compile again
    record = run_cell(make_cfg("model=lenet", "model.optimizer.name=adamw", "model.optimizer.state_format=int8",
                               "train.max_steps=3"))
    assert record["status"] == "ok"
    timing = record["timing"]
    assert 0 in timing["compile"]["steps"] and timing["train_s_without_compile"] < timing["train_s"]
