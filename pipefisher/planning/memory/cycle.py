"""The bytes a rank holds beside its training state op by op over one refresh cycle of a curvature
method's plan: activations (`pipefisher.planning.memory.activations.activation_held`), captures
held past their release (`pipefisher.planning.memory.captures.capture_held`) and the refresh's
copy of each layer's statistics, and their largest sum. Pure Python: no torch.

Activations and captures peak at different ops: a capture step's last backward holds one
micro-batch's activations and the captures of the micro-batches before it, not all of both, so
the sum of their separate peaks overstates the rank's peak (by 14 % on the BERT demo's last stage).
The refresh copy: from a layer's first curvature task in the cycle (or, for a method without
them, its first refresh or exchange op there) to the cycle's end a rank holds the layer's
`refresh_copy_bytes` beside its committed state (K-FAC: the factor being built, then, after the
inversion, the pending inverse until the commit; SOAP: its pending eigenbases). The refresh work:
while one of a layer's refresh ops runs, its temporaries (`refresh_work_bytes`; SOAP: the power
iteration's and the QR's copies of the statistics).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pipefisher.core.ir import OpKind
from pipefisher.core.profile import Profile
from pipefisher.planning.comm.send_waits import send_waits
from pipefisher.planning.memory.activations import SendWaits, activation_held, weighted_micro_batches
from pipefisher.planning.memory.captures import capture_held
from pipefisher.planning.memory.layer_model import RefreshWork
from pipefisher.planning.plan import Plan


#: the ops that start a layer's refresh copy in a method without curvature tasks
_REFRESH_WORK = frozenset({OpKind.REFRESH, OpKind.EXCHANGE})


@dataclass(frozen=True)
class CyclePeak:
    """What `rank` holds beside its training state at the op where their sum peaks (bytes)."""

    rank: int
    activation_bytes: int
    capture_bytes: int
    refresh_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.activation_bytes + self.capture_bytes + self.refresh_bytes


def cycle_peaks(
    plan: Plan,
    profile: Profile,
    stage_bytes: Sequence[int],
    pending_bytes: Sequence[int],
    transient_bytes: Sequence[int],
    refresh_bytes: Mapping[tuple[int, str], int],
    sent_bytes: Sequence[tuple[int, int]] | None = None,
    work_bytes: RefreshWork | None = None,
) -> list[CyclePeak]:
    """Per rank of `plan`, the peak of activations (per stage: kept F to B, B to W, a backward's
    transient) + captures + refresh copies (`refresh_bytes` per (stage, layer name); a layer not
    named holds none) + a refresh op's work (`work_bytes` of its stage, layer and part, counted
    with the refresh copies while the op runs) over one cycle; `sent_bytes` as in `activation_held`, held until the waits the
    communication plan places (`pipefisher.planning.comm.send_waits`). Activations start from none
    at every step."""
    schedule = plan.schedule
    weighted = weighted_micro_batches(schedule)
    waits: list[Sequence[SendWaits]] = [
        send_waits(step, schedule.placement, schedule.num_stages) if sent_bytes is not None else [{}] * len(step)
        for step in plan.steps
    ]
    peaks = []
    starts = {OpKind.CURVATURE} if plan.rules is None or plan.rules.curvature else _REFRESH_WORK
    for rank in range(plan.schedule.num_ranks):
        best, most = (0, 0, 0), 0  # (activations, captures, refresh) at the peak so far, and their sum
        started: set[tuple[int, str]] = set()
        refresh = captured_before = 0
        for step, step_waits, captured in zip(plan.steps, waits, capture_held(plan, profile, rank)):
            activations = activation_held(
                step[rank], stage_bytes, pending_bytes, transient_bytes, weighted, sent_bytes, step_waits[rank]
            )
            for op, (during, after), captured_after in zip(step[rank], activations, captured):
                key = (op.stage, op.layer or "")
                if op.kind in starts and key not in started:
                    started.add(key)
                    refresh += refresh_bytes.get(key, 0)
                working = refresh
                if op.kind is OpKind.REFRESH and work_bytes is not None:
                    working += work_bytes(op.stage, key[1], op.part or 0)
                if during + captured_before + working > most:
                    best, most = (during, captured_before, working), during + captured_before + working
                if after + captured_after + refresh > most:
                    best, most = (after, captured_after, refresh), after + captured_after + refresh
                captured_before = captured_after
        peaks.append(CyclePeak(rank, *best))
    return peaks
