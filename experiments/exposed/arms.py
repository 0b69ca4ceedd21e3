"""The arms of experiments/bench_exposed.py on one rank of its 2-process group: the run config
of each (`Layout.config`: first-order, or one curvature method packed into the bubbles) and a
trainer per arm (`Arm`), all alike but for the optimizer: same run file, seed and data.

A method's arm is a `PipeFisherTrainer`: it measures its profile once, when built (gradients
dropped: the model does not change), and packs from it at refresh interval
`Layout.refresh_steps` (0: the packer's choice, capped at `max_refresh_steps`); re-profiling is
off (`reprofile_threshold` 1e9), so its plan stays fixed. The first-order arm is a `PlanRunner`
of the schedule's plan. `Arm.record_cycles` runs whole refresh cycles with the executor's clock
marks around every op and splits each step into op time, end of step and waits (`RankTime`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from experiments.exposed.stats import RankTime
from experiments.overhead.workloads import ROOT, Workload
from pipefisher.config import RunConfig, load_config
from pipefisher.core.ir import Op
from pipefisher.runtime.training import (
    ExecutorExtension,
    PipeFisherTrainer,
    PlanRunner,
    build_executor,
    build_run,
    schedule_plan,
)

STAGES = 2
#: the suffix of a method's arm with its section's `helpers` on (``muon+helpers``)
HELPED = "+helpers"
#: re-profiling threshold of every method arm: never (a re-profile would be timed as a step)
NO_REPROFILING = 1e9
#: run.steps of every arm: only the learning-rate schedule's length (the arms step on past it never)
RUN_STEPS = 100_000


def method_name(arm: str) -> str:
    """The method an arm runs (`arm` less the `HELPED` suffix)."""
    return arm.removesuffix(HELPED)


@dataclass(frozen=True)
class Layout:
    """What every arm of one schedule shares: the model (`workload`), `schedule` on 2 stages,
    `micro_batches` of `micro_batch_size` sequences, the `first_order` optimizer, the methods'
    refresh interval (`refresh_steps`, 0 = the packer's choice up to `max_refresh_steps`),
    `timeout` [s] for any wait inside the group, the blocks of each stage (`stage_blocks`,
    `pipeline.stage_blocks`; empty: even) and the methods' own `settings`."""

    workload: Workload
    schedule: str
    micro_batches: int
    micro_batch_size: int
    first_order: str
    refresh_steps: int
    max_refresh_steps: int
    timeout: float = 120.0
    stage_blocks: tuple[int, ...] = ()
    #: (section, key, value): a method section's settings on its arms (`--set soap.fold=bubbles`)
    settings: tuple[tuple[str, str, object], ...] = ()

    def overrides(self, method: str | None) -> dict[str, dict[str, object]]:
        """{section: {key: value}} on the workload's run file for the first-order arm (`method`
        None) or a method's arm (`HELPED`: with its section's `helpers` on)."""
        sections: dict[str, dict[str, object]] = {
            "model": dict(self.workload.model),
            "pipeline": {
                "schedule": self.schedule,
                "stages": STAGES,
                "micro_batches": self.micro_batches,
                "data_parallel": 1,
                "stage_blocks": list(self.stage_blocks),
            },
            "data": {"micro_batch_size": self.micro_batch_size},
            "optimizer": {"name": method_name(method) if method else self.first_order},
            "run": {"steps": RUN_STEPS, "backend": "gloo", "timeout": self.timeout},
        }
        if method is not None:
            name, helped = method_name(method), method.endswith(HELPED)
            sections[name] = {
                "placement": "packed",
                "refresh_steps": self.refresh_steps,
                "reprofile_threshold": NO_REPROFILING,
                "profile": "",
                "plan": "",
                "helpers": helped,
            }
            if not self.refresh_steps:
                sections[name]["max_refresh_steps"] = self.max_refresh_steps
            sections[name].update({key: value for section, key, value in self.settings if section == name})
        return sections

    def config(self, method: str | None) -> RunConfig:
        return load_config(ROOT / self.workload.run_file).with_overrides(**self.overrides(method))


class _Marks(ExecutorExtension):
    """The clock's marks around every op while `records` is on."""

    def __init__(self) -> None:
        self.records = False
        self.marks: list[tuple[Op, object, object]] = []

    def record(self, op: Op, start: object, end: object) -> None:
        self.marks.append((op, start, end))


class Arm:
    """One arm's executor and trainer on this rank of the group (building it is collective: every
    rank builds the arms in the same order). `method` None: the first-order arm."""

    def __init__(self, layout: Layout, method: str | None, rank: int):
        self.method = method
        self.config = layout.config(method)
        run = build_run(self.config)
        self.executor, schedule = build_executor(self.config, rank, torch.device("cpu"), run)
        self.executor.steps = RUN_STEPS  # each step prepares the next one's micro-batches, as in a run
        self.runner: PlanRunner
        if method is None:
            self.runner = PlanRunner(self.executor, rank, schedule_plan(schedule), self.executor.tied)
        else:
            self.runner = PipeFisherTrainer(self.config, self.executor, rank, self.executor.tied, model=run.model)
        self.marks = _Marks()
        self.executor.extend(self.marks)
        self.step = 0
        #: the last step's record (refresh interval, the run's own exposed-time estimate)
        self.extra: dict = {}

    @property
    def k(self) -> int:
        """The refresh interval (1 for the first-order arm)."""
        return self.runner.plan.refresh_steps

    def run(self, steps: int) -> None:
        for _ in range(steps):
            self.extra = self.runner.run_step(self.step).extra
            self.step += 1

    def record_cycles(self, rank: int, cycles: int) -> RankTime:
        """Run `cycles` refresh cycles (from a cycle's first step) with every op's clock marks; their
        mean step as the runner takes it (the step and the runner's own work after it: a cycle's end)."""
        if self.runner.cycle_step != 0:
            raise RuntimeError(f"arm {self.method}: recorded cycles must start at a cycle's first step")
        clock = self.executor.clock
        steps = cycles * self.k
        wall = ops = compute = end = 0.0
        for _ in range(steps):
            self.marks.records, self.marks.marks = True, []
            before = clock.mark()
            self.runner.run_step(self.step)
            after = clock.mark()
            self.marks.records = False
            self.step += 1
            wall += clock.elapsed_ms(before, after)
            ops += sum(clock.elapsed_ms(a, b) for _, a, b in self.marks.marks)
            compute += sum(clock.elapsed_ms(a, b) for op, a, b in self.marks.marks if op.kind.is_compute)
            if self.marks.marks:
                end += clock.elapsed_ms(self.marks.marks[-1][2], after)
        self.marks.marks = []
        return RankTime(rank, wall / steps, ops / steps, end / steps, compute / steps)
