"""Dense float64 Shampoo maths in NumPy, written independently of the engine, for the tests."""

from __future__ import annotations

import numpy as np
import torch


def as_numpy(t: torch.Tensor) -> np.ndarray:
    return t.detach().to(torch.float64).cpu().numpy()


def inverse_root(s: np.ndarray, epsilon: float, p: int = 4) -> np.ndarray:
    """``(S + ε I)^(-1/p)`` of a symmetric PSD matrix via NumPy's eigendecomposition."""
    w, v = np.linalg.eigh(s + epsilon * np.eye(s.shape[0]))
    return (v * w ** (-1.0 / p)) @ v.T


def gram_inverse_root(g: np.ndarray, epsilon: float, p: int = 4) -> np.ndarray:
    """``(G Gᵀ + ε I)^(-1/p)`` from the SVD of ``G`` (m, n): eigenvalues ``s²``, and exact zeros
    for the ``m - rank`` directions ``G Gᵀ`` does not reach, with no rounded product decomposed."""
    u, s, _ = np.linalg.svd(g, full_matrices=True)
    eigenvalues = np.zeros(g.shape[0])
    eigenvalues[: s.size] = s**2
    return (u * (eigenvalues + epsilon) ** (-1.0 / p)) @ u.T


def shampoo_direction(g: np.ndarray, left: np.ndarray, right: np.ndarray, epsilon: float) -> np.ndarray:
    """``(L + ε I)^(-1/4) G (R + ε I)^(-1/4)``."""
    return inverse_root(left, epsilon) @ g @ inverse_root(right, epsilon)


def one_step_direction(g: np.ndarray, epsilon: float) -> np.ndarray:
    """Shampoo's direction after a single statistics update with ``β = 1``."""
    return shampoo_direction(g, g @ g.T, g.T @ g, epsilon)


def adam_direction(grads: list[np.ndarray], beta2: float, epsilon: float) -> np.ndarray:
    """Adam's momentum-free bias-corrected direction for the last of ``grads`` (one per step)."""
    v = np.zeros_like(grads[0])
    for g in grads:
        v = beta2 * v + (1 - beta2) * g * g
    return grads[-1] / (np.sqrt(v / (1 - beta2 ** len(grads))) + epsilon)


def blocks(m: np.ndarray, rows: tuple[int, ...], cols: tuple[int, ...]) -> list[np.ndarray]:
    """The blocks of ``m`` cut into ``rows`` × ``cols`` chunks, row-major."""
    out = []
    r0 = 0
    for r in rows:
        c0 = 0
        for c in cols:
            out.append(m[r0 : r0 + r, c0 : c0 + c])
            c0 += c
        r0 += r
    return out
