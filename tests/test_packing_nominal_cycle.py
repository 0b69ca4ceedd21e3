"""`PackResult.nominal`: where every step of the chosen plan's cycle was simulated at the
profile's own times, `predict` takes the packer's cycle time instead of simulating the plan again
(a tenth of a 1,024-GPU packing). The packer simulates only a cycle's irregular steps and counts
the others as the step with preconditioning only: those cycles are not marked nominal, yet their
cycle time is the plan's too, since a regular step's work runs in the windows that step has
(a precondition with no bubble before the windows that open after it). Pure Python,
BERT-Large's reference times on H100s."""

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
    assert result.cycle_time == pytest.approx(simulated, rel=1e-12, abs=0)


def test_the_packers_cycle_at_a_large_k_is_its_plans(context: PlanContext) -> None:
    """Before, a precondition with no bubble went after every window of its step, so the curvature
    put into the window that opens after it in the step with preconditioning (each Chimera rank's
    two P ops end its work, then the gradient reduction) ran first and delayed it: 0.3-0.8 % of
    a cycle the packer did not count (also `chimera-k-chosen` above)."""
    PACKINGS.clear()
    result, profile = plan_layout(Layout(2, 2, 2, "chimera", 1, 4, 32, method="kfac"), context)
    assert not result.nominal and result.plan.refresh_steps > 20
    assert result.cycle_time == pytest.approx(
        cycle_time(simulate_plan(result.plan, profile, graph=result.graph)), rel=1e-12
    )
