"""The sizes a measured profile records beside its times: each stage's activation message
(`StageProfile.p2p_bytes`, the message its `p2p` times) and each method layer's weight
(`LayerProfile.weight_bytes`); together they give the pipeline links' speed and what a help op's
layer costs on them (`pipefisher.planning.packing.helpers`)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace

from torch import nn

from pipefisher.core.ir import Op, OpKind
from pipefisher.core.profile import Profile
from pipefisher.planning.comm.actions import Message
from pipefisher.runtime.pipeline.executor import Executor


def weight_bytes(
    modules: Mapping[tuple[int, int], nn.Module], layers: Iterable[tuple[int, str]]
) -> dict[tuple[int, str], int]:
    """(stage, layer) -> bytes of the layer's weight on this rank, for the `layers` of its stages:
    the parameter of that name (Muon names matrices), or the weight of the module of that name."""
    parameters = {stage: dict(module.named_parameters()) for (_, stage), module in modules.items()}
    found: dict[tuple[int, str], int] = {}
    for stage, layer in layers:
        named = parameters.get(stage, {})
        parameter = named.get(layer, named.get(f"{layer}.weight"))
        if parameter is not None:
            found[(stage, layer)] = parameter.numel() * parameter.element_size()
    return found


def with_sizes(profile: Profile, executor: Executor, weights: Mapping[tuple[int, str], int]) -> Profile:
    """`profile` with every stage's `p2p_bytes` (the activation it sends on; 0 for the last) and its
    layers' `weight_bytes` (`weights`, gathered from the ranks that hold them)."""
    last = profile.num_stages - 1
    stages = []
    for stage, stage_profile in enumerate(profile.stages):
        message = 0
        if stage < last:
            shape, dtype = executor.message_spec(Message(Op(OpKind.FORWARD, stage + 1, 0)))
            message = dtype.itemsize
            for size in shape:
                message *= size
        layers = tuple(
            replace(layer, weight_bytes=weights.get((stage, layer.name), 0)) for layer in stage_profile.layers
        )
        stages.append(replace(stage_profile, p2p_bytes=message, layers=layers))
    return replace(profile, stages=tuple(stages))
