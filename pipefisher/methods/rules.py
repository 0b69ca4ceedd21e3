"""Curvature methods as the planner sees them: the tasks a method has per layer and what each waits for.

Every method's work of one layer is two *factors* (A and B: K-FAC's input and output-gradient
factors, Shampoo's left and right statistics) and is expressed in the same op kinds, so the
packer, plans, the NCCL-order check, the simulator and viz serve all methods alike:

- curvature CA/CB per micro-batch (methods whose factors are sums over micro-batches);
- a sync SA/SB per factor input, an all-reduce over the stage's replicas (pipes x data-parallel);
- refresh work IA/IB per factor (K-FAC: damped inverse; Shampoo: statistics and inverse root);
- an exchange X per layer when the refresh work is split among the replicas;
- a precondition P per stage in every step, for methods that precondition before the gradient
  reduction (a method that needs the reduced gradient preconditions in the optimizer step).

Methods differ in where a factor's input comes from (`TaskRules`). Pure Python: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipefisher.core.ir import ScheduleError

FACTORS = ("A", "B")


@dataclass(frozen=True)
class TaskRules:
    """The task structure of one curvature method (`label`: its name in reports).

    `curvature`: each factor is built from per-micro-batch curvature tasks of the cycle's first
    step (CA/CB); otherwise from the stage's whole gradient of that step (after its backwards).
    `syncs`: the inputs all-reduced over a replicated stage, one sync op each, named by factor.
    `sync_of[f]`: the sync whose result factor f's refresh work reads.
    `precondition`: a per-step precondition op after the stage's backwards, before the gradient
    reduction (False: the method preconditions in the optimizer step, on the reduced gradient).
    """

    name: str
    label: str
    curvature: bool
    syncs: tuple[str, ...]
    sync_of: tuple[tuple[str, str], ...]
    precondition: bool

    def sync_for(self, factor: str) -> str:
        return dict(self.sync_of)[factor]


KFAC_RULES = TaskRules("kfac", "K-FAC", curvature=True, syncs=("A", "B"), sync_of=(("A", "A"), ("B", "B")), precondition=True)
#: Shampoo's statistics need the stage's whole gradient: one sync (named A) carries it to both factors
SHAMPOO_RULES = TaskRules("shampoo", "Shampoo", curvature=False, syncs=("A",), sync_of=(("A", "A"), ("B", "A")), precondition=False)
METHODS = {rules.name: rules for rules in (KFAC_RULES, SHAMPOO_RULES)}


def task_rules(name: str) -> TaskRules:
    """The rules of method `name`; ScheduleError naming the known ones otherwise."""
    try:
        return METHODS[name]
    except KeyError:
        raise ScheduleError(f"method: {name!r} is not a curvature method; use one of {', '.join(METHODS)}") from None
