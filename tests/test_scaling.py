"""Loss scalers against torch.amp.GradScaler, and the static scaler's skip rule."""

import math

import pytest
import torch
from omegaconf import OmegaConf

from bench.errors import ConfigError
from bench.numerics.formats import FORMATS
from bench.numerics.scaling import LossScaler, PerTensorScale
from bench.tasks.optimizer import build_optimizer

INF, NAN = math.inf, math.nan
# A scripted sequence of gradients: clean runs long enough to grow, inf and NaN in between.
SCRIPT = [1.0, 2.0, INF, 1.0, 1.0, 1.0, NAN, 0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, INF, INF, 1.0, 3.0, 1.0, 1.0]


def _param():
    p = torch.nn.Parameter(torch.zeros(3))
    return p, torch.optim.SGD([p], lr=0.1)


def _optimizers(name):
    """(ours, GradScaler's) optimiser pair over two parameters starting equal. Ours comes from the loop's own
    build_optimizer: fused, so a skip happens inside its kernel, on the device. GradScaler's is the same
    torch optimiser told not to take found_inf, so GradScaler skips it on the host (its route for unfused
    optimisers): the behaviour a device-side skip must reproduce bit for bit."""
    cfg = OmegaConf.create({"name": name, "lr": 0.1, "momentum": 0.9, "beta2": 0.999, "weight_decay": 0.01,
                            "decay_matrices_only": False})
    ours_p, ref_p = (torch.nn.Parameter(torch.linspace(-1, 1, 3)) for _ in range(2))
    ours = build_optimizer(cfg, [ours_p])
    ref = (torch.optim.SGD([ref_p], lr=0.1, momentum=0.9, weight_decay=0.01, fused=True) if name == "sgd"
           else torch.optim.AdamW([ref_p], lr=0.1, weight_decay=0.01, fused=True))
    ref._step_supports_amp_scaling = False
    return ours_p, ours, ref_p, ref


# Clean runs long enough to grow, inf and NaN in between; the second starts with a skipped step (torch's fused
# SGD left its momentum buffer uninitialised there: bench.tasks.optimizer.build_optimizer works around it).
SCRIPTS = {"grows": SCRIPT, "first_step_skipped": [INF, 1.0, 2.0, NAN, 1.0, 1.0, 1.0, 1.0]}


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("init,growth,backoff,interval", [(2.0**16, 2.0, 0.5, 3), (1000.0, 3.0, 0.3, 2)])
def test_dynamic_matches_grad_scaler_step_for_step(init, growth, backoff, interval, optimizer, script):
    ours_p, ours_opt, ref_p, ref_opt = _optimizers(optimizer)
    assert ours_opt.defaults["fused"]
    ours = LossScaler("dynamic", init, growth, backoff, interval)
    ref = torch.amp.GradScaler("cpu", init_scale=init, growth_factor=growth, backoff_factor=backoff,
                               growth_interval=interval)
    for i, g in enumerate(SCRIPTS[script]):
        # d/dp of (p * g).sum() is g: both backpropagate their own scaled loss.
        for p, opt, scaled in ((ours_p, ours_opt, ours.scale_loss), (ref_p, ref_opt, ref.scale)):
            opt.zero_grad()
            scaled((p * torch.full((3,), g)).sum()).backward()
        before_ours, before_ref = ours_p.detach().clone(), ref_p.detach().clone()
        ours.step(ours_opt, [ours_p])
        ours.sync()
        ref.step(ref_opt)
        ref.update()
        ref_stepped = not torch.equal(ref_p.detach(), before_ref)
        assert ref_stepped == math.isfinite(g) == (not ours.last_step_skipped), i
        assert ours.scale == ref.get_scale(), i
        assert torch.equal(ours_p.detach(), ref_p.detach()), i
        assert ref_stepped == (not torch.equal(ours_p.detach(), before_ours))
    assert ours.skipped_steps == sum(not math.isfinite(g) for g in SCRIPTS[script])


def test_counts_and_scale_are_read_once_at_sync_and_survive_a_checkpoint():
    """Steps between syncs leave their flags on the device; one sync folds them all in, in order."""
    p, opt = _param()
    scaler = LossScaler("dynamic", init_scale=8.0, growth_interval=2)
    for g in (1.0, 1.0, INF, 1.0):
        p.grad = torch.full((3,), g)
        scaler.step(opt, [p])
    assert scaler.skipped_steps == 0 and scaler.scale == 8.0  # nothing read yet
    scaler.sync()
    assert scaler.skipped_steps == 1 and scaler.history == [[0, 8.0], [2, 16.0], [3, 8.0]]
    restored = LossScaler("dynamic")
    restored.load_state_dict(scaler.state_dict())
    for s in (scaler, restored):  # one more clean step grows the scale only if the growth tracker survived
        p.grad = torch.full((3,), 1.0)
        s.step(opt, [p])
    assert scaler.state() == restored.state() and restored.scale == 16.0


def test_static_skips_and_counts_overflowing_steps_and_never_changes_scale():
    p, opt = _param()
    scaler = LossScaler("static", init_scale=2048.0)
    for g in (1.0, INF, 1.0, NAN):
        p.grad = torch.full((3,), g * 2048.0)
        scaler.step(opt, [p])
    assert scaler.state()["skipped_steps"] == 2 and scaler.state()["overflow_steps"] == 2 and scaler.scale == 2048.0
    # the two clean steps applied lr * unscaled grad (1.0) each: 0 - 2 * 0.1
    assert torch.allclose(p.detach(), torch.full((3,), -0.2))


def test_none_never_skips_but_counts_overflow():
    p, opt = _param()
    scaler = LossScaler("none")
    p.grad = torch.full((3,), INF)
    scaler.step(opt, [p])
    assert scaler.state()["skipped_steps"] == 0 and p.isinf().all()  # stepped into inf
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


def _drive(scaler, overflows: list[bool]) -> list[float]:
    """Checked steps of a one-parameter SGD with injected gradients (inf on the steps `overflows` marks): the scale
    after each step, read from the device once at the end as the loop reads it."""
    p = torch.nn.Parameter(torch.zeros(4))
    optimizer = torch.optim.SGD([p], lr=0.1, fused=True)
    scales = []
    for overflow in overflows:
        p.grad = torch.full((4,), float("inf") if overflow else 1.0) * scaler.scale_loss(torch.ones(())).detach()
        scaler.step(optimizer, [p])
        scales.append(scaler._on_device["scale"].item())
    scaler.sync()
    return scales


def test_a_hysteresis_rule_is_a_subclass_of_a_few_lines_and_gives_the_hand_computed_scales():
    """DeepSpeed's rule (tests/plugin/hysteresis.py, docs/extending.md) from 2^10, hysteresis 2, growth every 3 clean
    steps: ok, inf, ok, inf, inf, inf, ok, ok, ok. The first overflow after a clean step only spends the allowance;
    the second in a row halves, and every further one; three clean steps double. GradScaler's own rule halves at
    every overflow."""
    from tests.plugin.hysteresis import Hysteresis

    method = Hysteresis(name="hysteresis", loss_scaling="dynamic", init_scale=1024.0, growth_interval=3,
                        options={"hysteresis": 2})
    method.check()
    steps = [False, True, False, True, True, True, False, False, False]
    scaler = method.loss_scaler()
    assert _drive(scaler, steps) == [1024, 1024, 1024, 1024, 512, 256, 256, 256, 512]
    assert scaler.skipped_steps == 4 and scaler.history == [[0, 1024.0], [5, 512.0], [6, 256.0], [9, 512.0]]
    plain = LossScaler("dynamic", 1024.0, growth_interval=3)
    assert _drive(plain, steps) == [1024, 512, 512, 256, 128, 64, 64, 64, 128]
    with pytest.raises(ConfigError, match="hysteresis=0 must be >= 1"):
        Hysteresis(name="hysteresis", loss_scaling="dynamic", options={"hysteresis": 0}).check()


def test_a_rule_that_changes_a_static_scale_unscales_by_the_new_one():
    """The inverse scale is taken from the scale as it is at each step, whatever the kind: a rule doubling a static
    scale every step still leaves every unscaled gradient at its true value (the trap: a stale inverse)."""
    class Doubling(LossScaler):
        def update_scale(self, scale, growth_tracker, found_inf):
            scale.mul_(2)

    scaler = Doubling("static", 8.0)
    p = torch.nn.Parameter(torch.zeros(3))
    optimizer = torch.optim.SGD([p], lr=1.0, fused=True)
    for step in range(4):
        p.grad = scaler.scale_loss(torch.full((3,), 0.5))  # the gradient of a loss scaled by the current scale
        before = p.detach().clone()
        scaler.step(optimizer, [p])
        assert torch.equal(before - p.detach(), torch.full((3,), 0.5)), step


def _scaling_node(**values):
    """A `scaling` node as Hydra composes it: the schema (every built-in knob at its default) and a yaml's keys."""
    from bench.running.config import ScalingConfig

    return OmegaConf.merge(OmegaConf.structured(ScalingConfig), values)


def test_each_method_is_built_with_its_own_frozen_knobs_and_refuses_another_methods():
    from dataclasses import FrozenInstanceError

    from bench.numerics.scaling_methods import PerTensorKnobs, build

    method = build(_scaling_node(name="per_tensor", _target_="bench.numerics.scaling_methods.PerTensor",
                                 amax="delayed", history_len=4))
    assert method.knobs == PerTensorKnobs(amax="delayed", history_len=4)
    with pytest.raises(FrozenInstanceError):
        method.knobs.margin = 3
    unit = build(_scaling_node(name="unit", _target_="bench.numerics.scaling_methods.UnitScaling", lr_rule="relative"))
    assert unit.knobs.lr_rule == "relative" and not hasattr(unit.knobs, "amax")  # another method's default: dropped
    with pytest.raises(ConfigError, match=r"scaling.amax=delayed is not a knob of scaling=dynamic but of "
                                          r"scaling=per_tensor; scaling=dynamic's knobs: backoff_factor, "):
        build(_scaling_node(name="dynamic", _target_="bench.numerics.scaling_methods.LossScaling", amax="delayed"))
    with pytest.raises(ConfigError, match="scaling.lr_rule=relative is not a knob of scaling=umup but of scaling=unit"):
        build(_scaling_node(name="umup", _target_="bench.numerics.scaling_methods.Umup", lr_rule="relative"))


def test_a_user_methods_options_are_validated_and_typed_like_the_schema():
    from bench.numerics.scaling_methods import build

    node = {"name": "hysteresis", "_target_": "tests.plugin.hysteresis.Hysteresis", "loss_scaling": "dynamic"}
    assert build(_scaling_node(**node, options={"hysteresis": "3"})).options.hysteresis == 3  # typed, as Hydra does
    assert build(_scaling_node(**node)).options.hysteresis == 2  # its default
    with pytest.raises(ConfigError, match=r"unknown key scaling.options.hysterisis \(did you mean "
                                          r"scaling.options.hysteresis\?\); scaling=hysteresis's options: hysteresis"):
        build(_scaling_node(**node, options={"hysterisis": 3}))
    with pytest.raises(ConfigError, match="scaling.options of scaling=hysteresis: Value 'abc' of type 'str' could not"):
        build(_scaling_node(**node, options={"hysteresis": "abc"}))
    with pytest.raises(ConfigError, match=r"scaling=dynamic takes no scaling.options \(given: margin\)"):
        build(_scaling_node(name="dynamic", _target_="bench.numerics.scaling_methods.LossScaling",
                            options={"margin": 1}))


def test_a_yaml_whose_name_is_not_its_methods_registered_name_is_refused():
    from bench.numerics.scaling_methods import build

    with pytest.raises(ConfigError, match=r"scaling.name=dynamics \(did you mean scaling.name=dynamic\?\): "
                                          r"bench.numerics.scaling_methods.LossScaling is registered as none, static, "
                                          r"dynamic"):
        build(_scaling_node(name="dynamics", _target_="bench.numerics.scaling_methods.LossScaling"))
    assert build(_scaling_node(name="static", _target_="bench.numerics.scaling_methods.LossScaling")).name == "static"


def test_a_method_that_cannot_be_imported_is_one_message_without_hydras_log_before_it(caplog):
    """Hydra's get_class logs 'Error getting class ...' before it raises; our message says it once (#58)."""
    import logging

    from bench.numerics.scaling_methods import build

    with caplog.at_level(logging.DEBUG), pytest.raises(ConfigError, match=r"scaling._target_=nowhere.Rule cannot "
                                                                          r"be imported"):
        build(_scaling_node(name="rule", _target_="nowhere.Rule"))
    assert not [r for r in caplog.records if r.name.startswith("hydra")], caplog.text
