"""PipeFisher on the executor: profile (or load a profile), pack the curvature method's work (K-FAC
or Shampoo, `pipefisher.methods.registry`), train in cycles.

Every rank derives the same plan from the same profile (the packer is deterministic), so no plan
is sent around. After every cycle the measured cycle time is compared with the prediction; when
they drift apart for several cycles in a row, rank 0 decides to re-profile and every rank
re-measures and re-packs at the cycle boundary.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from pipefisher.config import RunConfig
from pipefisher.core.ir import Op, OpKind, Schedule, ScheduleError
from pipefisher.core.profile import LayerProfile, Profile, StageProfile, load_profile
from pipefisher.methods.interface import CurvatureRuntime
from pipefisher.methods.registry import method_of, task_rules
from pipefisher.models import StagedModel
from pipefisher.planning.memory.captures import capture_peaks
from pipefisher.planning.packing.pack import PackOptions, after_step_plan
from pipefisher.planning.packing.step_end import has_p_ops, precondition_in_step_end
from pipefisher.planning.planner.run_layout import run_packing
from pipefisher.planning.plan import Plan, cycle_time, simulate_plan, validate_plan
from pipefisher.planning.simulate import simulate
from pipefisher.runtime.pipeline.executor import Executor, StepResult
from pipefisher.runtime.pipeline.extension import ExecutorExtension
from pipefisher.runtime.pipeline.plan_runner import PlanRunner
from pipefisher.runtime.training.assembly import staged_model
from pipefisher.runtime.training.drift import DriftMonitor
from pipefisher.runtime.training.exposed_meter import ExposedMeter
from pipefisher.runtime.training.method_context import method_inputs
from pipefisher.runtime.training.profiler import measure_profile, measured_at
from pipefisher.runtime.training.run_profile import run_profile, stage_layer_names

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CurvaturePlan:
    plan: Plan
    predicted_cycle_ms: float
    summary: str

    @property
    def refresh_steps(self) -> int:
        return self.plan.refresh_steps


def shared_statistics(
    config: RunConfig, num_stages: int, model: StagedModel | None = None
) -> frozenset[tuple[int, str, int]]:
    """(stage, layer, part) of every stage's statistics that a rank's tensor-parallel processes
    build in shares (`TaskRules.shared_statistics`); none without tensor parallelism."""
    degree = config.pipeline.tensor_parallel
    if degree == 1:
        return frozenset()
    model = model if model is not None else staged_model(config)
    names = (stage_layer_names(config, stage, num_stages, model) for stage in range(num_stages))
    layers = ((stage, name) for stage, stage_names in enumerate(names) for name in stage_names)
    return method_of(config).rules.shared_statistics(layers, model.tensor_parallel_plan(degree))


def check_plan_matches(plan: Plan, config: RunConfig, schedule: Schedule, model: StagedModel | None = None) -> None:
    """Refuse a plan (`pipefisher pack -o`) of another run, naming the field that differs: the
    curvature method, the schedule and its shape, the layers, or the tasks of this layout (a plan
    packed for other replicas syncs other factors; `--data-parallel` of `pack` must match)."""
    method = method_of(config).name
    if plan.method != method:
        raise ScheduleError(f"method: the plan runs {plan.method} tasks but this run uses {method}")
    fields = (
        ("schedule", plan.schedule.name, schedule.name),
        ("stages", plan.schedule.num_ranks, schedule.num_ranks),
        ("micro_batches", plan.schedule.num_micro_batches, schedule.num_micro_batches),
        ("chunks", plan.schedule.num_stages // plan.schedule.num_ranks, schedule.num_stages // schedule.num_ranks),
    )
    for name, in_plan, in_run in fields:
        if in_plan != in_run:
            raise ScheduleError(f"{name}: the plan is for {in_plan}, this run has {in_run} (pipeline.{name})")
    validate_plan(plan)
    model = model if model is not None else staged_model(config)
    names = {
        stage: stage_layer_names(config, stage, schedule.num_stages, model) for stage in range(schedule.num_stages)
    }
    for stage, layers in names.items():
        ops = [op.layer for op in plan.curvature_ops() if op.stage == stage and op.layer and op.kind is not OpKind.HELP]
        helps = [op.layer for op in plan.curvature_ops() if op.stage == stage and op.layer and op.kind is OpKind.HELP]
        cycle_layers = sorted(set(ops))
        unknown = sorted({layer for layer in ops + helps if layer not in layers})
        if unknown or (cycle_layers and cycle_layers != sorted(layers)):  # per-step work alone names no layer
            shown = unknown or cycle_layers
            raise ScheduleError(
                f"layers: the plan's stage {stage} works on {shown[:3]}..., the model's on {sorted(layers)[:3]}..."
            )
    section = config.method_section
    # a method whose step end can do its P op's work may have been packed without P ops
    rules = method_of(config).rules
    stand_in = Profile(
        stages=tuple(
            StageProfile(1.0, 2.0, layers=tuple(LayerProfile(name) for name in names[stage]))
            for stage in range(schedule.num_stages)
        ),
        method=method,
    )
    expected_plan = after_step_plan(
        schedule,
        stand_in,
        rules,
        plan.refresh_steps,
        split=section.split,
        data_parallel=config.pipeline.data_parallel,
        precondition=config.precondition_op and (has_p_ops(plan) or not rules.step_end_precondition),
    )
    planned, wanted = _task_counts(plan), _task_counts(expected_plan)
    if planned != wanted:
        extra = sorted(" ".join(map(str, key)) for key in (planned - wanted).elements())
        missing = sorted(" ".join(map(str, key)) for key in (wanted - planned).elements())
        raise ScheduleError(
            f"tasks: the plan's curvature tasks are not this layout's (data_parallel "
            f"{config.pipeline.data_parallel}, {method}.split {str(section.split).lower()}): "
            f"missing {missing[:3]}, not expected {extra[:3]}; pack with this run's --data-parallel"
        )


#: ops whose replica the packer picks by their times (split refresh work): compared without it
_OWNER_CHOSEN = (OpKind.REFRESH, OpKind.EXCHANGE)


def _task_counts(plan: Plan) -> Counter:
    """The plan's curvature ops as (kind, stage, layer, micro-batch, pipe) counts, the pipe left out
    where the packer chose it."""
    return Counter(
        (op.token, op.stage, op.layer, op.micro_batch, None if op.kind in _OWNER_CHOSEN else op.pipe)
        for op in plan.curvature_ops()
        if op.kind is not OpKind.HELP  # where a layer's per-step work runs is the packer's choice
    )


def pack_options(config: RunConfig, refresh_steps: int | None = None) -> PackOptions:
    """The packer's options of a run: its method's section (`method_of`), its data-parallel copies
    and gradient workers; `refresh_steps` overrides the section's refresh_steps."""
    return PackOptions.from_section(
        config.section(method_of(config).name),
        data_parallel=config.pipeline.data_parallel,
        precondition=config.precondition_op,
        refresh_steps=refresh_steps,
    )


def make_plan(config: RunConfig, schedule, profile: Profile, model: StagedModel | None = None) -> CurvaturePlan:
    """The run's curvature plan: the section's `plan` file (checked against `model`, if built), else
    packed as `pipefisher plan RUN --profile P` packs its layout (`run_packing`); times from that profile."""
    method = method_of(config)
    section = config.section(method.name)
    pinned = section.refresh_steps or None
    data_parallel = config.pipeline.data_parallel
    if section.plan:
        plan = Plan.load(section.plan, task_rules)
        check_plan_matches(plan, config, schedule, model)
        result, how = None, f"plan {section.plan}: refresh every {plan.refresh_steps} steps"
        if config.precondition_op and not has_p_ops(plan):
            profile = precondition_in_step_end(profile)  # packed without P ops: their work in the step end
    else:
        result, profile = run_packing(config, schedule, profile, pack_options(config))
        if section.placement == "packed":
            plan = result.plan
        else:
            plan = after_step_plan(
                schedule,
                profile,
                method.rules,
                result.refresh_steps,
                split=section.split,
                data_parallel=data_parallel,
                precondition=result.options.precondition,  # the packer's choice, as its profile has it
            )
        how = f"{section.placement}: refresh every {plan.refresh_steps} steps (lower bound {result.lower_bound})"
    validate_plan(plan)
    predicted = cycle_time(simulate_plan(plan, profile))  # nominal times (the packer's are a percentile)
    held = max(peak.bytes for peak in capture_peaks(plan, profile))
    first_order = simulate(schedule, profile).step_time  # nominal times, like `predicted`
    extra = predicted / plan.refresh_steps / first_order - 1 if first_order > 0 else 0.0
    packed = result if section.placement == "packed" else None
    summary = (
        f"{method.label} {how}; "
        f"predicted step {predicted / plan.refresh_steps:.2f} {profile.time_unit}, first-order "
        f"{first_order:.2f} {profile.time_unit} ({100 * extra:+.1f} %)"
        + (f"; {packed.reason}" if packed is not None and not pinned else "")
        + (f"; {len(plan.helped)} layers' per-step work on other ranks" if plan.helped and pinned else "")
        + (
            f"; no P ops: the {method.rules.labels.precondition} in the step end, no slower there"
            if packed is not None and pinned and config.precondition_op and not packed.options.precondition
            else ""
        )
        + (f"; captures held: at most {held / 2**20:.1f} MiB per device" if held else "")
        + (f"; {packed.memory}" if packed is not None and packed.memory else "")
        + (
            f"; {method.name}.max_capture_mb applies to packed plans only"
            if section.max_capture_mb and packed is None
            else ""
        )
    )
    return CurvaturePlan(plan, predicted, summary)


class _MethodExtension(ExecutorExtension):
    """A curvature method's runtime at the executor's extension points: its op handlers and
    collectives, its hooks told the position in the refresh cycle (`cycle_step()`); before the
    optimizer step it preconditions the parameters this rank `updates`."""

    def __init__(
        self, runtime: CurvatureRuntime, cycle_step: Callable[[], int], updates: Callable[[torch.nn.Parameter], bool]
    ):
        self.runtime, self.cycle_step, self.updates = runtime, cycle_step, updates

    def handlers(self) -> dict:
        return self.runtime.handlers()

    def collectives(self) -> dict:
        return self.runtime.collectives()

    def forward_context(self, op: Op) -> AbstractContextManager:
        return self.runtime.forward_context(op, self.cycle_step())

    def after_backward(self, op: Op) -> None:
        self.runtime.after_backward(op, self.cycle_step())

    def before_optimizer_step(self) -> None:
        self.runtime.before_optimizer_step(self.updates)


class PipeFisherTrainer(PlanRunner):
    """Drives one rank's executor through the refresh cycles of the run's curvature method."""

    def __init__(
        self,
        config: RunConfig,
        executor: Executor,
        rank: int,
        tied: bool,
        profile: Profile | None = None,
        model: StagedModel | None = None,
    ):
        """`profile`: the one to pack from (e.g. a checkpoint's); default: the run's file, or measured.
        `model`: the run's staged model (`RunParts.model`; default: built here)."""
        self.config, self.executor, self.rank = config, executor, rank
        self.schedule = executor.topology.schedule
        self.modules = {key: stage.module for key, stage in executor.stages.items()}
        self.method = method_of(config)
        self.parts = self.method.runtime_parts()
        self.section = config.method_section
        self.model = model if model is not None else staged_model(config)
        self.skip = self.parts.skip(self.model)
        self.profile, fresh = (profile, False) if profile is not None else self._initial_profile()
        self.curvature_plan = make_plan(config, self.schedule, self.profile, self.model)
        self.drift = DriftMonitor(self.section.reprofile_threshold, self.section.reprofile_patience)
        self.drift.new_plan(fresh_profile=fresh)
        scaler = executor.step_end.scaler
        self.runtime = self.parts.runtime(
            method_inputs(config, self.model),
            executor.topology,
            rank,
            self.modules,
            executor.comm,
            self.curvature_plan.plan,
            self.skip,
            (lambda: scaler.scale) if scaler is not None else (lambda: None),
        )
        shared = shared_statistics(config, self.schedule.num_stages, self.model)
        super().__init__(executor, rank, self.curvature_plan.plan, tied, shared)
        executor.extend(_MethodExtension(self.runtime, lambda: self.cycle_step, executor.step_end.applies_to))
        self.exposed = ExposedMeter(executor)
        self._cycle_ms = 0.0
        self.log(self.curvature_plan.summary)

    def log(self, message: str) -> None:
        if self.rank == 0 and self.executor.comm.shard == 0:
            logger.info("%s", message)

    def _measure(self) -> Profile:
        timer = self.parts.timer(method_inputs(self.config), self.modules, self.skip)
        profile, _ = measure_profile(
            self.executor, self.rank, self.modules, self.config.data.micro_batch_size, timer, **measured_at(self.config)
        )
        return profile

    def _initial_profile(self) -> tuple[Profile, bool]:
        """The run's profile file, or one measured now; and whether it was measured now."""
        if self.section.profile:
            profile = run_profile(load_profile(self.section.profile), self.config, self.schedule.num_stages, self.model)
            return profile, False
        self.log("measuring a profile (gradients dropped; the model does not change)")
        return self._measure(), True

    def state_dict(self) -> dict:
        """Every engine's state (for byte counts; checkpoints: `checkpoint_state`)."""
        return self.runtime.state_dict()

    @property
    def predicted_step_ms(self) -> float:
        return self.curvature_plan.predicted_cycle_ms / self.curvature_plan.refresh_steps

    def run_step(self, step: int) -> StepResult:
        """A step; its record carries the refresh interval, the predicted step time and, once
        measured, the exposed optimizer time (`exposed_meter`)."""
        plan, profile = self.plan, self.profile  # what this step runs (a re-plan at its end replaces them)
        self.exposed.before_step(step, self.cycle_step)
        result = super().run_step(step)
        self.exposed.after_step(result.seconds, plan, profile, cycle_end=self.cycle_step == 0)
        self._cycle_ms += 1000 * result.seconds
        measured = self.exposed.result.extra() if self.exposed.result is not None else {}
        gain = self.exposed.result.helpers_gain_ms if self.exposed.result is not None else None
        if gain is not None and gain < 0 and not self.section.plan:
            self._pack_without_helpers(gain)
        extra = {"refresh_steps": self.plan.refresh_steps, "predicted_step_time_ms": self.predicted_step_ms, **measured}
        return replace(result, extra={**result.extra, **extra})

    def _pack_without_helpers(self, gain_ms: float) -> None:
        """The run's own op times say the plan's help ops lengthen the step (`gain_ms` < 0: the
        same on every rank, simulated from op times all-reduced over the ranks): from the next
        cycle on, pack without them."""
        self.log(
            f"helpers: on this run's op times the help ops make the step {-gain_ms:.2f} ms longer, "
            f"not shorter: packing without them ({self.method.name}.helpers false from here)"
        )
        self.config = self.config.with_overrides(**{self.method.name: {"helpers": False}})
        self.section = self.config.method_section
        self._replan(fresh_profile=False)

    def _replan(self, fresh_profile: bool) -> None:
        """Pack the run's plan again from `self.profile` (`fresh_profile`: measured just now) and
        use it from the next cycle on."""
        self.curvature_plan = make_plan(self.config, self.schedule, self.profile, self.model)
        self.drift.new_plan(fresh_profile=fresh_profile)
        self.runtime.set_plan(self.curvature_plan.plan)
        self.set_plan(self.curvature_plan.plan)
        self.exposed.reset()
        self.log(self.curvature_plan.summary)

    def end_of_cycle(self) -> None:
        self.runtime.end_of_cycle()
        measured, predicted = self._cycle_ms, self.curvature_plan.predicted_cycle_ms
        self._cycle_ms = 0.0
        expected = self.drift.expected
        decision = torch.full((1,), float(self.drift.observe(measured, predicted)), device=self.executor.device)
        if self.drift.expected != expected and abs(self.drift.expected - 1) > self.drift.threshold:
            self.log(
                f"measured cycle {measured:.1f} ms is {self.drift.expected:.2f}x the predicted {predicted:.1f} ms "
                "with a fresh profile (costs the simulator does not see); re-profiling watches for changes from this ratio"
            )
        dist.broadcast(decision, src=0)  # rank 0's clock decides for everyone
        if not decision.item():
            return
        self.log(
            f"measured cycle {measured:.1f} ms vs predicted {predicted:.1f} ms "
            f"(expected ratio {self.drift.expected:.2f}) for {self.drift.drifting_cycles} cycles: re-profiling and re-packing"
        )
        self.profile = self._measure()
        self._replan(fresh_profile=True)
