"""Bytes of K-FAC captures a plan holds per device beyond what training holds anyway.

In the first step of a refresh cycle each K-FAC layer captures, per micro-batch, its input
activations (factor A, at the forward) and its output gradients (factor B, at the backward: the
input-gradient op B where the schedule splits the backward); the capture is freed when that
micro-batch's curvature task of the factor has run, possibly steps later. Training keeps both
until the micro-batch's gradient of the stage is computed anyway (autograd keeps the input for
the backward; a split backward's weight gradient W reads the input and the output gradients), so
a capture costs extra only from the micro-batch's *release* on: its backward, or its W where the
schedule splits the backward. A rank runs its list in order, so what it holds after each op
follows from the order alone. Sizes come from the profile (`capture_a_bytes`, `capture_b_bytes`
per micro-batch; 0 = unknown); layers that share an input (attention query, key, value) each
count it, so the figure is an upper bound there. A method without curvature tasks (SOAP, Shampoo,
Muon) captures nothing per micro-batch. Pure Python: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipefisher.core.ir import Op, OpKind
from pipefisher.core.profile import Profile
from pipefisher.planning.plan import Plan


@dataclass(frozen=True)
class CapturePeak:
    """The most capture bytes `rank` holds at once over the cycle, and after which op of which
    step (None: it holds none)."""

    rank: int
    bytes: int
    step: int | None = None
    after: Op | None = None


def capture_held(plan: Plan, profile: Profile, rank: int) -> list[list[int]]:
    """Per step of `plan`'s cycle, the extra captured bytes `rank` holds after each of its ops:
    none for a method without per-micro-batch curvature tasks (`TaskRules.curvature`), which
    captures nothing per micro-batch whatever sizes the profile carries."""
    if plan.rules is not None and not plan.rules.curvature:
        return [[0] * len(step[rank]) for step in plan.steps]
    release = OpKind.WEIGHT if plan.schedule.splits_backward else OpKind.BACKWARD
    sizes = [
        {(layer.name, part): layer.captured(part) for layer in stage.layers for part in range(len(layer.capture_bytes))}
        for stage in profile.stages
    ]
    stage_bytes = [sum(sized.values()) for sized in sizes]  # one micro-batch's captures of every layer
    held, result = 0, []
    released: set[tuple] = set()
    #: per micro-batch key, the bytes of its captures whose curvature ran before its release
    done_before: dict[tuple, int] = {}
    curvature = OpKind.CURVATURE
    for index, step in enumerate(plan.steps):
        after = []
        for op in step[rank]:
            kind = op.kind
            if kind is release and index == 0:
                key = (op.pipe, op.stage, op.micro_batch)
                released.add(key)
                held += stage_bytes[op.stage] - done_before.get(key, 0)
            elif kind is curvature and op.layer is not None and op.part is not None:
                key = (op.pipe, op.stage, op.micro_batch)
                size = sizes[op.stage].get((op.layer, op.part), 0)
                if key in released:
                    held -= size
                else:
                    done_before[key] = done_before.get(key, 0) + size
            after.append(held)
        result.append(after)
    return result


def capture_peaks(plan: Plan, profile: Profile) -> list[CapturePeak]:
    """Per rank, the peak of extra captured bytes held over one refresh cycle of `plan`."""
    peaks = []
    for rank in range(plan.schedule.num_ranks):
        peak = CapturePeak(rank, 0)
        for index, held in enumerate(capture_held(plan, profile, rank)):
            for op, after in zip(plan.steps[index][rank], held):
                if after > peak.bytes:
                    peak = CapturePeak(rank, after, index, op)
        peaks.append(peak)
    return peaks
