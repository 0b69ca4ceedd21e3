"""Shampoo's preconditioned gradient equals a dense float64 NumPy computation: one layer, blocks,
decayed statistics, grafting."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from rounding import sums_in_two_orders
from _shampoo_dense import (
    adam_direction,
    as_numpy,
    blocks,
    gram_inverse_root,
    inverse_root,
    one_step_direction,
    shampoo_direction,
)
from pipefisher.methods.shampoo import Shampoo

# Per dtype: epsilon and the tolerance of the comparison. In float32 the statistics carry rounding
# of about 1e-7 of their norm, so ε must dominate it for the root to be defined to float32 accuracy.
PRECISION = {torch.float64: (1e-12, 1e-9), torch.float32: (1e-3, 2e-5)}


def set_gradients(model: nn.Module, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    grads = {}
    for name, p in model.named_parameters():
        p.grad = torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.dtype)
        grads[name] = p.grad.clone()
    return grads


def refresh_and_precondition(shampoo: Shampoo) -> None:
    shampoo.update_statistics()
    shampoo.update_roots()
    shampoo.precondition()


def close(actual: torch.Tensor, expected: np.ndarray, rtol: float) -> None:
    """Entrywise within ``rtol`` of the largest expected entry."""
    err = np.abs(as_numpy(actual) - expected).max()
    assert err <= rtol * np.abs(expected).max(), f"max error {err:.3g} vs scale {np.abs(expected).max():.3g}"


@pytest.mark.parametrize("root", ["eigen", "newton"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_one_layer_matches_the_dense_computation(dtype, root):
    """G (5, 7) has rank 5, so R = GᵀG is singular: ε alone bounds its root."""
    epsilon, rtol = PRECISION[dtype]
    layer = nn.Linear(7, 5).to(dtype)
    grads = set_gradients(layer, seed=0)
    shampoo = Shampoo(layer, epsilon=epsilon, root=root, grafting="none", dtype=dtype)
    refresh_and_precondition(shampoo)
    close(layer.weight.grad, one_step_direction(as_numpy(grads["weight"]), epsilon), rtol)
    assert torch.equal(layer.bias.grad, grads["bias"]), "a 1-D parameter without grafting keeps its gradient"


def test_a_singular_statistic_at_the_default_epsilon_matches_the_exact_computation():
    """A 3 x 16 gradient G₀ makes a rank-3 right statistic, whose 13 null directions the default
    ε = 1e-12 scales by ε^(-1/4) = 1000 (and the next gradient has components there). Float32
    gradients and roots with the default float64 statistics: the next gradient's direction equals
    the exact one, built from the SVD of G₀ with no rounded product decomposed."""
    layer = nn.Linear(16, 3, bias=False)
    first = as_numpy(set_gradients(layer, seed=3)["weight"])
    shampoo = Shampoo(layer, grafting="none")
    shampoo.update_statistics()
    shampoo.update_roots()
    second = as_numpy(set_gradients(layer, seed=4)["weight"])
    shampoo.precondition()
    close(layer.weight.grad, gram_inverse_root(first, 1e-12) @ second @ gram_inverse_root(first.T, 1e-12), 1e-5)


@pytest.mark.parametrize("statistics_dtype", [torch.float64, torch.float32])
def test_a_gradient_summed_in_another_order_gives_the_same_direction(statistics_dtype):
    """Replicas sum the micro-batches' gradients in another order than one process does, so the
    captured gradients differ in their last bits. With a singular statistic at the default ε,
    eigenvalues at rounding level count as zero (not as curvature scaled by up to ε^(-1/4)), so
    both orders precondition the next gradient alike."""
    in_sequence, by_halves, following = sums_in_two_orders(3, 16)
    directions = []
    for gradient in (in_sequence, by_halves):
        layer = nn.Linear(16, 3, bias=False)
        layer.weight.grad = gradient.clone()
        shampoo = Shampoo(layer, grafting="none", statistics_dtype=statistics_dtype)
        shampoo.update_statistics()
        shampoo.update_roots()
        layer.weight.grad = following.clone()
        shampoo.precondition()
        directions.append(layer.weight.grad)
    torch.testing.assert_close(directions[0], directions[1], rtol=0, atol=1e-5 * directions[0].abs().max().item())


def test_bfloat16_gradients_are_computed_in_float32_and_written_back_in_bfloat16():
    layer = nn.Linear(6, 4, bias=False).to(torch.bfloat16)
    grads = set_gradients(layer, seed=1)
    shampoo = Shampoo(layer, epsilon=1e-3, grafting="none")
    refresh_and_precondition(shampoo)
    assert layer.weight.grad.dtype == torch.bfloat16
    close(layer.weight.grad, one_step_direction(as_numpy(grads["weight"]), 1e-3), 1e-2)


def test_every_block_matches_its_own_dense_computation():
    model = nn.Sequential(nn.Linear(7, 10), nn.Conv2d(3, 4, 2))
    grads = set_gradients(model.double(), seed=2)
    epsilon = 1e-10
    shampoo = Shampoo(model, epsilon=epsilon, block_size=4, grafting="none", dtype=torch.float64)
    shapes = {i.name: (i.shape, i.row_blocks, i.col_blocks) for i in shampoo.matrices()}
    assert shapes == {"0.weight": ((10, 7), (4, 4, 2), (4, 3)), "1.weight": ((4, 12), (4,), (4, 4, 4))}
    info = shampoo.matrices()[0]
    assert (info.statistic_numel("A"), info.statistic_numel("B"), info.gradient_numel) == (2 * 36, 3 * 25, 70)
    refresh_and_precondition(shampoo)
    for name, (shape, rows, cols) in shapes.items():
        g = as_numpy(grads[name]).reshape(shape)
        out = as_numpy(model.get_parameter(name).grad).reshape(shape)
        for got, gb in zip(blocks(out, rows, cols), blocks(g, rows, cols)):
            np.testing.assert_allclose(got, one_step_direction(gb, epsilon), rtol=1e-8, atol=1e-10)
    assert not np.allclose(as_numpy(model[0].weight.grad), one_step_direction(as_numpy(grads["0.weight"]), epsilon)), (
        "blocked and unblocked Shampoo differ"
    )


@pytest.mark.parametrize("beta2", [0.9, 1.0])
def test_statistics_over_several_steps_follow_the_dense_moving_average(beta2):
    layer = nn.Linear(6, 4, bias=False).double()
    epsilon = 1e-8
    shampoo = Shampoo(layer, beta2=beta2, epsilon=epsilon, grafting="none", dtype=torch.float64)
    left, right = np.zeros((4, 4)), np.zeros((6, 6))
    alpha = 1 - beta2 if beta2 < 1 else 1.0
    for step in range(3):
        g = as_numpy(set_gradients(layer, seed=10 + step)["weight"])
        left, right = beta2 * left + alpha * g @ g.T, beta2 * right + alpha * g.T @ g
        shampoo.update_statistics()
    np.testing.assert_allclose(as_numpy(shampoo.engine.statistics("weight", "A")[0]), left, rtol=1e-13)
    np.testing.assert_allclose(as_numpy(shampoo.engine.statistics("weight", "B")[0]), right, rtol=1e-13)
    shampoo.update_roots()
    np.testing.assert_allclose(as_numpy(shampoo.engine.roots("weight", "A")[0]), inverse_root(left, epsilon), rtol=1e-9)
    shampoo.precondition()
    close(layer.weight.grad, shampoo_direction(g, left, right, epsilon), 1e-10)


def grafted_run(grafting: str, steps: int, start_step: int = 0):
    """``steps`` refresh-and-precondition steps of a blocked two-layer model with graft_beta2 0.9;
    the gradients of each step and the final preconditioned gradients."""
    model = nn.Sequential(nn.Linear(5, 6), nn.Linear(6, 3)).double()
    shampoo = Shampoo(
        model,
        epsilon=1e-8,
        block_size=4,
        grafting=grafting,
        graft_beta2=0.9,
        graft_epsilon=1e-6,
        start_step=start_step,
        dtype=torch.float64,
    )
    history = []
    for step in range(steps):
        history.append({k: as_numpy(g) for k, g in set_gradients(model, seed=20 + step).items()})
        refresh_and_precondition(shampoo)
    out = {name: as_numpy(p.grad) for name, p in model.named_parameters()}
    return shampoo, history, out


def shampoo_reference(history, name: str, rows, cols) -> list[np.ndarray]:
    """Dense per-block Shampoo directions of the last step, statistics summed over ``history``."""
    grads = [blocks(h[name], rows, cols) for h in history]
    result = []
    for k, g in enumerate(grads[-1]):
        left = sum(gs[k] @ gs[k].T for gs in grads)
        right = sum(gs[k].T @ gs[k] for gs in grads)
        result.append(shampoo_direction(g, left, right, 1e-8))
    return result


@pytest.mark.parametrize("grafting", ["adam", "sgd"])
def test_grafting_gives_each_block_the_graft_norm_along_the_shampoo_direction(grafting):
    shampoo, history, out = grafted_run(grafting, steps=3)
    checked = 0
    for info in shampoo.matrices():
        name = info.name
        if grafting == "adam":
            graft = adam_direction([h[name] for h in history], 0.9, 1e-6)
        else:
            graft = history[-1][name]
        rows, cols = info.row_blocks, info.col_blocks
        for got, g_block, s_block in zip(
            blocks(out[name], rows, cols), blocks(graft, rows, cols), shampoo_reference(history, name, rows, cols)
        ):
            assert np.linalg.norm(got) == pytest.approx(np.linalg.norm(g_block), rel=1e-10)
            np.testing.assert_allclose(got / np.linalg.norm(got), s_block / np.linalg.norm(s_block), atol=1e-10)
            checked += 1
    assert checked == 2 * 2 + 1 * 2
    for bias in ("0.bias", "1.bias"):
        expected = adam_direction([h[bias] for h in history], 0.9, 1e-6) if grafting == "adam" else history[-1][bias]
        np.testing.assert_allclose(out[bias], expected, rtol=1e-12)


def test_before_start_step_and_before_any_roots_the_graft_direction_is_used_alone():
    for steps in (1, 2):
        _, history, out = grafted_run("adam", steps=steps, start_step=2)
        for name, got in out.items():
            np.testing.assert_allclose(got, adam_direction([h[name] for h in history], 0.9, 1e-6), rtol=1e-12)
    _, history, out = grafted_run("adam", steps=3, start_step=2)
    weight = out["0.weight"]
    assert not np.allclose(weight, adam_direction([h["0.weight"] for h in history], 0.9, 1e-6))

    model = nn.Linear(4, 3).double()
    shampoo = Shampoo(model, grafting="adam", graft_beta2=0.9, graft_epsilon=1e-6, dtype=torch.float64)
    grads = {k: as_numpy(g) for k, g in set_gradients(model, seed=3).items()}
    shampoo.update_statistics()
    shampoo.precondition()  # statistics but no committed roots
    np.testing.assert_allclose(as_numpy(model.weight.grad), adam_direction([grads["weight"]], 0.9, 1e-6), rtol=1e-12)


def test_tied_parameters_count_once_and_skip_globs_leave_parameters_to_grafting():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2))
    model[1].weight = model[0].weight
    shampoo = Shampoo(model, skip=["2.*"])
    assert [i.name for i in shampoo.matrices()] == ["0.weight"]
    model.zero_grad()
    model(torch.randn(3, 4)).sum().backward()
    tied_grad, skipped_grad = model[0].weight.grad.clone(), model[2].weight.grad.clone()
    shampoo.update_statistics()
    shampoo.update_roots()
    shampoo.precondition()
    assert not torch.allclose(model[0].weight.grad, tied_grad)
    # Adam's first bias-corrected step: G / (|G| + ε)
    torch.testing.assert_close(model[2].weight.grad, skipped_grad / (skipped_grad.abs() + 1e-8))
