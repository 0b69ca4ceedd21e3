"""Drives one rank's executor through the cycle of a plan, step after step.

A first-order run is a plan of one step (the schedule's op lists); PipeFisher's K-FAC plans span
a refresh cycle of k steps (`pipefisher.runtime.training.pipefisher_run`). The plan's actions are derived
and replayed under NCCL's rule (`pipefisher.planning.comm.replay`) before the first step runs.
"""

from __future__ import annotations

from pipefisher.core.ir import Schedule
from pipefisher.planning.comm.actions import CommPlan
from pipefisher.planning.comm.plan import plan_actions
from pipefisher.planning.comm.replay import replay
from pipefisher.planning.plan import Plan
from pipefisher.runtime.pipeline.executor import Executor, StepResult


def schedule_plan(schedule: Schedule) -> Plan:
    """The plan of a first-order run: the schedule's op lists as a cycle of one step."""
    return Plan(schedule=schedule, steps=(schedule.ranks,))


class PlanRunner:
    """Runs `plan` on `executor` (rank `rank`); `cycle_step` is the position in the plan's cycle.
    `shared_statistics`: the curvature statistics the rank's tensor-parallel processes build in
    shares (`pipefisher.planning.comm.plan.plan_actions`); none for a first-order run."""

    def __init__(
        self,
        executor: Executor,
        rank: int,
        plan: Plan,
        tied: bool,
        shared_statistics: frozenset[tuple[int, str, int]] = frozenset(),
    ):
        self.executor, self.rank, self.tied = executor, rank, tied
        self.shared_statistics = shared_statistics
        self.cycle_step = 0
        self.set_plan(plan)

    def set_plan(self, plan: Plan) -> None:
        """Use `plan` from the next cycle on (call at a cycle boundary)."""
        self.plan = plan
        self.comm: CommPlan = replay(
            plan_actions(
                self.executor.topology,
                plan,
                self.tied,
                self.executor.gradient_path,
                self.shared_statistics,
                self.executor.recompute,
            ),
            name=plan.schedule.name,
        )

    def run_step(self, step: int) -> StepResult:
        actions = self.comm.steps[self.cycle_step][self.rank]
        result = self.executor.run_step(step, actions)
        self.cycle_step += 1
        if self.cycle_step == self.plan.refresh_steps:
            self.cycle_step = 0
            self.end_of_cycle()
        return result

    def end_of_cycle(self) -> None:
        """Called after the last step of every cycle."""

    def state_dict(self) -> dict | None:
        """The runner's own state besides the executor's, for byte counts (call after `quiesce`;
        checkpoints: `pipefisher.runtime.training.checkpoint_state`); a first-order run has none."""
        return None

    def quiesce(self) -> None:
        """Finish the collectives in flight that can finish now (before a checkpoint)."""
        complete, _ = self.comm.outstanding(self.cycle_step, self.rank)
        self.executor.settle(complete, [])

    def resume(self) -> None:
        """Continue a cycle restored from a checkpoint at `cycle_step`: collectives finished before
        the checkpoint count as done; this rank's part of the unfinished ones is launched again."""
        complete, incomplete = self.comm.outstanding(self.cycle_step, self.rank)
        self.executor.settle(complete, incomplete)
