"""pytorch-optimizer's ``Shampoo`` (version 4.1) as an independent oracle for several SGD steps.

What it computes per parameter (``pytorch_optimizer/optimizer/shampoo.py``): for a gradient of
order k, each dimension d has a statistic initialised to ``matrix_eps · I`` to which every step
adds the plain sum ``G_(d) G_(d)ᵀ`` (no decay); with ``preconditioning_compute_steps = 1`` its
inverse ``2k``-th root is recomputed every step, after that step's statistics update, by an SVD
(in float64 for float64 statistics); the update is ``-lr · L^(-1/4) G R^(-1/4)`` for a matrix
(k = 2), without grafting and without blocking; momentum and weight decay are off at 0.

Agreeing settings on our side: ``beta2 = 1`` (plain sum), ``epsilon = matrix_eps`` (our root of
``S + ε I`` with S the plain sum is its root of ``ε I + S``), no grafting, roots refreshed and
committed every step, a block size above every dimension, float64, and ``torch.optim.SGD`` with
the same lr. Differences kept out of the comparison: it preconditions a 1-D bias with the inverse
square root of a full ``n × n`` statistic, while ours leaves 1-D parameters to grafting (here the
plain gradient), so the biases are given to ``torch.optim.SGD`` on its side too.
"""

from __future__ import annotations

import copy

import torch
from pytorch_optimizer import Shampoo as ReferenceShampoo
from torch import nn
from torch.nn.functional import mse_loss

from pipefisher.methods.shampoo import Shampoo

LR = 0.05
EPS = 1e-6


def test_shampoo_matches_pytorch_optimizer_over_several_steps():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    reference = copy.deepcopy(model)
    x, y = torch.randn(16, 6, dtype=torch.float64), torch.randn(16, 3, dtype=torch.float64)

    shampoo = Shampoo(model, beta2=1.0, epsilon=EPS, grafting="none", dtype=torch.float64)
    sgd = torch.optim.SGD(model.parameters(), lr=LR)
    weights = [p for p in reference.parameters() if p.dim() == 2]
    biases = [p for p in reference.parameters() if p.dim() == 1]
    reference_optimizers = [
        ReferenceShampoo(
            weights, lr=LR, momentum=0.0, weight_decay=0.0, preconditioning_compute_steps=1, matrix_eps=EPS
        ),
        torch.optim.SGD(biases, lr=LR),
    ]

    start = [p.detach().clone() for p in model.parameters()]
    for _ in range(5):
        sgd.zero_grad()
        mse_loss(model(x), y).backward()
        shampoo.update_statistics()
        shampoo.update_roots()
        shampoo.precondition()
        sgd.step()

        for opt in reference_optimizers:
            opt.zero_grad()
        mse_loss(reference(x), y).backward()
        for opt in reference_optimizers:
            opt.step()

        for ours, theirs in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-12)
    moved = [torch.linalg.vector_norm(p - s) for p, s in zip(model.parameters(), start)]
    assert min(moved) > 1e-3, "the parameters moved, so the comparison is not vacuous"
