"""Per-layer K-FAC state and the choice of which ``nn.Linear`` layers get K-FAC."""

from __future__ import annotations

import fnmatch
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor, nn

from pipefisher.kfac.factors import factor_dtype

Factor = Literal["A", "B"]
FACTORS: tuple[Factor, Factor] = ("A", "B")


@dataclass(frozen=True)
class LayerInfo:
    """A K-FAC layer as the planner sees it: ``a_size = din + has_bias`` (A), ``b_size = dout`` (B)."""

    name: str
    in_features: int
    out_features: int
    has_bias: bool

    @property
    def a_size(self) -> int:
        return self.in_features + int(self.has_bias)

    @property
    def b_size(self) -> int:
        return self.out_features

    def size(self, factor: Factor) -> int:
        return self.a_size if factor == "A" else self.b_size


@dataclass
class Health:
    """Numerical trouble seen by one layer; each counter counts ``invert`` calls."""

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

    ``sealed`` once the B scaling is applied (first ``sync`` or ``invert``); no curvature after.
    """

    total: Tensor
    rows: int = 0
    sealed: bool = False


@dataclass
class LayerState:
    """Everything K-FAC keeps for one layer.

    ``captures[factor][micro_batch]``: tensors recorded by hooks (``A``: layer inputs, ``B``: output
    gradients), freed by curvature. ``ema``: running factors. ``pending``: inverses computed since
    the last commit. ``active``: inverses used by precondition (missing = identity).
    """

    info: LayerInfo
    module: nn.Linear
    dtype: torch.dtype
    captures: dict[Factor, dict[Hashable, list[Tensor]]] = field(
        default_factory=lambda: {"A": {}, "B": {}}
    )
    built: dict[Factor, BuiltFactor] = field(default_factory=dict)
    ema: dict[Factor, Tensor] = field(default_factory=dict)
    pending: dict[Factor, Tensor] = field(default_factory=dict)
    active: dict[Factor, Tensor] = field(default_factory=dict)
    health: Health = field(default_factory=Health)


def select_layers(
    model: nn.Module, skip: Iterable[str] = (), max_factor_dim: int = 8192
) -> dict[str, LayerState]:
    """K-FAC state for every ``nn.Linear`` of ``model`` in module order, except those whose name
    matches a glob in ``skip`` and those with a factor larger than ``max_factor_dim`` (e.g. a
    vocabulary projection). Other modules (embeddings, LayerNorm, ...) are left first-order."""
    patterns = list(skip)
    layers: dict[str, LayerState] = {}
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        if any(fnmatch.fnmatchcase(name, p) for p in patterns):
            continue
        info = LayerInfo(name, module.in_features, module.out_features, module.bias is not None)
        if max(info.a_size, info.b_size) > max_factor_dim:
            continue
        layers[name] = LayerState(info, module, factor_dtype(module.weight.dtype))
    return layers
