"""One packed plan the packer weighs (`Candidate`), and what the capture cap needs of a packing
(`Packing`). Pure Python: no torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from pipefisher.core.ir import Op
from pipefisher.planning.packing.greedy import Greedy, Strategy
from pipefisher.planning.packing.options import PackOptions
from pipefisher.planning.packing.plan_builder import Built, PlanBuilder
from pipefisher.planning.packing.windows import Placed
from pipefisher.planning.plan import Plan
from pipefisher.planning.tasks import CurvatureTasks


@dataclass(frozen=True)
class Candidate:
    """A plan at one k: its predicted cycle time, the tasks it runs outside windows, and which
    placement produced it; `simulated`: whether every step of that cycle time was simulated (else
    its regular steps count as the preconditioned step, `_Packing.evaluate`)."""

    plan: Plan
    cycle_time: float
    leftovers: tuple[Op, ...]
    source: str
    simulated: bool = False

    @property
    def refresh_steps(self) -> int:
        return self.plan.refresh_steps


class Packing(Protocol):
    """Candidate plans of one task set on one first-order timeline (`pack._Packing`)."""

    tasks: CurvatureTasks
    options: PackOptions
    builder: PlanBuilder
    #: the steps of the greedy's full run (`placed`)
    horizon: int

    def greedy(self, strategy: Strategy) -> Greedy: ...

    def placed(self, strategy: Strategy) -> Placed: ...

    def evaluate(self, built: Built, source: str) -> Candidate: ...
