"""Per-matrix SOAP state and the choice of the parameters SOAP preconditions."""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from pipefisher.methods.blocks import FACTORS, Factor, MatrixInfo
from pipefisher.methods.counters import zero_counters
from pipefisher.methods.soap.health import SoapHealth


@dataclass
class FactorState:
    """One side of a matrix (A: left, rows; B: right, columns), flat over its blocks (layout of
    :mod:`pipefisher.methods.blocks`): the ``statistic`` (zeros at first, ``statistics_dtype``),
    its ``snapshot`` as of the refresh cycle's start (None before the first basis), the eigenbases
    in use (``basis``, columns by decreasing eigenvalue; None before the first step) and a
    refreshed basis waiting for the commit (``pending``: the bases, then each block's column order
    as numbers, ``dtype``)."""

    statistic: Tensor
    snapshot: Tensor | None = None
    basis: Tensor | None = None
    pending: Tensor | None = None

    def basis_in_use(self) -> Tensor:
        """`basis`; ValueError before the first one (the caller reads it only once started)."""
        if self.basis is None:
            raise ValueError("SOAP factor has no eigenbasis yet")
        return self.basis


@dataclass
class MatrixState:
    """Everything SOAP keeps for one matrix parameter viewed as ``(rows, cols)``: its factors,
    Adam's first and second moments ``exp_avg`` and ``exp_avg_sq`` with block k in its
    eigenbasis (both ``(rows, cols)``; zero before the first bases), the directions given so far (``updates``,
    the bias correction's t) and device int64 ``counters`` (:mod:`pipefisher.methods.soap.health`)."""

    info: MatrixInfo
    parameter: nn.Parameter
    exp_avg: Tensor
    exp_avg_sq: Tensor
    counters: Tensor
    factors: dict[Factor, FactorState] = field(default_factory=dict)
    updates: int = 0

    @property
    def started(self) -> bool:
        """Whether it has eigenbases (from its first step on)."""
        return self.factors["A"].basis is not None


def bases_or_zeros(st: MatrixState, dtype: torch.dtype) -> list[Tensor]:
    """Each factor's flat eigenbases in use of `st` (`FACTORS` order), zeros before its first
    step (what a helper rotating its gradient holds for a refresh cycle)."""
    return [
        fs.basis
        if fs.basis is not None
        else torch.zeros(st.info.statistic_numel(f), dtype=dtype, device=fs.statistic.device)
        for f, fs in st.factors.items()
    ]


def matrix_parameters(module: nn.Module, skip: Iterable[str]) -> dict[str, nn.Parameter]:
    """Trainable parameters of ``module`` of at least two dimensions, each once under its first
    name, except embedding tables (``nn.Embedding`` weights: a first-order rule takes them) and
    names matching a ``skip`` glob (fnmatch, case-sensitive)."""
    patterns = tuple(skip)
    tables = {id(m.weight) for m in module.modules() if isinstance(m, nn.Embedding)}
    return {
        name: p
        for name, p in module.named_parameters()
        if p.requires_grad
        and p.dim() >= 2
        and id(p) not in tables
        and not any(fnmatch.fnmatchcase(name, g) for g in patterns)
    }


def new_matrix(
    name: str, parameter: nn.Parameter, block_size: int, dtype: torch.dtype, statistics_dtype: torch.dtype
) -> MatrixState:
    """Zero statistics (in ``statistics_dtype``) and moments (in ``dtype``), no eigenbases, for
    ``parameter`` cut into blocks of ``block_size``, on its device."""
    info = MatrixInfo.of(name, tuple(parameter.shape), block_size)
    device = parameter.device
    exp_avg, exp_avg_sq = (torch.zeros(info.shape, dtype=dtype, device=device) for _ in range(2))
    factors = {
        f: FactorState(torch.zeros(info.statistic_numel(f), dtype=statistics_dtype, device=device)) for f in FACTORS
    }
    return MatrixState(info, parameter, exp_avg, exp_avg_sq, zero_counters(SoapHealth, device), factors)


def pending_numel(info: MatrixInfo, factor: Factor) -> int:
    """Elements of a refreshed basis of ``factor`` as exchanged: its block bases, then their orders."""
    return info.statistic_numel(factor) + sum(info.block_sizes(factor))
