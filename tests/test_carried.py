"""format.elsewhere=bf16 with BF16's values handed between emulated ops in FP32 tensors (emulation.carried_ops):
where only selecting modules (ReLU, a max-pool whose windows do not overlap, Flatten) sit between a Sequential's
emulated ops, training gives the same bits, and the step's memory count the same bytes, as handing on BF16 tensors."""

import contextlib

import pytest
import torch
from torch import nn

from bench.numerics import fused
from bench.numerics.memory import StepMemory
from bench.numerics.precision import Precision
from bench.tasks.lenet import LeNet5

CPU = torch.device("cpu")


def _trained(fmt: str, carry: bool, steps: int = 6, **options) -> dict:
    """LeNet-5 trained `steps` SGD steps on fixed random batches under `fmt` with BF16 elsewhere, BF16 carried in FP32
    between its ops or (carry=False) handed on as BF16 tensors; its losses, final parameters and gradients, the
    logits' dtype and the first step's memory count."""
    torch.manual_seed(0)
    model = LeNet5()
    precision = Precision.of(fmt, CPU, mode="mixed", backend="emulated", elsewhere="bf16", **options)
    model = precision.prepare(model)
    carried = list(precision.carried)
    if not carry:
        for module in model.modules():
            if getattr(module, "casts", None) is not None:
                module.casts.carries_out = False
        precision.carried = []
    handed_on = []  # the first op's result: FP32 where carried (fused too: its graph keeps the round trip)
    model[0].register_forward_hook(lambda module, args, y: handed_on.append(y.dtype))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(1)
    losses, memory = [], None
    for step in range(steps):
        x = torch.randn(16, 1, 32, 32, generator=generator) * 3
        y = torch.randint(0, 10, (16,), generator=generator)
        counting = StepMemory(model, precision) if step == 0 else None
        optimizer.zero_grad()
        with precision.autocast(), counting.saving() if counting else contextlib.nullcontext():
            logits = model(x)
            loss = nn.functional.cross_entropy(logits, y)
        loss.backward()
        if counting:
            memory = counting.finish(optimizer)
        optimizer.step()
        losses.append(loss.detach())
    return {"losses": torch.stack(losses), "params": [p.detach().clone() for p in model.parameters()],
            "grads": [p.grad.clone() for p in model.parameters()], "logits": logits.dtype, "memory": memory,
            "carried": carried, "handed_on": set(handed_on)}


@pytest.mark.parametrize("fused_on", [False, True], ids=["eager", "fused"])
@pytest.mark.parametrize("fmt, options", [("fp8", {}), ("fp8", {"scaling": "per_tensor"})],
                         ids=["fp8", "fp8 per-tensor scaled"])
def test_lenet_trains_to_the_same_bits_with_bf16_carried_in_fp32_between_its_ops(monkeypatch, fused_on, fmt, options):
    monkeypatch.setenv(fused.SWITCH, "1" if fused_on else "0")
    fused.FELL_BACK.clear()
    carried, handed = _trained(fmt, True, **options), _trained(fmt, False, **options)
    assert not fused.FELL_BACK  # fused, every graph compiled: none ran eagerly in its stead
    assert carried["carried"] == ["0", "3", "7", "9"]
    assert carried["handed_on"] == {torch.float32} and handed["handed_on"] == {torch.bfloat16}
    assert torch.equal(carried["losses"], handed["losses"])
    for a, b in zip(carried["grads"] + carried["params"], handed["grads"] + handed["params"]):
        assert torch.equal(a, b)
    # the last op still hands the loss a BF16 tensor, and the memory counted is what BF16 tensors would hold
    assert carried["logits"] == handed["logits"] == torch.bfloat16
    assert carried["memory"] == handed["memory"]


def test_an_op_whose_output_gradient_arrives_unrounded_rounds_it_to_bf16_as_autograd_would():
    """Each carried op rounds what it is handed back as a BF16 tensor's gradient would be rounded, so its backward
    does not depend on its neighbours being exact: an FP32 gradient with bits below BF16's gives the gradients that
    its BF16 rounding gives."""
    torch.manual_seed(0)
    grads = {}
    for carry in (True, False):
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
        precision = Precision.of("fp8", CPU, mode="mixed", backend="emulated", elsewhere="bf16")
        model = precision.prepare(model)
        first = model[0]
        first.casts.carries_out = carry
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(2))
        with precision.autocast():
            y = first(x)
        upstream = torch.randn(4, 32, generator=torch.Generator().manual_seed(3)) * 1e-2
        y.backward(upstream if carry else upstream.to(torch.bfloat16))
        grads[carry] = (first.weight.grad.clone(), first.bias.grad.clone())
        assert y.dtype == (torch.float32 if carry else torch.bfloat16)
    assert all(torch.equal(a, b) for a, b in zip(grads[True], grads[False]))


@pytest.mark.parametrize("between", [
    nn.GELU(), nn.Dropout(0.1), nn.MaxPool2d(3, stride=2), nn.LayerNorm(6), nn.Sequential(nn.ReLU(), nn.Tanh())],
    ids=["gelu", "dropout", "overlapping max-pool", "layer norm", "a nested tanh"])
def test_nothing_is_carried_past_a_module_that_rounds(between):
    model = nn.Sequential(nn.Conv2d(1, 6, 3), between, nn.Flatten(), nn.Linear(6, 4))  # shapes: never run
    precision = Precision.of("fp8", CPU, mode="mixed", backend="emulated", elsewhere="bf16")
    precision.prepare(model)
    assert precision.carried == [] and precision.describe()["elsewhere_in_fp32_after"] == []
    precision = Precision.of("fp8", CPU, mode="mixed", backend="emulated", elsewhere="bf16")
    precision.prepare(nn.Sequential(nn.Conv2d(1, 6, 3), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(6, 4)))
    assert precision.carried == ["0"]  # the same chain, its module between selecting


def test_only_bf16_elsewhere_carries_and_only_through_a_plain_sequential_of_distinct_ops_and_selecting_modules():
    class OwnForward(nn.Sequential):
        def forward(self, x):
            return super().forward(x) * 2

    class Leaky(nn.ReLU):  # a ReLU by class, another function by its forward
        def forward(self, x):
            return nn.functional.leaky_relu(x, 0.1)

    shared = nn.Linear(4, 4)
    for model, elsewhere, carried in [(LeNet5(), "bf16", ["0", "3", "7", "9"]), (LeNet5(), "fp32", []),
                                      (OwnForward(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4)), "bf16", []),
                                      (nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Sequential(nn.Flatten(),
                                                                                               nn.Linear(4, 4))),
                                       "bf16", ["0"]),
                                      (nn.Sequential(nn.Linear(4, 4), Leaky(), nn.Linear(4, 4)), "bf16", []),
                                      (nn.Sequential(shared, nn.ReLU(), shared), "bf16", []),
                                      # torch pads a `same` convolution itself: its own autograd node, not one op
                                      (nn.Sequential(nn.Conv2d(1, 6, 3, padding="same"), nn.ReLU(), nn.Flatten(),
                                                     nn.Linear(6, 4)), "bf16", [])]:
        precision = Precision.of("fp8", CPU, mode="mixed", backend="emulated", elsewhere=elsewhere)
        precision.prepare(model)
        assert precision.carried == carried, (model, elsewhere)


def _small_encoder(kind: str) -> nn.Module:
    """A 2-layer transformers encoder for sequence classification with dropout on: BERT or DistilBERT."""
    from transformers import (
        BertConfig,
        BertForSequenceClassification,
        DistilBertConfig,
        DistilBertForSequenceClassification,
    )

    if kind == "bert":
        return BertForSequenceClassification(BertConfig(
            vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
            max_position_embeddings=16, attn_implementation="sdpa"))
    return DistilBertForSequenceClassification(DistilBertConfig(
        vocab_size=50, dim=32, n_layers=2, n_heads=2, hidden_dim=64, max_position_embeddings=16,
        attn_implementation="sdpa"))


def _encoder_step(monkeypatch, kind: str, carry: bool) -> dict:
    """A small transformers encoder (`_small_encoder`, padded batch) prepared for FP8 with BF16 elsewhere, its
    attention taking its query, key and value in FP32 tensors (carry) or in BF16 ones as before: one training step's
    loss and gradients, an evaluation's logits, what the first query projection handed on and how often the math
    path ran (bench/numerics/carried_attention.py)."""

    from bench.numerics import carried_attention
    from bench.numerics import precision as precision_module

    if not carry:
        monkeypatch.setattr(precision_module, "carried_attention_ops", lambda model: [])
    math_paths = []
    monkeypatch.setattr(carried_attention, "_takes_math_path",
                        lambda *args, taken=carried_attention._takes_math_path: math_paths.append(taken(*args))
                        or math_paths[-1])
    torch.manual_seed(0)
    precision = Precision.of("fp8", CPU, mode="mixed", backend="emulated", elsewhere="bf16")
    model = precision.prepare(_small_encoder(kind))
    query = next(module for name, module in model.named_modules() if name.endswith(("self.query", "q_lin")))
    handed_on = []
    query.register_forward_hook(lambda module, args, y: handed_on.append(y.dtype))
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 50, (3, 12), generator=generator)
    mask = torch.ones(3, 12, dtype=torch.long)
    mask[1, 7:] = mask[2, 4:] = 0  # padding: the attention's mask in play
    labels = torch.tensor([0, 1, 1])
    model.train()
    torch.manual_seed(2)  # the dropout masks
    with precision.autocast():
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    loss.backward()
    model.eval()
    with torch.no_grad(), precision.autocast():
        logits = model(input_ids=ids, attention_mask=mask).logits
    return {"loss": loss, "grads": [p.grad for p in model.parameters()], "logits": logits,
            "handed_on": handed_on[0], "math_paths": math_paths,
            "names": precision.describe()["elsewhere_in_fp32_to_attention"]}


@pytest.mark.parametrize("kind", ["bert", "distilbert"])
def test_an_encoders_attention_on_carried_query_key_value_gives_the_same_bits(monkeypatch, kind):
    """FP8 with BF16 elsewhere on a transformers BERT or DistilBERT: its query, key and value ops hand BF16's values
    to the attention in FP32 tensors and a training step's attention runs torch's math path in FP32 on them (what CPU
    BF16 autocast computes there), giving the loss and every gradient of the step that handed on BF16 tensors, bit
    for bit; an evaluation (no dropout: another kernel, which rounds inside) calls SDPA as before, the same logits."""
    carried = _encoder_step(monkeypatch, kind, carry=True)
    monkeypatch.undo()
    handed = _encoder_step(monkeypatch, kind, carry=False)
    assert carried["handed_on"] == torch.float32 and handed["handed_on"] == torch.bfloat16
    assert carried["math_paths"] == [True, True] and handed["math_paths"] == []  # training only: no dropout, no ask
    names = {"bert": [f"bert.encoder.layer.{i}.attention.self.{p}" for i in (0, 1) for p in ("query", "key", "value")],
             "distilbert": [f"distilbert.transformer.layer.{i}.attention.{p}" for i in (0, 1)
                            for p in ("q_lin", "k_lin", "v_lin")]}[kind]
    assert carried["names"] == names and handed["names"] == []
    assert torch.equal(carried["loss"], handed["loss"]) and torch.equal(carried["logits"], handed["logits"])
    assert all(torch.equal(a, b) for a, b in zip(carried["grads"], handed["grads"]))


def test_a_gpu_run_keeps_handing_its_attention_bf16():
    """Only a CPU's BF16 attention with dropout is FP32 arithmetic on widened inputs; a GPU's BF16 kernels read BF16,
    so there the query, key and value ops hand on BF16 as before and the model keeps transformers' SDPA."""
    for device, carried in ((CPU, 6), (torch.device("cuda"), 0)):
        precision = Precision.of("fp8", CPU, mode="mixed", backend="emulated", elsewhere="bf16")
        precision.device = device  # as a CUDA run's (built on this CPU: prepare moves nothing)
        model = precision.prepare(_small_encoder("bert"))
        assert len(precision.carried_to_attention) == carried
        assert model.config._attn_implementation == ("precision_bench_carried_sdpa" if carried else "sdpa")


def test_the_carried_attention_rounds_a_float_mask_as_autocast_does():
    """An additive float mask (a model's own, not transformers' boolean one): autocast hands SDPA its BF16 rounding,
    so the FP32 math path adds the same rounded values; the result and the gradients are the native call's, bit for
    bit (an unrounded mask, or a BF16 one, which SDPA refuses beside FP32 q, fails it)."""
    from types import SimpleNamespace

    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from bench.numerics.carried_attention import _attention

    module = SimpleNamespace(is_causal=False)
    generator = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 2, 7, 8, generator=generator).bfloat16().float() for _ in range(3))
    mask = torch.randn(2, 1, 7, 7, generator=generator) * 3  # values BF16 cannot hold
    results = []
    for attend, inputs in ((_attention, (q, k, v)), (sdpa_attention_forward, [t.bfloat16() for t in (q, k, v)])):
        inputs = [t.clone().requires_grad_() for t in inputs]
        torch.manual_seed(5)  # the dropout mask
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out, _ = attend(module, *inputs, mask, dropout=0.2)
        out.float().pow(2).sum().backward()
        results.append([out, *(t.grad.bfloat16() for t in inputs)])
    assert all(torch.equal(a, b) for a, b in zip(*results))
