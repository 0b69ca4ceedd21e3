"""The planner's memory floor of a curvature method before packing (`method_memory`,
`refresh_floor`): every plan of K-FAC holds each layer's refresh copy from its first curvature
task to the cycle's end, and every plan of SOAP each matrix's pending eigenbases from its first
refresh op to the commit, so a packed plan needs at least the state, the buffers and all of a
rank's copies. The floor holds under the packed plans the planner builds, and the search packs no
layout that it already rules out. Pure Python, BERT-Large's reference times (SOAP: the H100's
flop model)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from builders import bert_large_context, flop_context

from pipefisher.planning.planner.candidates import Layout, SearchSpace, enumerate_layouts
from pipefisher.planning.planner.layout_memory import layout_memory
from pipefisher.planning.planner.predict import PlanContext, method_memory, predict
from pipefisher.planning.planner.search import search


@pytest.fixture(scope="module")
def context() -> PlanContext:
    return bert_large_context()


def _space() -> SearchSpace:
    return SearchSpace(8, 64, (8, 16), (1, 2), schedules=("1f1b", "chimera", "zb-h1"), recompute=("none", "blocks"))


def _held(layout: Layout, context: PlanContext) -> int:
    return layout_memory(layout, context.sizes, context.first_order, context.momentum, context.precision).total


def _layouts(context: PlanContext, method: str) -> list[Layout]:
    return [replace(layout, method=method) for layout in enumerate_layouts(_space(), context.sizes, "adamw")]


def _assert_the_floor_bounds_every_packed_plan(context: PlanContext, method: str) -> None:
    """Over 8 of the space's layouts: memory without copies <= floor <= packed plan, and the
    copies raise the floor above the memory without them on one at least."""
    layouts = _layouts(context, method)
    chosen = [layouts[i] for i in range(0, len(layouts), max(1, len(layouts) // 8))]
    raised = 0
    for layout in chosen:
        floor, packed = method_memory(layout, context), predict(layout, context).memory
        assert _held(layout, context) <= floor.total <= packed.total, layout.describe()
        raised += floor.total > _held(layout, context)
    assert raised, "no layout whose refresh copies outweigh its activations: the floor was never tested"


def test_the_floor_is_below_every_packed_plan_and_above_the_memory_without_copies(context: PlanContext) -> None:
    _assert_the_floor_bounds_every_packed_plan(context, "kfac")


def test_soaps_pending_bases_are_a_floor_too() -> None:
    """SOAP has no curvature tasks; its pending bases are held from each matrix's first refresh
    op to the commit, so they bound every packed plan from below as K-FAC's copies do."""
    soap, _ = flop_context("soap")
    _assert_the_floor_bounds_every_packed_plan(soap, "soap")


def test_the_search_packs_no_layout_the_floor_rules_out(context: PlanContext) -> None:
    """A layout whose refresh copies outweigh its activations: at a budget of its floor the search
    packs it; at a budget between its memory without copies and its floor it is not packed (the
    old rule packed it there and dropped it after packing), and its packed plan does not fit."""
    layout = Layout(2, 2, 2, "1f1b", 1, 4, 8, zero=1, method="kfac", recompute="blocks")
    floor = method_memory(layout, context).total
    assert floor > _held(layout, context)
    assert layout in search(_space(), context, "kfac", floor, top=4, shown=2).predictions
    budget = (_held(layout, context) + floor) // 2
    assert predict(layout, context, budget).memory.total > budget
    packed = search(_space(), context, "kfac", budget, top=4, shown=2).predictions
    assert layout not in packed
    assert all(method_memory(other, context).total <= budget for other in packed)
