"""Bytes of K-FAC captures a plan holds per device beyond what training holds anyway.

In the first step of a refresh cycle each K-FAC layer captures, per micro-batch, its input
activations (factor A, at the forward) and its output gradients (factor B, at the backward); the
capture is freed when that micro-batch's curvature task of the factor has run, possibly steps
later. The input is what autograd keeps for the backward anyway, so it costs extra only from the
micro-batch's backward on; the output gradient from the backward on too. A rank runs its list in
order, so what it holds after each op follows from the order alone. Sizes come from the profile
(`capture_a_bytes`, `capture_b_bytes` per micro-batch; 0 = unknown); layers that share an input
(attention query, key, value) each count it, so the figure is an upper bound there.
Pure Python: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipefisher.ir import Op, OpKind
from pipefisher.plan import Plan
from pipefisher.profile import Profile


_CHANGES_HOLDINGS = frozenset({OpKind.BACKWARD, OpKind.CURV_A, OpKind.CURV_B})


@dataclass(frozen=True)
class CapturePeak:
    """The most capture bytes `rank` holds at once over the cycle, and after which op of which
    step (None: it holds none)."""

    rank: int
    bytes: int
    step: int | None = None
    after: Op | None = None


def capture_peaks(plan: Plan, profile: Profile) -> list[CapturePeak]:
    """Per rank, the peak of extra captured bytes held over one refresh cycle of `plan`."""
    layers = [stage.layers for stage in profile.stages]
    by_name = [{layer.name: layer for layer in stage.layers} for stage in profile.stages]
    peaks = []
    for rank in range(plan.schedule.num_ranks):
        held, peak = 0, CapturePeak(rank, 0)
        backward_done: set[tuple] = set()
        curvature_a_done: set[tuple] = set()
        for index, step in enumerate(plan.steps):
            for op in step[rank]:
                if op.kind not in _CHANGES_HOLDINGS or (op.kind is OpKind.BACKWARD and index > 0):
                    continue
                key = (op.pipe, op.stage, op.micro_batch)
                if op.kind is OpKind.BACKWARD:
                    backward_done.add(key)
                    held += sum(layer.capture_b_bytes + (0 if (key, layer.name) in curvature_a_done else layer.capture_a_bytes)
                                for layer in layers[op.stage])
                elif op.kind is OpKind.CURV_A:
                    curvature_a_done.add((key, op.layer))
                    if key in backward_done:
                        held -= by_name[op.stage][op.layer].capture_a_bytes
                else:
                    held -= by_name[op.stage][op.layer].capture_b_bytes
                if held > peak.bytes:
                    peak = CapturePeak(rank, held, index, op)
        peaks.append(peak)
    return peaks

