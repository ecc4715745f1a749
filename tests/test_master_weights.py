"""train.master_weights: a mixed run's parameters in BF16, updated to nearest, stochastically or with a Kahan
compensation (bench/numerics/master_weights.py), against torchao's BF16-parameter AdamW and hand counts (#55)."""


import pytest
import torch
from omegaconf import OmegaConf

from bench.errors import ConfigError
from bench.numerics.master_weights import COMPENSATION, MasterWeights
from bench.running.config import check
from bench.running.identity import run_id
from bench.running.run import run_cell
from bench.tasks.optimizer import build_optimizer


def _sgd_steps(mode: str, steps: int, update: float = 1e-3) -> torch.Tensor:
    """Weights at 1.0 (BF16's step there is 2^-7), each SGD step moving them by -`update`, far under half a step."""
    torch.manual_seed(0)
    model = torch.nn.Linear(1, 4096, bias=False)
    torch.nn.init.ones_(model.weight)
    optimizer = torch.optim.SGD(model.parameters(), lr=update)
    master = MasterWeights(mode, model, optimizer)
    master.start()
    for _ in range(steps):
        model.weight.grad = torch.ones_like(model.weight)
        master.after_backward()
        optimizer.step()
        master.after_step()
    return model.weight.detach().flatten()


def test_plain_bf16_weights_stall_where_stochastic_rounding_and_kahan_keep_the_updates():
    """Zamirai et al.'s point, counted: 20 updates of 1e-3 on a weight of 1.0 (BF16's step there: 2^-8 below 1,
    half of it 0.002) leave plain BF16 at 1.0; stochastic rounding moves the mean by 0.02 (unbiased; each weight
    on the BF16 grid); Kahan's compensation carries the lost part and lands each weight on the grid point nearest
    1 - 0.02."""
    fp32 = _sgd_steps("fp32", 20)
    assert torch.allclose(fp32, torch.full_like(fp32, 1 - 0.02), atol=1e-6)
    assert torch.equal(_sgd_steps("bf16", 20), torch.ones(4096))
    stochastic = _sgd_steps("bf16_stochastic", 20)
    assert torch.equal(stochastic, stochastic.bfloat16().float()) and stochastic.unique().numel() > 1
    assert abs(stochastic.mean().item() - (1 - 0.02)) < 5e-4
    kahan = _sgd_steps("bf16_kahan", 20)
    assert torch.equal(kahan, torch.full_like(kahan, 1 - 0.02).bfloat16().float())


def test_bf16_master_weights_with_bf16_moments_are_torchaos_adamw_on_bf16_parameters_bit_for_bit():
    """torchao's `_AdamW` stepping BF16 parameters (BF16 moments, the step in FP32, the weight rounded to nearest)
    against ours: FP32 carriers of BF16 values, BF16 gradients, state_format=bf16, master_weights=bf16."""
    from torchao.optim import _AdamW

    torch.manual_seed(0)
    start, grads = torch.randn(64, 64) * 0.1, [torch.randn(64, 64) for _ in range(4)]
    theirs = torch.nn.Parameter(start.bfloat16())
    reference = _AdamW([theirs], lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1)
    ours = torch.nn.Linear(64, 64, bias=False)
    ours.weight.data.copy_(start)
    optimizer = build_optimizer(OmegaConf.create({"name": "adamw", "lr": 1e-2, "beta2": 0.99, "weight_decay": 0.1,
                                                  "momentum": 0.0, "decay_matrices_only": False,
                                                  "state_format": "bf16"}), ours.parameters())
    master = MasterWeights("bf16", ours, optimizer)
    master.start()
    for g in grads:
        theirs.grad = g.bfloat16()
        reference.step()
        ours.weight.grad = g.clone()
        master.after_backward()
        optimizer.step()
        master.after_step()
    assert torch.equal(ours.weight.detach(), theirs.detach().float())


def test_master_weights_are_refused_where_the_format_already_stores_the_parameters(make_cfg):
    with pytest.raises(ConfigError, match=r"already stores the parameters .* valid here: fp32\)"):
        check(make_cfg("model=lenet", "format=bf16-true", "train.master_weights=bf16_kahan"))
    check(make_cfg("model=lenet", "format=fp32", "train.master_weights=bf16_kahan"))  # 32-true: FP32 parameters
    with pytest.raises(ConfigError, match="fp32, bf16, bf16_stochastic, bf16_kahan"):
        check(make_cfg("model=lenet", "train.master_weights=fp16"))


def test_fp32_master_weights_are_todays_runs(make_cfg):
    from omegaconf import OmegaConf as conf

    base = conf.to_container(make_cfg("model=lenet"), resolve=True)
    spelled = conf.to_container(make_cfg("model=lenet", "train.master_weights=fp32"), resolve=True)
    del base["train"]["master_weights"]  # a record made before the key existed
    assert run_id(spelled) == run_id(base)
    assert run_id(conf.to_container(make_cfg("model=lenet", "train.master_weights=bf16"), resolve=True)) != run_id(base)


def test_a_record_counts_bf16_weights_gradients_and_the_compensation(make_cfg, tmp_path):
    """LeNet, bf16-mixed: the parameters and gradients at two bytes each under BF16 master weights, SGD's momentum
    still FP32; Kahan adds a two-byte compensation per parameter to the optimiser state."""
    steps = {}
    for mode in ("fp32", "bf16", "bf16_kahan"):
        record = run_cell(make_cfg("model=lenet", "format=bf16", "train.max_steps=2", f"train.master_weights={mode}",
                                   f"results_dir={tmp_path / mode}"))
        assert record["status"] == "ok", record["reason"]
        steps[mode] = record["memory"]["step"]
    params = steps["fp32"]["parameters"] // 4
    assert steps["bf16"]["parameters"] == steps["bf16"]["gradients"] == 2 * params
    assert steps["bf16"]["optimizer_state"] == steps["fp32"]["optimizer_state"] == 4 * params  # momentum
    assert steps["bf16_kahan"]["optimizer_state"] == 4 * params + 2 * params


@pytest.mark.slow
def test_a_kahan_cell_interrupted_after_its_checkpoint_resumes_bit_for_bit(make_cfg, monkeypatch):
    from tests.conftest import straight_and_resumed

    keep = ["model=lenet", "format=bf16", "train.max_steps=6", "train.checkpoint_every=3", "train.keep_checkpoint=true",
            "train.master_weights=bf16_kahan"]
    reference, resumed = straight_and_resumed(make_cfg(*keep), make_cfg(*keep, "experiment_name=interrupted"),
                                              monkeypatch, 3)
    assert all(torch.equal(reference["model"][k], resumed["model"][k]) for k in reference["model"])
    for key, state in reference["optimizer"]["state"].items():
        assert torch.equal(state[COMPENSATION].float(), resumed["optimizer"]["state"][key][COMPENSATION].float())


def test_bench_predict_models_the_memory_the_record_counts_for_bf16_weights_and_low_bit_moments(make_cfg, tmp_path):
    """The memory model (bench.predict's column) knows the parameters' and moments' storage: LeNet's bf16-mixed step
    with BF16 master weights and a Kahan compensation, counted to the byte; the char-LM's int8 moments within the
    FP32 moments torchao keeps for its small tensors."""
    from bench.speed.model import recipe_on, step_memory
    from bench.speed.profiles import gpu
    from bench.speed.trace import trace_cell

    for mode in ("bf16", "bf16_kahan"):
        cfg = make_cfg("model=lenet", "format=bf16", "format.backend=native", "train.max_steps=1",
                       f"train.master_weights={mode}", f"results_dir={tmp_path / mode}")
        counted = run_cell(cfg)["memory"]["step"]
        modelled = step_memory(trace_cell(cfg), recipe_on(cfg, trace_cell(cfg), gpu("H100")))
        for part in ("parameters", "gradients", "optimizer_state"):
            assert modelled[part] == counted[part], (mode, part, modelled, counted)


def test_stochastic_rounding_of_the_weights_is_unbiased():
    """One SGD step of 1e-3 from 1.0 puts each of 4,096 weights at 0.999, between BF16's 1 - 2^-8 and 1: each must
    round down with probability 0.001 / 2^-8 = 0.256, independently. The count of weights rounded down is then
    Binomial(4096, 0.256); a count more than 5 standard deviations from its mean fails this test, which a correct
    rounding does with probability under 6e-7 (the false-alarm rate)."""
    weights = _sgd_steps("bf16_stochastic", 1)
    down = int((weights == 1 - 2**-8).sum())
    assert down + int((weights == 1.0).sum()) == 4096  # every weight on one of the two grid points
    p, n = 1e-3 / 2**-8, 4096
    assert abs(down - n * p) < 5 * (n * p * (1 - p)) ** 0.5
