"""An emulated chain as one autograd node (bench/numerics/chain.py): a Sequential of emulated ops and selecting
modules trains to the bits its modules give one by one, eagerly and fused, and runs them one by one wherever
something watches them or the chain does not hold."""

import pytest
import torch
from torch import nn

from bench.numerics import emulation, fused
from bench.numerics.chain import EmulatedChain, chained
from bench.numerics.precision import Precision
from bench.tasks.lenet import LeNet5

CPU = torch.device("cpu")


def _one_by_one(model: nn.Module) -> nn.Module:
    """The same modules, run one by one by a plain Sequential."""
    return nn.Sequential(*model.children())


def _ran_as_one_node(output: torch.Tensor) -> bool:
    return type(output.grad_fn).__name__ == "_ChainBackward"


def _trained(model: nn.Module, precision: Precision, batches: list, freeze_first: bool = False) -> dict:
    """`model` trained one SGD step a batch: its losses, last gradients, parameters, and whether each step ran as
    one node."""
    if freeze_first:  # nothing before the second convolution wants a gradient
        model[0].requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=0.1)
    losses, one_node = [], []
    for x, y in batches:
        optimizer.zero_grad()
        with precision.autocast():
            logits = model(x)
            loss = nn.functional.cross_entropy(logits.float(), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
        one_node.append(_ran_as_one_node(logits))
    return {"losses": torch.stack(losses), "grads": [p.grad.clone() for p in params],
            "params": [p.detach().clone() for p in model.parameters()], "one_node": one_node}


def _lenet_batches(steps: int, scale: float = 3.0) -> list:
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 1, 32, 32, generator=generator) * scale, torch.randint(0, 10, (16,), generator=generator))
            for _ in range(steps)]


def _assert_same_bits(a: dict, b: dict) -> None:
    assert torch.equal(a["losses"], b["losses"])
    for x, y in zip(a["grads"] + a["params"], b["grads"] + b["params"], strict=True):
        assert torch.equal(x.view(torch.int32), y.view(torch.int32))  # a negative zero too


def _prepared(elsewhere: str = "bf16", model: nn.Module | None = None, **options) -> tuple[Precision, nn.Module]:
    torch.manual_seed(0)
    precision = Precision.of("fp8", CPU, mode="mixed", backend="emulated", elsewhere=elsewhere, **options)
    return precision, precision.prepare(model if model is not None else LeNet5())


@pytest.mark.parametrize("fused_on", [False, True], ids=["eager", "fused"])
@pytest.mark.parametrize("elsewhere", ["bf16", "fp32"])
@pytest.mark.parametrize("freeze_first", [False, True], ids=["all trained", "first conv frozen"])
def test_lenet_trains_as_one_node_to_the_bits_of_its_modules_one_by_one(monkeypatch, fused_on, elsewhere,
                                                                      freeze_first):
    monkeypatch.setenv(fused.SWITCH, "1" if fused_on else "0")
    fused.FELL_BACK.clear()
    batches = _lenet_batches(5)
    precision, chain = _prepared(elsewhere)
    assert isinstance(chain, EmulatedChain) and isinstance(chain, LeNet5)
    assert precision.chained == ["0", "3", "7", "9", "11"]
    assert precision.describe()["one_node_ops"] == precision.chained
    as_one = _trained(chain, precision, batches, freeze_first)
    precision, model = _prepared(elsewhere)
    one_by_one = _trained(_one_by_one(model), precision, batches, freeze_first)
    assert all(as_one["one_node"]) and not any(one_by_one["one_node"])
    assert not fused.FELL_BACK
    if fused_on:  # its two passes ran as compiled graphs
        assert len(chain._plan.passes.kept) == 2 and all(chain._plan.passes.kept.values())
    _assert_same_bits(as_one, one_by_one)


def _convolution_chain() -> nn.Sequential:
    """A chain with what LeNet lacks: a strided, padded convolution whose result is flattened straight into a
    Linear (its gradient reshaped to the convolution's result), an Unflatten and Identity, a bias-less Linear, and
    a nested Sequential."""
    return nn.Sequential(nn.Conv2d(2, 4, 3, stride=2, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(4, 4, 3, stride=1, padding=2, dilation=2), nn.Flatten(),
                         nn.Sequential(nn.Linear(64, 48, bias=False), nn.Unflatten(1, (3, 16)), nn.Identity(),
                                       nn.ReLU(), nn.Flatten()),
                         nn.Linear(48, 10))


@pytest.mark.parametrize("fused_on", [False, True], ids=["eager", "fused"])
def test_ties_nan_negative_zero_and_reshapes_give_the_bits_of_the_modules_one_by_one(monkeypatch, fused_on):
    """Inputs of a few values only (ReLU's zeros and the max-pool's ties everywhere), a NaN and negative zeros: the
    fused graph's own ReLU and max-pool pick and route what torch's kernels do."""
    monkeypatch.setenv(fused.SWITCH, "1" if fused_on else "0")
    generator = torch.Generator().manual_seed(2)
    batches = []
    for _ in range(3):
        x = torch.randint(-2, 3, (8, 2, 16, 16), generator=generator).float() * 0.5
        x[0, 0, 3, 3], x[1, 1, 5, 6] = -0.0, float("nan")
        batches.append((x, torch.randint(0, 10, (8,), generator=generator)))
    results = []
    for one_node in (True, False):
        precision, model = _prepared("bf16", _convolution_chain())
        assert isinstance(model, EmulatedChain)
        model = model if one_node else _one_by_one(model)
        results.append(_trained(model, precision, batches[:1]))  # one step: the NaN reaches every parameter
        assert results[-1]["one_node"] == [one_node]
    nan_free = [{**r, "losses": r["losses"].nan_to_num(), "grads": [g.nan_to_num() for g in r["grads"]],
                 "params": [p.nan_to_num() for p in r["params"]]} for r in results]
    _assert_same_bits(*nan_free)
    for one_node in (True, False):
        precision, model = _prepared("bf16", _convolution_chain())
        model = model if one_node else _one_by_one(model)
        results.append(_trained(model, precision, [(x.nan_to_num(), y) for x, y in batches]))
    _assert_same_bits(results[2], results[3])


@pytest.mark.parametrize("elsewhere", ["bf16", "fp32"])
def test_a_step_with_telemetry_sampled_runs_as_one_node_and_counts_what_the_modules_count_eagerly(monkeypatch,
                                                                                                elsewhere):
    """Its passes run compiled, the tensors its sites observe among their outputs (emulation.run_pass), and count what
    the modules one by one count with their passes eager, each site adding its own counts: every class, every
    category, run totals included."""
    batches = _lenet_batches(2, scale=3e3)  # values past E4M3's range and under it: every category counted
    counts = []
    for one_node in (True, False):
        monkeypatch.setenv(fused.SWITCH, "1" if one_node else "0")
        if not one_node:  # the reference: each pass run as itself, not counted as a pass
            monkeypatch.setattr(emulation, "run_pass", lambda passes, sites, key, body, x, *args: body(x, *args))
        precision, model = _prepared(elsewhere)
        model = model if one_node else _one_by_one(model)
        precision.telemetry.sampling = True
        assert _trained(model, precision, batches)["one_node"] == [one_node] * 2
        counts.append((precision.telemetry.end_step(), precision.telemetry.summary()))
        if one_node:  # both passes ran as their counting graphs
            kept = model._plan.passes.kept
            assert [key[:2] for key in kept] == [("counted", "forward"), ("counted", "backward")]
            assert all(kept.values())
    assert counts[0] == counts[1] and set(counts[0][0]) == {"activations", "weights", "gradients"}
    fractions = counts[0][0]
    assert any(f["overflow"] > 0 for f in fractions.values()) and any(f["underflow"] > 0 for f in fractions.values())


def test_a_step_something_watches_runs_the_modules_one_by_one():
    """A memory count listening, a hook on a module: the modules run one by one, so that what watches them sees
    each; so do ops handing BF16 tensors on, and a per-tensor scale (state between steps) never runs as one node."""
    batches = _lenet_batches(1)
    precision, model = _prepared()
    precision.site_listener = lambda *args: None
    assert _trained(model, precision, batches)["one_node"] == [False]
    precision.site_listener = None
    handle = model[4].register_forward_hook(lambda *args: None)
    assert _trained(model, precision, batches)["one_node"] == [False]
    handle.remove()
    assert _trained(model, precision, batches)["one_node"] == [True]
    model[3].casts.carries_out = False  # BF16 handed on between two ops: not what the chain computes
    assert _trained(model, precision, batches)["one_node"] == [False]
    scaled, model = _prepared(scaling="per_tensor")
    assert not isinstance(model, EmulatedChain) and scaled.describe()["one_node_ops"] == []  # what the record says
    assert _trained(model, scaled, batches)["one_node"] == [False]


def test_a_module_swapped_in_or_an_op_evaluated_unrounded_runs_the_modules_one_by_one():
    """A module put in a chain's place afterwards is run as itself, and so are ops whose rounding evaluation in full
    precision takes off; with it put back, the chain runs as one node again."""
    precision, model = _prepared()
    batches = _lenet_batches(1)
    assert _trained(model, precision, batches)["one_node"] == [True]
    with torch.no_grad(), precision.evaluating(model, "fp32") as cast_inputs:
        x = cast_inputs(batches[0][0])
        assert model[0].casts is None and torch.equal(model(x), _one_by_one(model)(x))  # FP32's ops, not the plan's
    assert _trained(model, precision, batches)["one_node"] == [True]
    model[7] = nn.Linear(400, 120)
    assert _trained(model, precision, batches)["one_node"] == [False]


class _OwnForward(nn.Sequential):
    def forward(self, x):
        return super().forward(x) * 2


@pytest.mark.parametrize("model", [
    _OwnForward(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4)),
    nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 4)),
    nn.Sequential(nn.Conv2d(1, 2, 3), nn.MaxPool2d(3, stride=2), nn.Flatten(), nn.Linear(2, 4)),
    nn.Sequential(nn.Linear(8, 8), nn.Unflatten(1, (1, 8)), nn.MaxPool1d(2), nn.Flatten(), nn.Linear(4, 4)),
    nn.Sequential(nn.Linear(8, 4)),
], ids=["its own forward", "GELU", "overlapping max-pool", "1-D max-pool", "one op"])
def test_what_is_not_a_chain_is_left_as_it_is(model):
    precision, prepared = _prepared(model=model)
    assert not isinstance(prepared, EmulatedChain) and precision.chained == []
    assert chained(prepared) is prepared
