"""`PackResult.nominal`: where every step of the chosen plan's cycle was simulated at the
profile's own times, `predict` takes the packer's cycle time instead of simulating the plan again
(a tenth of a 1,024-GPU packing). The packer simulates only a cycle's irregular steps and counts
the others as the preconditioned step, which is close to them but not exact: those cycles are
not marked. Pure Python, BERT-Large's reference times on H100s."""

from __future__ import annotations

from dataclasses import replace

import pytest
from builders import bert_large_context

from pipefisher.planning.plan import cycle_time, simulate_plan
from pipefisher.planning.planner.candidates import Layout
from pipefisher.planning.planner.pack_cache import PACKINGS
from pipefisher.planning.planner.predict import PlanContext, plan_layout


@pytest.fixture(scope="module")
def context() -> PlanContext:
    return bert_large_context("h100")


@pytest.mark.parametrize(
    ("layout", "helpers", "nominal"),
    [
        (Layout(2, 4, 1, "chimera", 1, 2, 32, method="kfac"), False, False),  # the packer's k (120): regular steps
        (Layout(2, 4, 1, "chimera", 1, 2, 32, method="kfac", refresh_steps=1), False, True),
        (Layout(4, 2, 1, "1f1b", 1, 4, 32, method="kfac", refresh_steps=2), False, True),
        (Layout(4, 1, 2, "1f1b", 1, 8, 32, method="kfac"), True, True),  # help ops: the helped cycle simulated
    ],
    ids=["chimera-k-chosen", "chimera-k1", "1f1b-k2", "1f1b-helpers"],
)
def test_a_nominal_packing_has_the_cycle_its_plan_simulates_to(
    context: PlanContext, layout: Layout, helpers: bool, nominal: bool
) -> None:
    PACKINGS.clear()
    own = replace(context, section=replace(context.section, helpers=helpers))
    result, profile = plan_layout(layout, own)
    simulated = cycle_time(simulate_plan(result.plan, profile, graph=result.graph))
    assert bool(result.plan.helped) == helpers
    assert result.nominal == nominal
    if nominal:
        assert result.cycle_time == simulated
    else:
        assert result.cycle_time != simulated  # the packer's shortcut, which `predict` does not take
