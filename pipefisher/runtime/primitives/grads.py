"""A parameter's gradient where the step has made one, typed (``Tensor.grad`` is optional)."""

from __future__ import annotations

from torch import Tensor


def grad_of(parameter: Tensor) -> Tensor:
    """`parameter`'s gradient; ValueError naming its shape when it has none (a caller that reads
    only parameters with gradients has a bug then)."""
    grad = parameter.grad
    if grad is None:
        raise ValueError(f"a parameter of shape {tuple(parameter.shape)} has no gradient here")
    return grad
