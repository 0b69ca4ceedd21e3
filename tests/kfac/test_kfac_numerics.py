"""Numerical trouble does not crash training; state survives a checkpoint."""

from __future__ import annotations

import copy
import io
import warnings

import pytest
import torch
from torch.nn.functional import mse_loss

from _kfac_models import data, tiny_mlp
from pipefisher.methods.kfac import FACTORS, KFAC, KfacConfig, KFACEngine, KFACNumericsWarning


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


def test_first_finite_factor_after_non_finite_ones_becomes_the_average_as_is():
    x, y = data(8)
    bad = x.clone()
    bad[0, 0] = float("nan")
    model, plain_model = tiny_mlp(), tiny_mlp()
    kfac, plain = KFAC(model, factor_decay=0.5), KFAC(plain_model, factor_decay=0.0)
    with pytest.warns(KFACNumericsWarning):
        refresh(kfac, model, bad, y)
    refresh(kfac, model, x, y)
    refresh(plain, plain_model, x, y)
    first = {(n, f): kfac.engine.factor(n, f).clone() for n in ("0", "2") for f in FACTORS}
    for (n, f), factor in first.items():
        assert torch.equal(factor, plain.engine.factor(n, f)), (n, f)
    with pytest.warns(KFACNumericsWarning):
        refresh(kfac, model, bad, y)
    for (n, f), factor in first.items():
        assert torch.equal(kfac.engine.factor(n, f), factor), (n, f)


def fail_eigh(*args, **kwargs):
    raise torch.linalg.LinAlgError("forced failure")


def test_failed_eigen_decomposition_keeps_the_previous_inverse(monkeypatch):
    model = tiny_mlp()
    kfac = KFAC(model, inverse="eigen")
    refresh(kfac, model, *data(8))
    good = {(n, f): kfac.engine.inverse(n, f).clone() for n in ("0", "2") for f in FACTORS}
    monkeypatch.setattr(torch.linalg, "eigh", fail_eigh)
    with pytest.warns(KFACNumericsWarning) as record:
        refresh(kfac, model, *data(8, seed=2))
    assert "layer '2': eigen inverse of B failed" in messages(record)
    for (n, f), inv in good.items():
        assert torch.equal(kfac.engine.inverse(n, f), inv), (n, f)
    assert kfac.health()["0"].failed_inverse == 2 and kfac.engine.skipped_inversions == 4


_EIGH = torch.linalg.eigh


def invert_layer_2_a(engine, model, monkeypatch, micro_batch: int, fail: bool) -> None:
    """Capture micro-batch `micro_batch`, build and invert layer '2''s A; `fail`: eigh fails."""
    with engine.capture(micro_batch):
        mse_loss(model(data(8, seed=micro_batch)[0]), data(8, seed=micro_batch)[1]).backward()
    engine.curvature("2", "A", micro_batch)
    engine.release("2")
    monkeypatch.setattr(torch.linalg, "eigh", fail_eigh if fail else _EIGH)
    engine.invert("2", "A")


def test_shared_inverse_is_the_one_commit_would_make_active(monkeypatch):
    """Pending if that inversion succeeded, else the one in use, else the identity; a failed
    inversion after a successful one before the commit keeps the successful one."""
    model = tiny_mlp()
    engine = KFACEngine(model, KfacConfig(damping=0.1, inverse="eigen"))

    def invert(mb: int, fail: bool) -> None:
        invert_layer_2_a(engine, model, monkeypatch, mb, fail)

    invert(0, fail=True)
    assert torch.equal(engine.shared_inverse("2", "A"), torch.eye(7, dtype=torch.float64))
    invert(1, fail=False)
    first = engine.shared_inverse("2", "A").clone()
    invert(2, fail=True)
    assert torch.equal(engine.shared_inverse("2", "A"), first)
    engine.commit("2")
    assert torch.equal(engine.inverse("2", "A"), first)
    invert(3, fail=True)
    assert torch.equal(engine.shared_inverse("2", "A"), first)
    buffer = engine.inverse_buffer("2", "A")
    assert (buffer.shape, buffer.dtype) == ((7, 7), torch.float64)
    engine.receive_inverse("2", "A", buffer.copy_(2 * first))
    engine.commit("2")
    assert torch.equal(engine.inverse("2", "A"), 2 * first)


def test_a_fresh_inverse_says_failure_as_nan_and_a_checking_receiver_keeps_its_own(monkeypatch):
    """Gradient workers: a source that keeps no inverse in use sends its pending inverse, or NaN
    where that inversion failed; a receiver that checks keeps the inverse it has."""
    model = tiny_mlp()
    source, worker = (KFACEngine(model, KfacConfig(damping=0.1, inverse="eigen")) for _ in range(2))

    def invert(engine, mb: int, fail: bool) -> None:
        invert_layer_2_a(engine, model, monkeypatch, mb, fail)

    invert(worker, 0, fail=False)
    worker.commit("2")
    kept = worker.inverse("2", "A").clone()
    invert(source, 1, fail=False)
    good = source.fresh_inverse("2", "A")
    assert torch.isfinite(good).all() and torch.equal(good, source.shared_inverse("2", "A"))
    source.discard_inverse("2", "A")
    invert(source, 2, fail=True)
    failed = source.fresh_inverse("2", "A")
    assert torch.isnan(failed).all()
    worker.receive_inverse("2", "A", failed.clone(), checked=True)
    worker.commit("2")
    assert torch.equal(worker.inverse("2", "A"), kept)
    worker.receive_inverse("2", "A", good.clone(), checked=True)
    worker.commit("2")
    assert torch.equal(worker.inverse("2", "A"), good)


def scaled_factors(loss_scale, restore: bool = False) -> dict[tuple[str, str], torch.Tensor]:
    """Factors of one float32 capture of ``mse * loss_scale`` (optionally through a checkpoint
    taken before curvature); a tensor scale is then changed in place as GradScaler.update does."""
    model = tiny_mlp(dtype=torch.float32)
    engine = KFACEngine(model, KfacConfig(factor_decay=0.0))
    x, y = data(8)
    with engine.capture(0, loss_scale):
        loss = mse_loss(model(x.float()), y.float())
        (loss if loss_scale is None else loss * loss_scale).backward()
    if isinstance(loss_scale, torch.Tensor):
        loss_scale.mul_(2.0)
    if restore:
        buffer = io.BytesIO()
        torch.save(engine.state_dict(), buffer)
        buffer.seek(0)
        engine = KFACEngine(copy.deepcopy(model), KfacConfig(factor_decay=0.0))
        engine.load_state_dict(torch.load(buffer))
    for n in ("0", "2"):
        for f in FACTORS:
            engine.curvature(n, f, 0)
            engine.invert(n, f)
    return {(n, f): engine.factor(n, f) for n in ("0", "2") for f in FACTORS}


@pytest.mark.parametrize("restore", [False, True])
@pytest.mark.parametrize("tensor", [False, True])
def test_curvature_under_a_loss_scale_gives_the_factors_of_the_unscaled_loss(tensor, restore):
    scale = torch.full((), 3000.0) if tensor else 3000.0
    unscaled = scaled_factors(None)
    for key, factor in scaled_factors(scale, restore).items():
        torch.testing.assert_close(factor, unscaled[key], rtol=1e-5, atol=1e-7)


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


def test_a_kept_built_factor_inverts_again_to_the_same_inverse():
    """The profiler times the run's `invert` three times on the rows it captured: `built_kept`
    puts the consumed factor back, so each inversion starts from the same statistic."""
    model = tiny_mlp()
    engine = KFACEngine(model, KfacConfig(damping=0.1, inverse="eigen", factor_decay=0.0))
    with engine.capture(0):
        mse_loss(model(data(8, seed=0)[0]), data(8, seed=0)[1]).backward()
    engine.curvature("2", "A", 0)
    engine.release("2")
    inverses = []
    for _ in range(2):
        with engine.built_kept("2", "A"):
            engine.invert("2", "A")
        inverses.append(engine.shared_inverse("2", "A").clone())
    assert engine.built_rows("2", "A") == 8
    assert torch.equal(inverses[0], inverses[1]) and not torch.equal(inverses[0], torch.eye(7, dtype=torch.float64))
