"""A P op or the step end: where a method's optimizer step does the P op's work for every matrix
no P op did (`TaskRules.step_end_precondition`: Shampoo's products, SOAP's rotation in), its P ops
(and the help ops that share them) are worth their place only where they shorten the step.
`pack_choosing_p_ops` packs such a method both ways and keeps the faster: its P ops, or every
stage's preconditioning in its step end. Pure Python: no torch."""

from __future__ import annotations

from dataclasses import replace

from pipefisher.core.ir import OpKind, Schedule
from pipefisher.core.profile import Profile, StageProfile
from pipefisher.planning.packing.options import PackOptions
from pipefisher.planning.packing.pack import pack
from pipefisher.planning.packing.report import PackResult
from pipefisher.planning.plan import Plan
from pipefisher.planning.vocabulary import TaskRules


def has_p_ops(plan: Plan) -> bool:
    """Whether `plan` has per-step precondition ops (a method's optional ones may be left out)."""
    return any(op.kind is OpKind.PRECONDITION for step in plan.steps for ops in step for op in ops)


def precondition_in_step_end(profile: Profile) -> Profile:
    """`profile` with each stage's preconditioning (its layers' `precondition` times) added to its
    step end, as the method's own (`method_step_end`): a run without P ops, doing their work as
    they timed it."""

    def moved(stage: StageProfile) -> StageProfile:
        products = sum(layer.precondition for layer in stage.layers)
        return replace(stage, step_end=stage.step_end + products, method_step_end=stage.method_step_end + products)

    return replace(profile, stages=tuple(moved(stage) for stage in profile.stages))


def pack_choosing_p_ops(
    schedule: Schedule, profile: Profile, rules: TaskRules, options: PackOptions, without: Profile | None = None
) -> PackResult:
    """`pack` of `profile`; where the method's P ops are optional and `options` allow them, also
    of the run without them (`without`: its profile, by default `precondition_in_step_end` of
    `profile`), and the one of the shorter mean step, its `reason` saying which and by how much.
    A tie goes to the step end: P ops and help ops that save no time only cost memory (the held
    results) and messages."""
    with_ops = pack(schedule, profile, rules, options)
    if not (rules.step_end_precondition and options.precondition):
        return with_ops
    in_step_end = pack(
        schedule, without or precondition_in_step_end(profile), rules, replace(options, precondition=False)
    )
    unit, label = profile.time_unit, rules.labels.precondition
    kept, moved = (with_ops.cycle_time / with_ops.refresh_steps, in_step_end.cycle_time / in_step_end.refresh_steps)
    if moved <= kept * (1 + 1e-9):
        tie = moved >= kept * (1 - 1e-9)
        gain = (
            f"no slower (mean step {moved:.4g} {unit} either way)"
            if tie
            else f"mean step {kept:.4g} -> {moved:.4g} {unit}"
        )
        return replace(in_step_end, reason=f"{in_step_end.reason}; no P ops: the {label} in the step end, {gain}")
    why = f"; P ops kept: mean step {kept:.4g} {unit} against {moved:.4g} with the {label} in the step end"
    return replace(with_ops, reason=with_ops.reason + why)
