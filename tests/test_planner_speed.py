"""The planner's packing cache (`PackCache`, issue 46 item 5): the cached search ranks exactly as
an uncached one, and a layout is packed once per distinct stage profile."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pipefisher.config import load_config
from pipefisher.core.profile import load_profile
from pipefisher.planning.planner.candidates import Layout, SearchSpace
from pipefisher.planning.planner.layout_memory import MemoryUse, activation_per_rank, layout_memory, state_per_rank
from pipefisher.planning.planner.model_sizes import model_sizes
from pipefisher.planning.planner.pack_cache import PACKINGS
from pipefisher.planning.planner.predict import layout_profile, pack_options, predict
from pipefisher.planning.planner.run_layout import run_layout
from pipefisher.planning.planner.search import GiB, search
from pipefisher.planning.planner.table import ranked_table

PROFILE = "profiles/tiny-cpu-1f1b.yaml"


def _context(schedule: str = "1f1b", data_parallel: int = 1):
    config = load_config("schedules/tiny-cpu.yaml").with_overrides(
        pipeline={"schedule": schedule, "data_parallel": data_parallel}, optimizer={"name": "kfac"}
    )
    return run_layout(config, load_profile(PROFILE), PROFILE)


def _table(context, budget: int) -> str:
    space = SearchSpace(4, 32, (8,), (1,), recompute=("none",))
    result = search(space, context, "kfac", budget, top=6, shown=6)
    return ranked_table(result.ranked, budget, 6)


def test_the_cached_search_ranks_exactly_as_the_uncached_one() -> None:
    _, context = _context()
    budget = 2 * GiB
    PACKINGS.clear()
    PACKINGS.enabled = False
    try:
        uncached = _table(context, budget)
        packings = PACKINGS.misses
    finally:
        PACKINGS.enabled = True
    PACKINGS.clear()
    assert _table(context, budget) == uncached
    assert PACKINGS.misses == packings > 1
    assert _table(context, budget) == uncached  # now every packing from the cache
    assert (PACKINGS.hits, PACKINGS.misses) == (packings, packings)


def test_a_search_over_processes_ranks_exactly_as_one_in_this_process() -> None:
    """`jobs` > 1: forked workers compute memory, first-order steps and packings; the same result,
    including every packed layout's prediction (the stop rule reads them in the same order)."""
    _, context = _context("chimera")
    space = SearchSpace(4, 32, (8,), (1,), recompute=("none",))
    PACKINGS.clear()
    alone = search(space, context, "kfac", 2 * GiB, top=4, shown=2, jobs=1)
    PACKINGS.clear()
    shared = search(space, context, "kfac", 2 * GiB, top=4, shown=2, jobs=2)
    assert PACKINGS.misses == 0  # every packing ran in a worker
    assert shared.predictions == alone.predictions and len(alone.predictions) == alone.packed > 1
    assert replace(shared, seconds=0.0) == replace(alone, seconds=0.0)


def test_packing_runs_once_per_distinct_stage_profile() -> None:
    layout, context = _context("chimera")
    layouts = [
        layout,
        layout,
        replace(layout, zero=1),  # one pipe pair, no data-parallel copies: ZeRO-1 changes no stage time
        replace(layout, data_parallel=2, micro_batches=2),
        replace(layout, schedule="1f1b"),
    ]
    keys = {
        (item.schedule, item.stages, item.micro_batches, layout_profile(item, context), pack_options(item, context))
        for item in layouts
    }
    PACKINGS.clear()
    for item in layouts:
        predict(item, context)
    assert PACKINGS.misses == len(keys) == 3
    assert PACKINGS.hits == len(layouts) - len(keys)


@pytest.mark.parametrize(
    "layout",
    [
        Layout(4, 2, 1, "1f1b", 1, 8, 8, zero=1, method="kfac"),
        Layout(4, 2, 2, "chimera", 1, 8, 8, method="kfac"),
        Layout(2, 4, 1, "gpipe", 1, 4, 8, zero=1, method="adamw"),
        Layout(4, 2, 1, "chimera", 1, 8, 8, zero=3, method="adamw"),
        Layout(2, 3, 1, "interleaved", 2, 4, 8, powersgd_rank=4, method="sgd"),
    ],
    ids=lambda layout: layout.describe(),
)
def test_layout_memory_is_the_rank_a_scan_over_every_rank_finds(layout: Layout) -> None:
    """`layout_memory` looks at one rank per pipeline position (the heaviest state there): the
    same rank and bytes as the maximum over every rank (first of ties)."""
    sizes = model_sizes(load_config("schedules/bert-base-1f1b-4x4.yaml"))
    states = state_per_rank(layout, sizes, "adamw", 0.9)
    activations = activation_per_rank(layout, sizes)
    scanned = max(
        (MemoryUse(rank, state.total_bytes, activations[rank % len(activations)]) for rank, state in enumerate(states)),
        key=lambda use: use.total,
    )
    assert len(states) == layout.stages * layout.data_parallel
    assert layout_memory(layout, sizes, "adamw", 0.9) == scanned
