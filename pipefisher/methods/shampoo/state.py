"""Per-matrix Shampoo state and the choice of the parameters Shampoo preconditions."""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from pipefisher.methods.shampoo import health as _health
from pipefisher.methods.blocks import FACTORS, Factor, MatrixInfo, block_views


@dataclass
class Roots:
    """All block roots of one factor: ``value`` the flat 1-D tensor (layout of
    :mod:`pipefisher.methods.blocks`) and ``ok`` a ``(blocks,)`` device bool, False where that
    block never had a valid root (its values are then a NaN placeholder)."""

    value: Tensor
    ok: Tensor


@dataclass
class FactorState:
    """One factor of a matrix: the flat ``statistic`` (all blocks, zeros at first, in the engine's
    ``statistics_dtype``), roots (in the engine's ``dtype``) computed
    or received since the last commit (``pending``), roots in use (``committed``; None before the
    first commit) and device int64 ``counters`` (:mod:`pipefisher.methods.shampoo.health`)."""

    statistic: Tensor
    counters: Tensor
    pending: Roots | None = None
    committed: Roots | None = None


@dataclass
class MatrixState:
    """Everything Shampoo keeps for one matrix parameter; ``captured``: its ``(rows, cols)``
    gradient copy waiting to be folded into the statistics, or None."""

    info: MatrixInfo
    parameter: nn.Parameter
    factors: dict[Factor, FactorState] = field(default_factory=dict)
    captured: Tensor | None = None


def trainable_parameters(module: nn.Module) -> dict[str, nn.Parameter]:
    """Every trainable parameter of ``module`` once, by its first name in ``named_parameters()``."""
    return {name: p for name, p in module.named_parameters() if p.requires_grad}


def owned_parameters(module: nn.Module, skip: Iterable[str], matrices_only: bool) -> dict[str, nn.Parameter]:
    """The parameters whose gradient Shampoo rewrites: every trainable one, or only its matrices."""
    patterns = tuple(skip)
    return {
        name: p for name, p in trainable_parameters(module).items() if not matrices_only or is_matrix(name, p, patterns)
    }


def is_matrix(name: str, parameter: Tensor, skip: Iterable[str]) -> bool:
    """At least 2-D and matching none of the ``skip`` globs (fnmatch, case-sensitive)."""
    return parameter.dim() >= 2 and not any(fnmatch.fnmatchcase(name, pattern) for pattern in skip)


def new_matrix(name: str, parameter: nn.Parameter, block_size: int, statistics_dtype: torch.dtype) -> MatrixState:
    """Zero statistics (in ``statistics_dtype``) and no roots for ``parameter``, on its device."""
    info = MatrixInfo.of(name, tuple(parameter.shape), block_size)
    device = parameter.device
    factors = {
        f: FactorState(
            torch.zeros(info.statistic_numel(f), dtype=statistics_dtype, device=device), _health.zero_counters(device)
        )
        for f in FACTORS
    }
    return MatrixState(info, parameter, factors)


def committed(st: MatrixState) -> bool:
    """Whether the matrix has roots in use of both factors."""
    return all(st.factors[f].committed is not None for f in FACTORS)


def committed_roots(st: MatrixState, factor: Factor) -> Roots:
    """`factor`'s roots in use (RuntimeError before the first commit)."""
    roots = st.factors[factor].committed
    if roots is None:
        raise RuntimeError(f"Shampoo matrix {st.info.name!r}: no committed {factor} roots")
    return roots


def root_views(st: MatrixState, factor: Factor) -> list[Tensor]:
    """The block views of `factor`'s roots in use (RuntimeError before the first commit)."""
    return block_views(committed_roots(st, factor).value, st.info.block_sizes(factor))


def gradient_matrix(st: MatrixState, dtype: torch.dtype) -> Tensor:
    """The matrix's current (unsharded) gradient as ``(rows, cols)`` in `dtype`, contiguous."""
    if st.parameter.grad is None:
        raise RuntimeError(f"Shampoo matrix {st.info.name!r} has no gradient to precondition")
    return st.parameter.grad.detach().to(dtype).reshape(st.info.shape).contiguous()


def roots_or_zeros(st: MatrixState, dtype: torch.dtype) -> list[Tensor]:
    """The flat roots in use of A and B (block layout), zeros where none are committed yet."""
    return [
        fs.committed.value if fs.committed is not None else torch.zeros_like(fs.statistic, dtype=dtype)
        for fs in (st.factors[f] for f in FACTORS)
    ]
