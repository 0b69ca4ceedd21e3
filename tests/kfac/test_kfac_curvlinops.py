"""Factors against an independent library: curvlinops' KFAC (empirical Fisher, MSE loss), both
of its approximations for layers applied at every position of a sequence (expand, reduce).

Install without dependencies (a plain install replaces the CPU torch):
``pip install --no-deps curvlinops-for-pytorch einconv linear_operator opt-einsum einops scipy tqdm``.

Scaling: with ``MSELoss(reduction="mean")`` over C outputs our per-row loss is ``|f - y|² / C``
(the loss is their mean); curvlinops scales the loss by ``sqrt(C)`` to count each output as a
term, so its gradient covariance is ``C`` times our B. Its input covariance equals our A when
``separate_weight_and_bias=False`` (bias as a trailing one).
"""

from __future__ import annotations

import pytest
import torch

from _kfac_models import data, tiny_mlp
from pipefisher.methods.kfac import KFAC

curvlinops = pytest.importorskip(
    "curvlinops",
    reason="curvlinops-for-pytorch not installed (pip install --no-deps curvlinops-for-pytorch "
    "einconv linear_operator opt-einsum einops scipy tqdm)",
)


@pytest.mark.parametrize("approximation", ["expand", "reduce"])
@pytest.mark.parametrize("tokens", [None, 5])
def test_factors_match_curvlinops_kfac(tokens, approximation):
    model = tiny_mlp()
    x, y = data(16, seed=4, tokens=tokens)
    kfac = KFAC(model, factor_decay=0.0, approximation=approximation)
    with kfac.capture():
        torch.nn.functional.mse_loss(model(x), y).backward()
    kfac.update_curvature()
    kfac.update_inverses()

    op = curvlinops.KFACLinearOperator(
        model,
        torch.nn.MSELoss(reduction="mean"),
        list(model.parameters()),
        [(x, y)],
        fisher_type="empirical",
        kfac_approx=approximation,
        separate_weight_and_bias=False,
        check_deterministic=False,
    )
    op.compute_kronecker_factors()
    theirs = op.state_dict()
    outputs = y.shape[-1]
    for name in ("0", "2"):
        torch.testing.assert_close(kfac.engine.factor(name, "A"), theirs["input_covariances"][name])
        torch.testing.assert_close(outputs * kfac.engine.factor(name, "B"), theirs["gradient_covariances"][name])
