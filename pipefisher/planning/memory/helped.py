"""The bytes a plan's help ops make its ranks hold beside their training state, for the whole
cycle (the helper keeps what it received in the cycle's first step): on the helping rank each
helped layer's `help_bytes` (its gradient in, its result out, the refresh results it applies), on
the layer's own rank its `help_result_bytes`. Pure Python: no torch."""

from __future__ import annotations

from collections.abc import Mapping
from pipefisher.core.ir import OpKind
from pipefisher.core.op_fields import layer_of
from pipefisher.planning.memory.layer_model import CurvatureLayer
from pipefisher.planning.plan import Plan


def help_bytes_per_rank(
    plan: Plan, layers: Mapping[tuple[int, str], CurvatureLayer], element_bytes: int = 4
) -> list[int]:
    """Per rank of the plan's pipeline, the bytes its help ops hold: a help op's rank holds the
    layer's `help_bytes`, the rank of the layer's stage its `help_result_bytes`. `layers`: by
    (stage, layer name), every helped layer of the plan (`Plan.helped`); KeyError naming a
    missing one."""
    schedule = plan.schedule
    held = [0] * schedule.num_ranks
    first = plan.steps[0] if plan.steps else ()
    for rank, ops in enumerate(first):
        for op in ops:
            if op.kind is not OpKind.HELP:
                continue
            key = (op.stage, layer_of(op))
            if key not in layers:
                raise KeyError(f"help op {op}: no memory model of layer {key[1]!r} of stage {key[0]}")
            layer = layers[key]
            held[rank] += layer.help_bytes(element_bytes)
            held[schedule.placement[(op.pipe, op.stage)]] += layer.help_result_bytes(element_bytes)
    return held
