"""The planner's memory floor of a curvature method before packing (`method_memory`,
`refresh_floor`): every plan of K-FAC holds each layer's refresh copy from its first curvature
task to the cycle's end, so a packed plan needs at least the state, the buffers and all of a
rank's copies. The floor holds under the packed plans the planner builds, and the search packs no
layout that it already rules out. Pure Python, BERT-Large's reference times."""

from __future__ import annotations

from dataclasses import replace

import pytest
from builders import bert_large_context

from pipefisher.planning.planner.candidates import Layout, SearchSpace, enumerate_layouts
from pipefisher.planning.planner.layout_memory import layout_memory
from pipefisher.planning.planner.predict import PlanContext, first_order_time, method_memory, predict
from pipefisher.planning.planner.search import search


@pytest.fixture(scope="module")
def context() -> PlanContext:
    return bert_large_context()


def _space() -> SearchSpace:
    return SearchSpace(8, 64, (8, 16), (1, 2), schedules=("1f1b", "chimera", "zb-h1"), recompute=("none", "blocks"))


def _held(layout: Layout, context: PlanContext) -> int:
    return layout_memory(layout, context.sizes, context.first_order, context.momentum, context.precision).total


def _kfac_layouts(context: PlanContext) -> list[Layout]:
    return [replace(layout, method="kfac") for layout in enumerate_layouts(_space(), context.sizes, "adamw")]


def test_the_floor_is_below_every_packed_plan_and_above_the_memory_without_copies(context: PlanContext) -> None:
    layouts = _kfac_layouts(context)
    chosen = [layouts[i] for i in range(0, len(layouts), max(1, len(layouts) // 8))]
    raised = 0
    for layout in chosen:
        floor, packed = method_memory(layout, context), predict(layout, context).memory
        assert _held(layout, context) <= floor.total <= packed.total, layout.describe()
        raised += floor.total > _held(layout, context)
    assert raised, "no layout whose refresh copies outweigh its activations: the floor was never tested"


def test_the_search_packs_no_layout_the_floor_rules_out(context: PlanContext) -> None:
    """A budget between a layout's memory without copies and its floor: the old rule packed it
    (its memory fits) and dropped it after packing; now it is not packed, and it could not fit."""
    layouts = [
        layout for layout in _kfac_layouts(context) if method_memory(layout, context).total > _held(layout, context)
    ]
    assert layouts
    ruled_out = min(layouts, key=lambda layout: first_order_time(layout, context)[0])
    budget = (_held(ruled_out, context) + method_memory(ruled_out, context).total) // 2
    assert predict(ruled_out, context, budget).memory.total > budget
    result = search(_space(), context, "kfac", budget, top=4, shown=2)
    packed = set(result.predictions)
    assert ruled_out not in packed
    assert all(method_memory(layout, context).total <= budget for layout in packed)
