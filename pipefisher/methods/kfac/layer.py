"""Per-layer K-FAC state and the choice of which linear layers get K-FAC: ``nn.Linear`` and
Hugging Face's ``Conv1D`` (GPT-2's linear map, weight stored transposed as (in, out))."""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor, nn

from pipefisher.methods.kfac.factors import factor_dtype
from pipefisher.methods.layers import (
    LayerInfo,
    linear_bias,
    linear_info,
    linear_parameters,
    linear_weight,
    select_linears,
)

__all__ = [
    "FACTORS",
    "BuiltFactor",
    "Factor",
    "Flagged",
    "Health",
    "LayerInfo",
    "LayerState",
    "known_factor",
    "linear_info",
    "preconditioned_parameters",
    "prefer_ok",
    "select_layers",
    "valid",
]

Factor = Literal["A", "B"]
FACTORS: tuple[Factor, Factor] = ("A", "B")


@dataclass
class Health:
    """Numerical trouble seen by one layer; each counter counts ``invert`` calls (host values)."""

    nonfinite_factor: int = 0
    failed_inverse: int = 0
    damping_too_small: int = 0

    @property
    def skipped(self) -> int:
        """Inversions that kept the previous inverse."""
        return self.nonfinite_factor + self.failed_inverse


@dataclass
class BuiltFactor:
    """A factor under construction: ``total`` = Σ over rows of outer products, ``rows`` counted.

    ``sealed`` once the B scaling is applied (first ``sync_tensors`` or ``invert``); no curvature
    after. ``count``: the row count as a float64 (1,) device tensor, set when sealed; the caller's
    replica sum adds into it, and ``invert`` divides by it.
    """

    total: Tensor
    rows: int = 0
    sealed: bool = False
    count: Tensor | None = None


@dataclass
class Flagged:
    """A device tensor with a 0-dim device bool ``ok``: whether ``value`` is valid (else a
    placeholder). Lets the engine decide on the device what the host would branch on."""

    value: Tensor
    ok: Tensor


def prefer_ok(new: Flagged, old: Flagged | None) -> Flagged:
    """``new`` where it is ok, else ``old``, selected on the device (ok if either is); ``new``
    when there is no ``old``."""
    if old is None:
        return new
    return Flagged(torch.where(new.ok, new.value, old.value), new.ok | old.ok)


def known_factor(factor: Factor) -> Factor:
    """`factor` if it is "A" or "B"; ValueError otherwise."""
    if factor not in FACTORS:
        raise ValueError(f"factor must be 'A' or 'B', got {factor!r}")
    return factor


def valid(slot: Flagged | None) -> Tensor | None:
    """The slot's value if it is ok, else None (a host read of the flag: inspection only)."""
    return slot.value if slot is not None and bool(slot.ok) else None


@dataclass
class LayerState:
    """Everything K-FAC keeps for one layer.

    ``captures[factor][micro_batch]``: tensors recorded by hooks (``A``: layer inputs, ``B``: output
    gradients), freed by curvature. ``loss_scales[micro_batch]``: the loss scale of that
    micro-batch's ``B`` records. ``ema``: running factors (not ok before the first finite one).
    ``pending``: inverses computed since the last commit. ``active``: inverses used by precondition
    (missing = identity; not ok = identity value, applied as a skip). ``counters[factor]``: device
    int64 :class:`Health` counters (see :mod:`pipefisher.methods.kfac.health`).
    """

    info: LayerInfo
    module: nn.Module
    dtype: torch.dtype
    captures: dict[Factor, dict[Hashable, list[Tensor]]] = field(default_factory=lambda: {"A": {}, "B": {}})
    loss_scales: dict[Hashable, Tensor | float] = field(default_factory=dict)
    built: dict[Factor, BuiltFactor] = field(default_factory=dict)
    ema: dict[Factor, Flagged] = field(default_factory=dict)
    pending: dict[Factor, Flagged] = field(default_factory=dict)
    active: dict[Factor, Flagged] = field(default_factory=dict)
    counters: dict[Factor, Tensor] = field(default_factory=dict)
    #: factor -> (index, count): this process builds the factor from share `index` of `count` of
    #: each capture's rows (tensor parallelism: the factor is the same on every shard, which sum it)
    row_shares: dict[Factor, tuple[int, int]] = field(default_factory=dict)

    @property
    def weight(self) -> nn.Parameter:
        return linear_weight(self.module)

    @property
    def bias(self) -> nn.Parameter | None:
        return linear_bias(self.module)


def select_layers(model: nn.Module, skip: Iterable[str] = (), max_factor_dim: int = 8192) -> dict[str, LayerState]:
    """K-FAC state for every linear layer of ``model`` (`pipefisher.methods.layers.select_linears`)
    in module order, except those whose name matches a glob in ``skip`` and those with a factor
    larger than ``max_factor_dim`` (e.g. a vocabulary projection). Other modules (embeddings,
    LayerNorm, ...) are left first-order."""
    return {
        name: LayerState(layer.info, layer.module, factor_dtype(linear_weight(layer.module).dtype))
        for name, layer in select_linears(model, skip, max_factor_dim).items()
    }


def preconditioned_parameters(model: nn.Module, skip: Iterable[str] = ()) -> list[str]:
    """Names of the parameters K-FAC rewrites the gradients of: weight and bias of every layer
    `select_layers` picks."""
    return linear_parameters(model, skip, max_size=8192)
