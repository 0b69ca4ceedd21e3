"""K-FAC maths against explicit float64 computations on tiny layers."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.nn.functional import mse_loss

from _kfac_models import data, layer_grad, reference_factors, tiny_mlp, vec
from pipefisher.methods.kfac import KFAC
from pipefisher.methods.kfac.factors import damped_inverse


def refreshed(model, x, y, **kwargs) -> KFAC:
    """KFAC over ``model`` after one capture/curvature/inverse refresh on (x, y); grads kept."""
    kfac = KFAC(model, **{"factor_decay": 0.0, **kwargs})
    model.zero_grad()
    with kfac.capture():
        mse_loss(model(x), y).backward()
    kfac.update_curvature()
    kfac.update_inverses()
    return kfac


def test_same_shape_layers_are_preconditioned_as_one_stack_like_one_at_a_time():
    """Three (6, 6) layers with biases, one without and a (3, 6) head: the stacked step (one
    batched product per inverse for the biased (6, 6) layers) gives each layer's gradients and
    ``⟨G̃, G⟩`` as preconditioning it alone does (KL clipping then scales them all alike)."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6), nn.Linear(6, 6, bias=False)
    )
    model = nn.Sequential(*model, nn.Linear(6, 3)).double()
    generator = torch.Generator().manual_seed(1)
    x, y = (torch.randn(16, n, generator=generator, dtype=torch.float64) for n in (6, 3))
    engine = refreshed(model, x, y, kl_clip=1e-3).engine
    raw = [p.grad.clone() for p in model.parameters()]
    names = [info.name for info in engine.layers()]
    report = engine.precondition_all(lr=0.1)
    together = {name: [g.clone() for g in engine.gradients(name)] for name in names}
    for p, grad in zip(model.parameters(), raw):
        p.grad.copy_(grad)
    singles = [engine.precondition(name) for name in names]
    assert len(names) == 5 and all(vg is not None for vg in singles)
    assert report.vg_sum is not None and report.clip_scale is not None and report.clip_scale < 1
    torch.testing.assert_close(report.vg_sum, torch.stack(singles).sum(), rtol=1e-12, atol=0)
    for name in names:
        for mine, theirs in zip(together[name], engine.gradients(name), strict=True):
            torch.testing.assert_close(mine, theirs * report.clip_scale, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("tokens", [None, 5])
def test_factors_equal_explicit_means(bias, tokens):
    model = tiny_mlp(bias)
    x, y = data(12, tokens=tokens)
    kfac = refreshed(model, x, y)
    for name, (a_ref, b_ref) in reference_factors(model, x, y).items():
        assert kfac.engine.factor(name, "A").shape == a_ref.shape
        torch.testing.assert_close(kfac.engine.factor(name, "A"), a_ref, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(kfac.engine.factor(name, "B"), b_ref, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("inverse", ["eigen", "cholesky"])
def test_preconditioned_gradient_solves_damped_kronecker_system(bias, inverse):
    damping = 0.05
    model = tiny_mlp(bias)
    x, y = data(16)
    kfac = refreshed(model, x, y, damping=damping, inverse=inverse)
    refs = reference_factors(model, x, y)
    grads = {name: layer_grad(model[int(name)]).clone() for name in refs}
    kfac.precondition()
    for name, (a_ref, b_ref) in refs.items():
        shift = math.sqrt(damping)
        kron = torch.kron(
            a_ref + shift * torch.eye(len(a_ref), dtype=a_ref.dtype),
            b_ref + shift * torch.eye(len(b_ref), dtype=b_ref.dtype),
        )
        expected = torch.linalg.solve(kron, vec(grads[name]))
        torch.testing.assert_close(vec(layer_grad(model[int(name)])), expected, rtol=1e-9, atol=1e-12)


def test_frozen_bias_counts_as_a_zero_gradient_column():
    model = tiny_mlp()
    model[2].bias.requires_grad_(False)
    x, y = data(16)
    kfac = refreshed(model, x, y)
    grad = torch.cat([model[2].weight.grad, torch.zeros(3, 1, dtype=torch.float64)], 1)
    kfac.precondition()
    expected = kfac.engine.inverse("2", "B") @ grad @ kfac.engine.inverse("2", "A")
    torch.testing.assert_close(model[2].weight.grad, expected[:, :6], rtol=1e-12, atol=1e-15)
    assert model[2].bias.grad is None


def test_eigen_and_cholesky_agree_on_well_conditioned_factors():
    gen = torch.Generator().manual_seed(3)
    m = torch.randn(40, 20, generator=gen)
    factor = m.T @ m / 40 + 0.5 * torch.eye(20)
    eig, eig_ok = damped_inverse(factor, 1e-2, "eigen")
    chol, chol_ok = damped_inverse(factor, 1e-2, "cholesky")
    assert eig_ok and chol_ok
    torch.testing.assert_close(eig, chol, rtol=1e-4, atol=1e-5)
    exact = torch.linalg.inv(factor.double() + 0.1 * torch.eye(20, dtype=torch.float64))
    torch.testing.assert_close(eig.double(), exact, rtol=1e-4, atol=1e-5)


def test_engines_with_eigen_and_cholesky_precondition_alike_in_float32():
    x, y = data(32)
    out = {}
    for inverse in ("eigen", "cholesky"):
        model = tiny_mlp(dtype=torch.float32)
        refreshed(model, x.float(), y.float(), inverse=inverse, damping=1e-2).precondition()
        out[inverse] = [p.grad.clone() for p in model.parameters()]
    for g_eig, g_chol in zip(out["eigen"], out["cholesky"]):
        torch.testing.assert_close(g_eig, g_chol, rtol=1e-4, atol=1e-6)


def test_eigen_inverse_clamps_negative_eigenvalues_at_zero():
    q, _ = torch.linalg.qr(torch.randn(3, 3, generator=torch.Generator().manual_seed(5), dtype=torch.float64))
    evals = torch.tensor([-1.0, 0.5, 2.0], dtype=torch.float64)
    factor = q @ torch.diag(evals) @ q.T
    damping = 0.04
    expected = q @ torch.diag(1.0 / (evals.clamp(min=0) + 0.2)) @ q.T
    inverse, ok = damped_inverse(factor, damping, "eigen")
    assert ok
    torch.testing.assert_close(inverse, expected, rtol=1e-10, atol=1e-12)
    assert not damped_inverse(factor, damping, "cholesky")[1]


def test_factor_decay_folds_fresh_factor_into_running_average():
    decay = 0.7
    model = tiny_mlp()
    (x1, y1), (x2, y2) = data(10, seed=1), data(10, seed=2)
    kfac = KFAC(model, factor_decay=decay)
    for x, y in ((x1, y1), (x2, y2)):
        with kfac.capture():
            mse_loss(model(x), y).backward()
        kfac.update_curvature()
        kfac.update_inverses()
    first, second = reference_factors(model, x1, y1), reference_factors(model, x2, y2)
    for name in first:
        for i, factor in enumerate("AB"):
            expected = decay * first[name][i] + (1 - decay) * second[name][i]
            torch.testing.assert_close(kfac.engine.factor(name, factor), expected)


def test_low_precision_model_keeps_factors_and_inverses_in_float32():
    model = tiny_mlp(dtype=torch.bfloat16)
    x, y = data(16)
    kfac = refreshed(model, x.bfloat16(), y.bfloat16())
    a = kfac.engine.factor("0", "A")
    assert a.dtype == torch.float32 and kfac.engine.inverse("0", "A").dtype == torch.float32
    rows = torch.cat([x.bfloat16().double(), torch.ones(16, 1, dtype=torch.float64)], 1)
    torch.testing.assert_close(a.double(), rows.T @ rows / 16, rtol=1e-6, atol=1e-6)
    kfac.precondition()
    assert all(p.grad.dtype == torch.bfloat16 and torch.isfinite(p.grad).all() for p in model.parameters())


def test_kl_clip_rescales_all_preconditioned_gradients_by_the_kl_bound():
    x, y = data(16)
    lr, kl_clip = 0.5, 1e-4
    plain, clipped = tiny_mlp(), tiny_mlp()
    raw = refreshed(clipped, x, y, kl_clip=kl_clip)
    grads = [p.grad.clone() for p in clipped.parameters()]
    refreshed(plain, x, y).precondition()
    report = raw.precondition(lr)
    vg = sum((p.grad * g).sum() for p, g in zip(plain.parameters(), grads)).item()
    nu = math.sqrt(kl_clip / (lr * lr * vg))
    assert nu < 1.0
    assert float(report.vg_sum) == pytest.approx(vg, rel=1e-12)
    assert float(report.clip_scale) == pytest.approx(nu, rel=1e-12)
    for p_clip, p_plain in zip(clipped.parameters(), plain.parameters()):
        torch.testing.assert_close(p_clip.grad, nu * p_plain.grad)


def test_only_linear_layers_within_the_size_limit_and_not_skipped_are_preconditioned():
    torch.manual_seed(0)
    model = torch.nn.ModuleDict(
        {
            "embed": torch.nn.Embedding(10, 8),
            "norm": torch.nn.LayerNorm(8),
            "hidden": torch.nn.Linear(8, 16),
            "head": torch.nn.Linear(16, 4, bias=False),
            "vocab": torch.nn.Linear(16, 100),
        }
    ).double()
    kfac = KFAC(model, skip=["he*"], max_factor_dim=64, factor_decay=0.0)
    assert [(i.name, i.a_size, i.b_size) for i in kfac.layers()] == [("hidden", 9, 16)]
    tokens = torch.randint(0, 10, (6, 3))

    def loss() -> torch.Tensor:
        h = torch.tanh(model["hidden"](model["norm"](model["embed"](tokens))))
        return model["vocab"](h).logsumexp(-1).mean() + model["head"](h).pow(2).mean()

    with kfac.capture():
        loss().backward()
    kfac.update_curvature()
    kfac.update_inverses()
    before = {n: p.grad.clone() for n, p in model.named_parameters()}
    kfac.precondition()
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, before[n]) == (not n.startswith("hidden")), n


@pytest.mark.parametrize(
    "kwargs",
    [
        {"damping": 0.0},
        {"damping": -1.0},
        {"damping": float("nan")},
        {"damping": 1e-100},
        {"factor_decay": 1.0},
        {"inverse": "qr"},
        {"kl_clip": 0.0},
        {"grad_scale": -2.0},
    ],
)
def test_invalid_configuration_is_rejected(kwargs):
    with pytest.raises(ValueError):
        KFAC(tiny_mlp(), **kwargs)
