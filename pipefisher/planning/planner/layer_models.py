"""The curvature method's memory model of each layer a layout's memory counts: the model
(`layer_memory_model`) at what the run's method section sets of it (`layer_settings`), and per
(stage, layer) of a profile (`profile_layers`, by the layer's name suffix). Pure Python: no torch."""

from __future__ import annotations

import importlib
from functools import lru_cache
from typing import Any

from pipefisher.core.profile import Profile
from pipefisher.methods.registry import methods
from pipefisher.planning.memory.transformer_state import BLOCK_MODULES
from pipefisher.planning.planner.model_sizes import ModelSizes
from pipefisher.planning.transformer_profile import BLOCK_LAYERS, block_layer_shapes

#: what a run's method section sets of its layers' memory model, as (field, value) pairs in field
#: order (`layer_settings`; () for the model's defaults): hashable, so the caches key on it
LayerSettings = tuple[tuple[str, Any], ...]


def layer_memory_model(method: str):
    """The curvature method's `from_linear` memory model, or None (first-order, or not modelled)."""
    known = methods().get(method)
    if known is None or not known.memory:
        return None
    module, _, attribute = known.memory.partition(":")
    return getattr(importlib.import_module(module), attribute)


def step_momentum(method: str, momentum: float) -> float:
    """`momentum` where `method`'s optimizer step keeps a momentum buffer per parameter it
    preconditions (its layer model's `STEP_MOMENTUM`; a method without a model: its first-order
    rule's), else 0."""
    model = layer_memory_model(method)
    return momentum if model is None or model.STEP_MOMENTUM else 0.0


def layer_settings(method: str, section: Any, p_ops: bool) -> LayerSettings:
    """The fields of `method`'s layer memory model that its run-file `section` sets
    (`MatrixLayer.settings_of`; `p_ops`: the run's plan has the method's per-step P ops); () for
    no section or no model."""
    model = layer_memory_model(method)
    if section is None or model is None:
        return ()
    return tuple(sorted(model.settings_of(section, p_ops).items()))


def block_linear_shapes(sizes: ModelSizes, tensor_parallel: int) -> dict[str, tuple[int, int]]:
    """Layer-name suffix -> (inputs, outputs) of a block's Linears on one tensor-parallel rank,
    under the reference profiles' names (``.attention.query``) and BERT's module names."""
    shapes = {name: (din, dout) for name, din, dout in block_layer_shapes(sizes.hidden, sizes.ffn, tensor_parallel)}
    return {
        **{f".{name}": shape for name, shape in shapes.items()},
        **{f".{BLOCK_MODULES[name]}": shapes[name] for name in BLOCK_LAYERS},
    }


def profile_layers(
    method: str, tensor_parallel: int, sizes: ModelSizes, profile: Profile, settings: LayerSettings = ()
) -> dict:
    """Per (stage, layer) of the profile, the layer's memory model in `method` on one of
    `tensor_parallel` ranks at `settings`; layers of unknown shape (outside the blocks) have none,
    nor a method without a model."""
    if layer_memory_model(method) is None:
        return {}
    found = {}
    for index, stage in enumerate(profile.stages):
        for layer in stage.layers:
            model = _layer_model(method, sizes, tensor_parallel, layer.name, settings)
            if model is not None:
                found[(index, layer.name)] = model
    return found


@lru_cache(maxsize=65536)
def _layer_model(method: str, sizes: ModelSizes, tensor_parallel: int, name: str, settings: LayerSettings):
    """`profile_layers`' model of one layer by its name (None: not a block's Linear); a search
    asks for the same names under thousands of layouts."""
    shapes = block_linear_shapes(sizes, tensor_parallel)
    shape = next((shape for suffix, shape in shapes.items() if name.endswith(suffix)), None)
    if shape is None:
        return None
    return layer_memory_model(method).from_linear(name, *shape, True, **dict(settings))
