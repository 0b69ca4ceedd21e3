"""Layer selection, for any method: which linear layers of a stage (or of the reference's whole
model) a method preconditions, and what stays first-order.

A linear layer is an ``nn.Linear`` or Hugging Face's ``Conv1D`` (GPT-2's linear map, weight stored
transposed as (in, out)). The model says which of them stay first-order
(`StagedModel.first_order_linears`: a head tied to an embedding, whose gradient is whole only after
the tied sum at the end of the step): `MethodParts.skip` returns those globs, matched against
module names within a stage; the reference trains the stages as one ``nn.ModuleList`` (names
prefixed "<stage>."), so its globs get a leading "*." (`whole_model_globs`). Every parameter a
method does not name in `MethodParts.preconditioned` is stepped by its section's `first_order` rule.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

from pipefisher.methods.blocks import Factor


@dataclass(frozen=True)
class LayerInfo:
    """A linear layer as the planner sees it: ``a_size = din + has_bias`` (the input side, part
    "A", the bias folded in as a trailing ones column), ``b_size = dout`` (the output side, part "B").
    ``transposed``: the weight is stored (din, dout), as Conv1D stores it."""

    name: str
    in_features: int
    out_features: int
    has_bias: bool
    transposed: bool = False

    @property
    def a_size(self) -> int:
        return self.in_features + int(self.has_bias)

    @property
    def b_size(self) -> int:
        return self.out_features

    def size(self, factor: Factor) -> int:
        return self.a_size if factor == "A" else self.b_size


@dataclass(frozen=True)
class SelectedLayer:
    """A linear layer a method preconditions: its `info` and its `module`."""

    info: LayerInfo
    module: nn.Module

    def parameter_names(self, bias: bool = True) -> list[str]:
        """Its weight's name (and its bias's, with `bias`, when it has one), as
        ``named_parameters()`` of the selecting model gives them."""
        parts = ("weight", "bias")[: 1 + int(bias and self.info.has_bias)]
        return [f"{self.info.name}.{part}" for part in parts]


def linear_weight(module: nn.Module) -> nn.Parameter:
    """A linear layer's weight (TypeError naming the module's class when it has none)."""
    weight = getattr(module, "weight", None)
    if not isinstance(weight, nn.Parameter):
        raise TypeError(f"{type(module).__name__} has no weight parameter")
    return weight


def linear_bias(module: nn.Module) -> nn.Parameter | None:
    """A linear layer's bias, None without one."""
    bias = getattr(module, "bias", None)
    return bias if isinstance(bias, nn.Parameter) else None


def linear_info(name: str, module: nn.Module) -> LayerInfo | None:
    """The view of `module` when it is a linear map of its last input dimension: an
    ``nn.Linear``, or a ``Conv1D`` (by class name, so this module needs no transformers) with a
    (din, dout) weight; None for anything else."""
    if isinstance(module, nn.Linear):
        return LayerInfo(name, module.in_features, module.out_features, module.bias is not None)
    weight = getattr(module, "weight", None)
    if type(module).__name__ == "Conv1D" and isinstance(weight, Tensor) and weight.dim() == 2:
        return LayerInfo(
            name, weight.shape[0], weight.shape[1], getattr(module, "bias", None) is not None, transposed=True
        )
    return None


def select_linears(model: nn.Module, skip: Iterable[str] = (), max_size: int | None = None) -> dict[str, SelectedLayer]:
    """Every linear layer of ``model`` in module order, except those whose name matches a glob in
    ``skip`` (`MethodParts.skip`: tied copies) and, with `max_size`, those with a side
    (``a_size`` or ``b_size``) larger than it (e.g. a vocabulary projection). Other modules
    (embeddings, LayerNorm, ...) and the layers left out stay first-order."""
    patterns = list(skip)
    layers: dict[str, SelectedLayer] = {}
    for name, module in model.named_modules():
        info = linear_info(name, module)
        if info is None or any(fnmatch.fnmatchcase(name, p) for p in patterns):
            continue
        if max_size is not None and max(info.a_size, info.b_size) > max_size:
            continue
        layers[name] = SelectedLayer(info, module)
    return layers


def linear_parameters(
    model: nn.Module, skip: Iterable[str] = (), bias: bool = True, max_size: int | None = None
) -> list[str]:
    """Names of the parameters of the layers `select_linears` picks (weights, and biases with
    `bias`): what a method that preconditions those layers returns as `MethodParts.preconditioned`."""
    return [name for layer in select_linears(model, skip, max_size).values() for name in layer.parameter_names(bias)]


def first_order_linears(model: Any) -> tuple[str, ...]:
    """Globs of the staged model's linear layers that stay first-order (its tied copies): the
    `MethodParts.skip` of a method built on `select_linears`."""
    return tuple(model.first_order_linears())


def whole_model_globs(globs: Iterable[str]) -> tuple[str, ...]:
    """`globs` of a stage's module names, made to match the same modules in the reference's whole
    model (an ``nn.ModuleList`` of the stages: names prefixed "<stage>.")."""
    return tuple(f"*.{glob}" for glob in globs)
