"""Unit scaling: unit-variance outputs and input gradients at initialisation, per layer type; the transform."""

import pytest
import torch
from torch import nn

from bench.tasks.lenet import LeNet5
from bench.unit import UnitConv2d, UnitLinear, UnitMaxPool2d, UnitReLU, unit_cross_entropy, unit_scale


def _stds(layer, x):
    x = x.requires_grad_(True)
    y = layer(x)
    y.backward(torch.randn_like(y))
    return y.std().item(), x.grad.std().item()


@pytest.mark.parametrize("name,layer,shape", [
    ("linear 400->120", UnitLinear(400, 120), (512, 400)),
    ("linear 84->10", UnitLinear(84, 10), (512, 84)),
    ("conv 1->6 5x5", UnitConv2d(1, 6, 5), (64, 1, 32, 32)),
    ("conv 6->16 5x5", UnitConv2d(6, 16, 5), (64, 6, 14, 14)),
    ("conv 16->32 3x3 stride 2", UnitConv2d(16, 32, 3, stride=2, padding=1), (32, 16, 16, 16)),
    ("relu", UnitReLU(), (4096, 64)),
    ("max-pool 2x2", UnitMaxPool2d(2), (64, 6, 28, 28)),
])
def test_output_and_input_gradient_have_unit_scale_at_init(name, layer, shape):
    torch.manual_seed(0)
    out_std, grad_std = _stds(layer, torch.randn(shape))
    assert 0.5 <= out_std <= 2 and 0.5 <= grad_std <= 2, (name, out_std, grad_std)


def test_plain_layers_are_far_from_unit_scale_so_the_test_can_fail():
    torch.manual_seed(0)
    _, grad_std = _stds(nn.Linear(400, 120), torch.randn(512, 400))
    assert grad_std < 0.5


def test_cross_entropy_input_gradient_is_unit_scaled_and_loss_is_the_mean():
    torch.manual_seed(0)
    logits = torch.randn(1024, 10, requires_grad=True)
    targets = torch.randint(0, 10, (1024,))
    loss = unit_cross_entropy(logits, targets)
    assert torch.allclose(loss, nn.functional.cross_entropy(logits, targets))
    loss.backward()
    assert 0.5 <= logits.grad.std().item() <= 2


def test_unit_scale_replaces_every_layer_with_unit_variance_weights():
    model = unit_scale(LeNet5())
    kinds = {type(m) for m in model.modules()}
    assert {UnitConv2d, UnitLinear, UnitReLU, UnitMaxPool2d} <= kinds
    assert not kinds & {nn.Linear, nn.Conv2d, nn.ReLU, nn.MaxPool2d}
    for m in model.modules():
        if isinstance(m, (UnitLinear, UnitConv2d)):
            assert 0.8 < m.weight.std().item() < 1.2 and not m.bias.any()


def test_unknown_parameterised_module_is_refused():
    with pytest.raises(NotImplementedError, match="BatchNorm2d"):
        unit_scale(nn.Sequential(nn.BatchNorm2d(3)))
