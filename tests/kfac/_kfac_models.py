"""Tiny models and explicit float64 reference factors for the K-FAC tests."""

from __future__ import annotations

import torch
from torch import Tensor


def tiny_mlp(bias: bool = True, dtype: torch.dtype = torch.float64, seed: int = 0) -> torch.nn.Sequential:
    """Linear(4, 6) -> tanh -> Linear(6, 3); its K-FAC layers are named "0" and "2"."""
    gen = torch.Generator().manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6, bias=bias), torch.nn.Tanh(), torch.nn.Linear(6, 3, bias=bias)).to(
        dtype
    )
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=dtype) / p.shape[-1] ** 0.5)
    return model


def data(n: int, seed: int = 1, tokens: int | None = None) -> tuple[Tensor, Tensor]:
    """Inputs (n[, tokens], 4) and targets (n[, tokens], 3) in float64."""
    gen = torch.Generator().manual_seed(seed)
    lead = (n,) if tokens is None else (n, tokens)
    return (
        torch.randn(*lead, 4, generator=gen, dtype=torch.float64),
        torch.randn(*lead, 3, generator=gen, dtype=torch.float64),
    )


def reference_factors(model: torch.nn.Sequential, x: Tensor, y: Tensor) -> dict[str, tuple[Tensor, Tensor]]:
    """Explicit ``A = mean_r [a_r;1][a_r;1]ᵀ`` and ``B = mean_r ∇ℓ_r ∇ℓ_rᵀ`` per layer, float64.

    Rows r are examples (tokens for 3-d input); ``ℓ_r = |f(x_r) - y_r|² / C`` is the per-row loss
    whose mean is ``mse_loss(reduction="mean")``; ``∇ℓ_r`` is taken w.r.t. the layer's output
    by a functional forward of each row alone (no hooks).
    """
    lin0, lin2 = model[0], model[2]
    xs, ys = x.reshape(-1, x.shape[-1]), y.reshape(-1, y.shape[-1])
    a0, a2, e0, e2 = [], [], [], []
    for xr, yr in zip(xs, ys):
        h = torch.nn.functional.linear(xr, lin0.weight.detach(), _det(lin0.bias)).requires_grad_()
        z = torch.tanh(h)
        o = torch.nn.functional.linear(z, lin2.weight.detach(), _det(lin2.bias))
        loss = ((o - yr) ** 2).sum() / yr.numel()
        g_h, g_o = torch.autograd.grad(loss, [h, o])
        a0.append(_with_one(xr, lin0.bias is not None))
        a2.append(_with_one(z.detach(), lin2.bias is not None))
        e0.append(g_h)
        e2.append(g_o)
    return {"0": (_mean_outer(a0), _mean_outer(e0)), "2": (_mean_outer(a2), _mean_outer(e2))}


def _det(t: Tensor | None) -> Tensor | None:
    return None if t is None else t.detach()


def _with_one(v: Tensor, bias: bool) -> Tensor:
    return torch.cat([v, v.new_ones(1)]) if bias else v


def _mean_outer(vs: list[Tensor]) -> Tensor:
    return sum(torch.outer(v, v) for v in vs) / len(vs)


def vec(g: Tensor) -> Tensor:
    """Column-major vectorisation, so that ``(A ⊗ B) vec(G) = vec(B G Aᵀ)`` with ``torch.kron``."""
    return g.T.reshape(-1)


def layer_grad(layer: torch.nn.Linear) -> Tensor:
    """``[∇W, ∇b]`` as one (dout, din[+1]) matrix."""
    g = layer.weight.grad
    return g if layer.bias is None else torch.cat([g, layer.bias.grad[:, None]], 1)
