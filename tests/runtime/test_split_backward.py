"""A stage's backward split into input gradient (B) and weight gradient (W) gives the whole
backward's gradients, runs the input path once, and K-FAC captures each output gradient once."""

from types import SimpleNamespace

import torch
from torch import nn

from pipefisher.methods.kfac.capture import capture
from pipefisher.runtime.pipeline.split_backward import SplitBackward


class CountingIdentity(torch.autograd.Function):
    """Identity whose backward counts its calls: it sits on the path to the stage input only."""

    calls = 0

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        CountingIdentity.calls += 1
        return grad


class Stage(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.norm, self.fc2 = nn.Linear(4, 6), nn.LayerNorm(6), nn.Linear(6, 3)

    def forward(self, x):
        return self.fc2(self.norm(torch.tanh(self.fc1(CountingIdentity.apply(x)))))


def whole_backward(stage, x, grad):
    stage.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    torch.autograd.backward(stage(x), grad)
    return x.grad, [p.grad.clone() for p in stage.parameters()]


def test_input_then_weight_gradients_equal_the_whole_backward_in_float64():
    torch.manual_seed(0)
    stage = Stage().double()
    inputs, grads = torch.randn(3, 5, 4, dtype=torch.float64), torch.randn(3, 5, 3, dtype=torch.float64)
    expected_inputs, expected = zip(*(whole_backward(stage, x, g) for x, g in zip(inputs, grads)))
    expected_total = [sum(parts) for parts in zip(*expected)]
    for p in stage.parameters():
        p.grad = torch.zeros_like(p)
    split = SplitBackward(stage)
    leaves = [x.clone().requires_grad_(True) for x in inputs]
    outputs = [stage(x) for x in leaves]
    CountingIdentity.calls = 0
    for mb in range(3):
        torch.testing.assert_close(
            split.input_gradient(mb, outputs[mb], grads[mb], leaves[mb]), expected_inputs[mb], rtol=0, atol=1e-12
        )
    assert CountingIdentity.calls == 3 and split.pending == 3
    assert all(p.grad.abs().sum() == 0 for p in stage.parameters()), "B leaves the weight gradients to W"
    for mb in (2, 0, 1):  # W in any order
        split.weight_gradient(mb)
    assert CountingIdentity.calls == 3, "W does not run the input path again"
    assert split.splits and split.pending == 0
    for p, want in zip(stage.parameters(), expected_total):
        torch.testing.assert_close(p.grad, want, rtol=0, atol=1e-12)


def test_a_stage_without_a_differentiable_input_runs_its_whole_backward_at_b():
    torch.manual_seed(1)
    embedding = nn.Embedding(10, 4)
    ids = torch.tensor([1, 2, 3])
    split = SplitBackward(embedding)
    assert split.input_gradient(0, embedding(ids).sum(), None, None) is None
    assert split.splits is False and embedding.weight.grad[1:4].eq(1).all()
    split.weight_gradient(0)
    assert embedding.weight.grad[1:4].eq(1).all(), "W adds nothing"


def test_kfac_records_each_output_gradient_once_when_the_backward_is_split():
    torch.manual_seed(2)
    stage = Stage()
    layers = {
        name: SimpleNamespace(module=module, captures={"A": {}, "B": {}}, loss_scales={})
        for name, module in (("fc1", stage.fc1), ("fc2", stage.fc2))
    }
    split = SplitBackward(stage)
    x = torch.randn(5, 4, requires_grad=True)
    with capture(layers, micro_batch=0):
        output = stage(x)
    split.input_gradient(0, output, torch.ones(5, 3), x)
    assert [len(state.captures["B"][0]) for state in layers.values()] == [1, 1]
    split.weight_gradient(0)
    assert [len(state.captures["B"][0]) for state in layers.values()] == [1, 1]


def test_a_stage_output_that_is_a_view_splits_too():
    torch.manual_seed(3)
    stage = Stage()
    x = torch.randn(2, 5, 4, requires_grad=True)
    output = stage(x).transpose(0, 1)
    split = SplitBackward(stage)
    grad = torch.randn(5, 2, 3)
    split.input_gradient(0, output, grad, x)
    split.weight_gradient(0)
    assert split.splits
    whole = x.detach().clone().requires_grad_(True)
    split_grads = [p.grad.clone() for p in stage.parameters()]
    stage.zero_grad(set_to_none=True)
    torch.autograd.backward(stage(whole).transpose(0, 1), grad)
    for got, p in zip(split_grads, stage.parameters()):
        torch.testing.assert_close(got, p.grad)
