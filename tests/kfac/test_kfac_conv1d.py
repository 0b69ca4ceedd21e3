"""K-FAC on Hugging Face's Conv1D (GPT-2's linear map, weight stored (in, out)) is K-FAC on the
same map as an nn.Linear: the same factors, the same preconditioned gradient, transposed."""

import pytest
import torch
from torch.nn.functional import mse_loss

from _kfac_models import data, reference_factors, tiny_mlp
from pipefisher.methods.kfac import KFAC

pytorch_utils = pytest.importorskip("transformers.pytorch_utils")


def as_conv1d(model: torch.nn.Sequential) -> torch.nn.Sequential:
    """`model` (Linear, Tanh, Linear) with each Linear as a Conv1D holding the transposed weight."""
    layers = []
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            conv = pytorch_utils.Conv1D(layer.out_features, layer.in_features).to(layer.weight.dtype)
            with torch.no_grad():
                conv.weight.copy_(layer.weight.T)
                conv.bias.copy_(layer.bias)
            layer = conv
        layers.append(layer)
    return torch.nn.Sequential(*layers)


def test_conv1d_layers_get_the_factors_and_preconditioned_gradient_of_their_linear_twins():
    linear = tiny_mlp()
    conv = as_conv1d(linear)
    x, y = data(8, tokens=3)
    preconditioners = {}
    for name, model in (("linear", linear), ("conv", conv)):
        kfac = KFAC(model, damping=0.01, factor_decay=0.0)
        with kfac.capture():
            mse_loss(model(x), y).backward()
        kfac.update_curvature()
        kfac.update_inverses()
        kfac.precondition(1.0)
        preconditioners[name] = kfac
    assert [info.transposed for info in preconditioners["conv"].layers()] == [True, True]
    expected = reference_factors(linear, x, y)
    for layer in ("0", "2"):
        for index, factor in enumerate("AB"):
            torch.testing.assert_close(preconditioners["conv"].engine.factor(layer, factor), expected[layer][index])
    for twin_linear, twin_conv in zip(linear, conv):
        if isinstance(twin_linear, torch.nn.Linear):
            torch.testing.assert_close(twin_conv.weight.grad, twin_linear.weight.grad.T)
            torch.testing.assert_close(twin_conv.bias.grad, twin_linear.bias.grad)
