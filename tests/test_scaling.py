"""Loss scalers against torch.amp.GradScaler, and the static scaler's skip rule."""

import math

import pytest
import torch

from bench.scaling import LossScaler, PerTensorScale
from bench.formats import FORMATS

INF, NAN = math.inf, math.nan
# A scripted sequence of gradients: clean runs long enough to grow, inf and NaN in between.
SCRIPT = [1.0, 2.0, INF, 1.0, 1.0, 1.0, NAN, 0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, INF, INF, 1.0, 3.0, 1.0, 1.0]


def _param():
    p = torch.nn.Parameter(torch.zeros(3))
    return p, torch.optim.SGD([p], lr=0.1)


@pytest.mark.parametrize("init,growth,backoff,interval", [(2.0**16, 2.0, 0.5, 3), (1000.0, 3.0, 0.3, 2)])
def test_dynamic_matches_grad_scaler_step_for_step(init, growth, backoff, interval):
    ours_p, ours_opt = _param()
    ref_p, ref_opt = _param()
    ours = LossScaler("dynamic", init, growth, backoff, interval)
    ref = torch.amp.GradScaler("cpu", init_scale=init, growth_factor=growth, backoff_factor=backoff,
                               growth_interval=interval)
    for i, g in enumerate(SCRIPT):
        # d/dp of (p * g).sum() is g: both backpropagate their own scaled loss.
        for p, opt, scaled in ((ours_p, ours_opt, ours.scale_loss), (ref_p, ref_opt, ref.scale)):
            opt.zero_grad()
            scaled((p * torch.full((3,), g)).sum()).backward()
        before_ours, before_ref = ours_p.detach().clone(), ref_p.detach().clone()
        stepped = ours.step(ours_opt, [ours_p])
        ref.step(ref_opt)
        ref.update()
        ref_stepped = not torch.equal(ref_p.detach(), before_ref)
        assert stepped == ref_stepped == math.isfinite(g), i
        assert ours.scale == ref.get_scale(), i
        assert torch.equal(ours_p.detach(), ref_p.detach()), i
        assert stepped == (not torch.equal(ours_p.detach(), before_ours))
    assert ours.skipped_steps == sum(not math.isfinite(g) for g in SCRIPT)


def test_static_skips_and_counts_overflowing_steps_and_never_changes_scale():
    p, opt = _param()
    scaler = LossScaler("static", init_scale=2048.0)
    for g in (1.0, INF, 1.0, NAN):
        p.grad = torch.full((3,), g * 2048.0)
        scaler.step(opt, [p])
    assert scaler.skipped_steps == 2 and scaler.state()["overflow_steps"] == 2 and scaler.scale == 2048.0
    # the two clean steps applied lr * unscaled grad (1.0) each: 0 - 2 * 0.1
    assert torch.allclose(p.detach(), torch.full((3,), -0.2))


def test_none_never_skips_but_counts_overflow():
    p, opt = _param()
    scaler = LossScaler("none")
    p.grad = torch.full((3,), INF)
    assert scaler.step(opt, [p]) and scaler.skipped_steps == 0
    p.grad = torch.full((3,), 1.0)
    scaler.step(opt, [p])
    assert scaler.state()["overflow_steps"] == 1 and scaler.state()["skipped_steps"] == 0


def test_sixteen_bit_gradients_are_unscaled_where_grad_scaler_refuses():
    p = torch.nn.Parameter(torch.zeros(2, dtype=torch.float16))
    opt = torch.optim.SGD([p], lr=1.0)
    p.grad = torch.tensor([512.0, 1024.0], dtype=torch.float16)
    LossScaler("static", init_scale=512.0).step(opt, [p])
    assert p.detach().tolist() == [-1.0, -2.0]


def test_per_tensor_scale_current_and_delayed():
    e4m3 = FORMATS["fp8_e4m3"]
    current = PerTensorScale(e4m3, "current", margin=1)
    assert current.scale_for(torch.tensor([-2.0, 1.0])).item() == 448.0 / 2.0 / 2.0
    delayed = PerTensorScale(e4m3, "delayed", history_len=2)
    seen = [delayed.scale_for(torch.tensor([a])).item() for a in (4.0, 1.0, 8.0, 2.0, 1.0)]
    # first call uses its own amax; later ones the max of the previous two amaxes
    assert seen == [448 / 4, 448 / 4, 448 / 4, 448 / 8, 448 / 8]
    assert PerTensorScale(e4m3, pow2=True).scale_for(torch.tensor([3.0])).item() == 128.0  # 149.3 -> 2^7
    assert PerTensorScale(e4m3).scale_for(torch.zeros(2)).item() == 1.0
    assert PerTensorScale(FORMATS["bf16"]).scale_for(torch.tensor([2.0**10])).item() == 2.0**54


@pytest.mark.parametrize("kind", ["none", "dynamic"])
def test_a_step_with_non_finite_gradients_in_two_dtypes_counts_once(kind):
    """fp32 and bf16 gradients both holding inf in the same step: one overflow step, as GradScaler's one
    found_inf per device (a count per dtype group would say two)."""
    p32 = torch.nn.Parameter(torch.zeros(3))
    p16 = torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))
    optimizer = torch.optim.SGD([p32, p16], lr=0.1)
    scaler = LossScaler(kind, init_scale=1.0)
    for g in (INF, 1.0, NAN):
        p32.grad = torch.full((3,), g)
        p16.grad = torch.full((3,), g, dtype=torch.bfloat16)
        scaler.step(optimizer, [p32, p16])
    assert scaler.state()["overflow_steps"] == 2
    assert scaler.state()["skipped_steps"] == (2 if kind == "dynamic" else 0)
