"""Numerical trouble does not crash training; state survives a checkpoint."""

from __future__ import annotations

import copy
import io
import warnings

import pytest
import torch
from torch.nn.functional import mse_loss

from _kfac_models import data, tiny_mlp
from pipefisher.kfac import KFAC, KFACNumericsWarning


def refresh(kfac: KFAC, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    model.zero_grad()
    with kfac.capture():
        mse_loss(model(x), y).backward()
    kfac.update_curvature()
    kfac.update_inverses()


def test_non_finite_factor_keeps_previous_inverse_and_counts():
    model = tiny_mlp()
    x, y = data(8)
    kfac = KFAC(model)
    bad = x.clone()
    bad[0, 0] = float("nan")
    with pytest.warns(KFACNumericsWarning) as record:
        refresh(kfac, model, bad, y)
    assert "layer '0': non-finite A factor; keeping the previous inverse" in messages(record)
    assert kfac.engine.inverse("0", "A") is None and kfac.engine.factor("0", "A") is None
    assert kfac.health()["0"].nonfinite_factor == 2 and kfac.engine.skipped_inversions == 4
    refresh(kfac, model, x, y)
    good = {(n, f): kfac.engine.inverse(n, f).clone() for n in ("0", "2") for f in "AB"}
    with pytest.warns(KFACNumericsWarning):
        refresh(kfac, model, bad, y)
    for (n, f), inv in good.items():
        assert torch.equal(kfac.engine.inverse(n, f), inv)
    assert kfac.engine.skipped_inversions == 8


def messages(record: pytest.WarningsRecorder) -> str:
    return "\n".join(str(w.message) for w in record)


def test_failed_cholesky_keeps_identity_and_warns_while_eigen_copes():
    gen = torch.Generator().manual_seed(0)
    # Inputs of scale 1e6 along one direction: A is rank-1 up to float32 rounding, far larger
    # than sqrt(damping) = 1e-3, so its Cholesky fails; B stays of order 1 and well damped.
    x = torch.randn(1, 8, generator=gen).repeat(16, 1) * 1e6 + torch.randn(16, 8, generator=gen) * 1e-3
    y = torch.randn(16, 2, generator=gen)
    for inverse, failed in (("cholesky", True), ("eigen", False)):
        model = torch.nn.Sequential(torch.nn.Linear(8, 2))
        with torch.no_grad():
            model[0].weight.copy_(torch.randn(2, 8, generator=gen) * 1e-7)
            model[0].bias.zero_()
        kfac = KFAC(model, damping=1e-6, inverse=inverse)
        with pytest.warns(KFACNumericsWarning) as record:
            refresh(kfac, model, x, y)
        assert "layer '0': damping 1e-06 is below torch.float32 resolution for factor A" in messages(record)
        assert ("layer '0': cholesky inverse of A failed" in messages(record)) == failed
        health = kfac.health()["0"]
        assert (health.failed_inverse, health.damping_too_small) == (int(failed), 1)
        assert (kfac.engine.inverse("0", "A") is None) == failed
        assert kfac.engine.inverse("0", "B") is not None
        kfac.precondition()
        assert torch.isfinite(model[0].weight.grad).all()


def test_ordinary_damping_raises_no_warning():
    model = tiny_mlp(dtype=torch.float32)
    x, y = data(8)
    kfac = KFAC(model, damping=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("error", KFACNumericsWarning)
        refresh(kfac, model, x.float(), y.float())
    assert kfac.engine.skipped_inversions == 0


def test_state_dict_round_trip_reproduces_preconditioning():
    model = tiny_mlp()
    kfac = KFAC(model, factor_decay=0.5)
    for seed in (1, 2):
        refresh(kfac, model, *data(8, seed=seed))
    with kfac.capture():
        mse_loss(model(data(8, seed=3)[0]), data(8, seed=3)[1]).backward()
    kfac.update_curvature()  # a factor in construction is part of the state too
    buffer = io.BytesIO()
    torch.save(kfac.state_dict(), buffer)

    clone = copy.deepcopy(model)
    restored = KFAC(clone, factor_decay=0.5)
    buffer.seek(0)
    restored.load_state_dict(torch.load(buffer))
    for p, q in zip(model.parameters(), clone.parameters()):
        q.grad = p.grad.clone()
    for k in (kfac, restored):
        k.update_inverses()
        k.precondition()
    for p, q in zip(model.parameters(), clone.parameters()):
        assert torch.equal(p.grad, q.grad)
    for n in ("0", "2"):
        for f in "AB":
            assert torch.equal(kfac.engine.factor(n, f), restored.engine.factor(n, f))


def test_load_state_dict_rejects_another_model():
    source_model = tiny_mlp()
    source = KFAC(source_model)
    refresh(source, source_model, *data(4))
    renamed = KFAC(torch.nn.Sequential(torch.nn.Linear(4, 6)))
    with pytest.raises(ValueError, match="layers differ"):
        renamed.load_state_dict(source.state_dict())
    resized = KFAC(torch.nn.Sequential(torch.nn.Linear(4, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3)))
    with pytest.raises(ValueError, match=r"layer '0': B has shape \(6, 6\), want \(7, 7\)"):
        resized.load_state_dict(source.state_dict())
