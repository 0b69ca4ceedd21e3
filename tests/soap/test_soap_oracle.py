"""SOAP's single-process front equals `pytorch_optimizer.SOAP` (installed with the test extras),
read as the oracle: the first step takes the eigenbases and makes no step; then per 2-D weight
Adam in the eigenbasis of the statistics GGᵀ and GᵀG (first moment in the original basis, second
in the rotated one), bias correction, the step, then decoupled weight decay; after every
precondition_frequency-th step one power-iteration step with QR from the basis in use, the second
moment's rows and columns following the new column order.

The model: y = W2 tanh(W1 x), W1 8 x 8 (one block), W2 16 x 8 cut into two 8 x 8 blocks by
block_size 8; the oracle steps the blocks as two parameters (it does not block). Each step has
its own batch (with one batch the second step's gradient would be the first one's, whose
projection on the eigenbases of its own statistics is diagonal: off the diagonal Adam would
divide rounding by rounding in both optimizers). Weights are square and the batches larger than
8 so that the statistics are regular: the eigenbasis of a null space is the oracle's choice by
rounding, and SOAP's a fixed function of the statistic (`pipefisher.methods.soap.basis`)."""

import pytest
import torch
from pytorch_optimizer import SOAP as OracleSOAP
from torch import nn

from pipefisher.methods.soap import SOAP

STEPS, FREQUENCY, LR, WEIGHT_DECAY = 25, 5, 1e-2, 0.01


def batches(dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [
        (torch.randn(64, 8, generator=gen, dtype=dtype), torch.randn(64, 16, generator=gen, dtype=dtype))
        for _ in range(STEPS)
    ]


def loss(w1: torch.Tensor, w2: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return ((torch.tanh(x @ w1.T) @ w2.T - y) ** 2).mean()


def train(dtype: torch.dtype, **changes) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Both optimizers from the same weights over the same batches: per step (ours, oracle's)
    weights, each flattened and concatenated."""
    gen = torch.Generator().manual_seed(0)
    w1, w2 = (torch.randn(shape, generator=gen, dtype=dtype) / 3 for shape in ((8, 8), (16, 8)))
    ours = nn.ParameterDict({"w1": nn.Parameter(w1.clone()), "w2": nn.Parameter(w2.clone())})
    theirs = [nn.Parameter(w1.clone()), nn.Parameter(w2[:8].clone()), nn.Parameter(w2[8:].clone())]
    soap = SOAP(
        ours, lr=LR, weight_decay=WEIGHT_DECAY, precondition_frequency=FREQUENCY, block_size=8, dtype=dtype, **changes
    )
    oracle = OracleSOAP(theirs, lr=LR, weight_decay=WEIGHT_DECAY, precondition_frequency=FREQUENCY)
    history: tuple[list, list] = ([], [])
    for batch in batches(dtype):
        soap.zero_grad()
        oracle.zero_grad()
        loss(ours["w1"], ours["w2"], batch).backward()
        loss(theirs[0], torch.cat(theirs[1:]), batch).backward()
        soap.step()
        oracle.step()
        history[0].append(torch.cat([p.detach().flatten() for p in ours.values()]))
        history[1].append(torch.cat([p.detach().flatten() for p in theirs]))
    return history


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 2e-6), (torch.float64, 1e-6)])
def test_soap_equals_pytorch_optimizer_over_several_refreshes(dtype, atol):
    """Four refreshes in 25 steps; float64 differs by the oracle's float32 QR."""
    ours, oracle = train(dtype)
    assert torch.equal(ours[0], oracle[0]), "the first step makes no step"
    assert (oracle[-1] - oracle[0]).abs().max() > 0.2, "the weights moved"
    for step, (mine, theirs) in enumerate(zip(ours, oracle)):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=atol, msg=lambda text, step=step: f"step {step}: {text}")


def test_the_comparison_sees_a_refresh_that_keeps_the_second_moment_in_its_old_order(monkeypatch):
    """Not vacuous: SOAP without the reordering of the second moment at a refresh leaves the
    oracle after the first refresh."""
    from pipefisher.methods.soap import engine

    monkeypatch.setattr(engine.SoapEngine, "commit", _commit_without_reordering)
    ours, oracle = train(torch.float32)
    assert (ours[FREQUENCY] - oracle[FREQUENCY]).abs().max() < 2e-6, "equal up to the first refresh"
    assert (ours[-1] - oracle[-1]).abs().max() > 1e-4


def _commit_without_reordering(self):
    for st in self._matrices.values():
        for factor, fs in st.factors.items():
            if fs.pending is not None:
                fs.basis, fs.pending = fs.pending[: st.info.statistic_numel(factor)].clone(), None
