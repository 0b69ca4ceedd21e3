"""The layout search: every layout of a GPU count (`layout_candidates`), pruned cheaply, the best
packed. Pure Python: no torch.

1. enumerate the layouts (first-order method);
2. simulate each one's first-order step (cheap) and take its memory per rank twice: with the
   first-order state and with the curvature method's (without captures; or, where larger, the
   refresh copies every plan holds at its cycle's end: `method_memory`);
3. drop what exceeds the budget; of layouts that differ only in their gradient path (ZeRO-1/2/3,
   PowerSGD) keep the fastest (then smallest): for a curvature method, by the step with its
   end-of-step work (`step_end_time`: ZeRO-1's owners share it, ZeRO-2/3 replicas each do all of it);
4. pack the curvature method for the fastest, at most `top`, by the step with the method's
   end-of-step work (`step_end_time`; the first-order step for a method without any) (captures
   capped to the budget's headroom where they do not fit) and drop those whose captures still do
   not fit; stop once `shown` packed layouts fit and the next one's step with its step end is
   already longer than the `shown`-th packed one (packing only adds time to it, so the first
   `shown` places are exact);
5. rank by predicted time per step, then memory.

`SearchResult` says how many layouts each step enumerated, dropped and packed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace

from pipefisher.planning.planner.candidates import Layout, SearchSpace, check_sources_cover, enumerate_layouts
from pipefisher.planning.planner.layout_memory import MemoryUse, layout_memory
from pipefisher.planning.planner.model_sizes import PlanError
from pipefisher.planning.planner.predict import (
    PlanContext,
    Prediction,
    first_order_time,
    is_curvature,
    method_memory,
    predict,
    step_end_time,
)
from pipefisher.planning.planner.search_pool import SearchPool, inputs
from pipefisher.planning.planner.stage_balance import balanced_split

#: layouts packed per search (the fastest by first-order time that fit)
DEFAULT_PACKED = 12
GiB = 2**30


@dataclass(frozen=True)
class SearchResult:
    """`ranked`: predictions of the method that fit, fastest first; `first_order`: the fastest
    first-order layouts that fit (for comparison); counts of each step; `seconds` the search took."""

    ranked: tuple[Prediction, ...]
    first_order: tuple[Prediction, ...]
    method: str
    enumerated: int
    over_budget: int
    dominated: int  # slower or bigger variants of a kept layout (recompute where none fits, another gradient path)
    packed: int
    over_after_packing: int
    seconds: float
    #: every packed layout's prediction (fitting or not), by its layout before packing
    predictions: dict[Layout, Prediction] = field(default_factory=dict, compare=False)

    @property
    def best(self) -> Prediction:
        return self.ranked[0]

    def rank_of(self, layout: Layout) -> int | None:
        """1-based place of `layout` (any refresh interval) among the ranked, or None."""
        key = replace(layout, refresh_steps=0)
        return next((i for i, p in enumerate(self.ranked, 1) if replace(p.layout, refresh_steps=0) == key), None)


@dataclass(frozen=True)
class _Inputs:
    """What every phase of a search reads (in each worker of its `SearchPool`)."""

    context: PlanContext
    method: str
    first_order: str
    budget: int


def _progress(results: Iterator, total: int, what: str, shown: bool) -> Iterable:
    """`results`, with a progress bar on stderr once the loop has taken 2 s, when `shown` and stderr is a terminal."""
    from tqdm import tqdm

    from pipefisher.core.terminal import progress_bars

    return tqdm(
        results, total=total, desc=what, delay=2.0, leave=False, unit="layout", disable=not (shown and progress_bars())
    )


def _memory(layout: Layout, first_order: str, context: PlanContext) -> MemoryUse:
    workers = context.workers_per_layer(layout)
    settings = context.layer_settings(layout)
    return layout_memory(layout, context.sizes, first_order, context.momentum, context.precision, workers, settings)


def _memories(layout: Layout) -> tuple[MemoryUse, MemoryUse]:
    """The layout's memory with the first-order state, and the least it needs with the searched
    method before packing (`method_memory`; the same where the layout runs that method already: a
    first-order search)."""
    given: _Inputs = inputs()
    plain = _memory(layout, given.first_order, given.context)
    if layout.method == given.method:
        return plain, plain
    return plain, method_memory(replace(layout, method=given.method), given.context)


def _first_order_step(layout: Layout) -> tuple[float, float, float]:
    return first_order_time(layout, inputs().context)


def _step_end_step(layout: Layout) -> float:
    given: _Inputs = inputs()
    return step_end_time(replace(layout, method=given.method), given.context)


def _step_end_steps(pool: SearchPool, layouts: list[Layout]) -> dict[Layout, float]:
    """Each layout's `step_end_time` with the searched method."""
    return dict(zip(layouts, pool.map(_step_end_step, layouts, _pipeline_shape)))


def _packed(layout: Layout) -> Prediction:
    given: _Inputs = inputs()
    return predict(replace(layout, method=given.method), given.context, given.budget)


def _pipeline_shape(layout: Layout) -> tuple:
    """What decides the layout's schedule (layouts that share it share the caches built on it)."""
    return (layout.schedule, layout.stages, layout.chunks, layout.micro_batches)


def _pipeline_key(layout: Layout) -> Layout:
    """The layout without its gradient path (what ZeRO-1 and PowerSGD variants share)."""
    return replace(layout, zero=0, powersgd_rank=0)


def _balancer(context: PlanContext) -> Callable[[Layout], tuple[int, ...]]:
    """A layout's balanced split on the context's time source (`balanced_split`), once per
    pieces, micro-batch size and degree."""
    found: dict[tuple[int, int, int], tuple[int, ...]] = {}

    def balance(layout: Layout) -> tuple[int, ...]:
        key = (layout.pieces, layout.micro_batch_size, layout.tensor_parallel)
        if key not in found:
            found[key] = balanced_split(context.source, context.sizes.blocks, *key)
        return found[key]

    return balance


def search(
    space: SearchSpace,
    context: PlanContext,
    method: str,
    memory_budget: int,
    top: int = DEFAULT_PACKED,
    shown: int = 10,
    progress: bool = False,
    jobs: int = 1,
    also: Sequence[Layout] = (),
    uneven: bool = True,
) -> SearchResult:
    """The ranked layouts of `space` for optimizer `method` within `memory_budget` bytes per device
    (module docstring); `shown`: the places that must be exact; `jobs`: processes that share the
    work (`SearchPool`; the result does not depend on them); `also`: layouts of `method` to
    predict beside the search (in `predictions`; e.g. the run file's own, fitting or not); `uneven`:
    try each pipeline on the split that balances its pieces too (`stage_balance`). PlanError where
    no layout exists or none fits (naming the least memory any needs)."""
    started = time.perf_counter()
    first_order = context.first_order if is_curvature(method) else method
    balance = _balancer(context) if uneven else None
    section = context.section if is_curvature(method) else None
    layouts = enumerate_layouts(space, context.sizes, first_order, planned=method, balance=balance, section=section)
    problem = check_sources_cover(space, context.sizes, layouts)
    if problem:
        raise PlanError(problem)
    with SearchPool(jobs, _Inputs(context, method, first_order, memory_budget)) as pool:
        extra = {layout: pool.later(_packed, layout) for layout in also}
        found = _progress(pool.map(_memories, layouts, _pipeline_shape), len(layouts), "memory", progress)
        memory = [(layout, plain, own) for layout, (plain, own) in zip(layouts, found)]
        fits = {layout: (plain.total <= memory_budget, own.total <= memory_budget) for layout, plain, own in memory}

        def needed(layout: Layout, which: int) -> bool:
            """Fits, and is not a recompute variant of a layout that fits without recomputing (slower, never better)."""
            return fits[layout][which] and (
                layout.recompute == "none" or not fits[replace(layout, recompute="none")][which]
            )

        simulated = [(layout, plain, own) for layout, plain, own in memory if needed(layout, 0) or needed(layout, 1)]
        steps = _progress(
            pool.map(_first_order_step, [layout for layout, _, _ in simulated], _pipeline_shape),
            len(simulated),
            "simulating",
            progress,
        )
        quick = [
            (Prediction(layout, ms, ms, bubble, 0.0, reduce_ms, plain, context.sizes.seq_len), own)
            for (layout, plain, own), (ms, bubble, reduce_ms) in zip(simulated, steps)
        ]
        fitting_first = sorted((p for p, _ in quick if needed(p.layout, 0)), key=lambda p: (p.step_ms, p.memory.total))
        fitting = [(p, own) for p, own in quick if needed(p.layout, 1)]
        if not fitting:
            least = min(memory, key=lambda entry: entry[2].total)
            raise PlanError(
                f"--memory-gb {memory_budget / GiB:g}: no layout fits; the smallest needs {least[2].total / GiB:.2f} GiB "
                f"per device ({least[0].describe()}, recompute {least[0].recompute}{f', ZeRO-{least[0].zero}' if least[0].zero else ''})"
            )
        variants: dict[Layout, list[tuple[Prediction, MemoryUse]]] = {}
        for prediction, own in fitting:
            variants.setdefault(_pipeline_key(prediction.layout), []).append((prediction, own))
        with_step_end = _step_end_steps(pool, [p.layout for p, _ in fitting]) if is_curvature(method) else {}

        def step_with_its_end(pair: tuple[Prediction, MemoryUse]) -> tuple[float, int]:
            return with_step_end.get(pair[0].layout, pair[0].step_ms), pair[1].total

        kept = sorted((min(group, key=step_with_its_end) for group in variants.values()), key=step_with_its_end)
        over_budget = sum(not fit[1] for fit in fits.values())
        counts = (len(layouts), over_budget, len(layouts) - over_budget - len(kept))
        if not is_curvature(method):
            ranked = [p for p, _ in kept]
            own = {layout: result() for layout, result in extra.items()}
            seconds = time.perf_counter() - started
            return SearchResult(tuple(ranked), tuple(fitting_first), method, *counts, 0, 0, seconds, own)
        candidates = [p for p, _ in kept[:top]]
        packings = _progress(
            pool.lookahead(_packed, [p.layout for p in candidates]), len(candidates), "packing", progress
        )
        packed: list[Prediction] = []
        for following, prediction in enumerate(packings, 1):
            packed.append(prediction)
            fitting_packed = sorted(p.step_ms for p in packed if p.memory.total <= memory_budget)
            if following == len(candidates) or (
                len(fitting_packed) >= shown and step_with_its_end(kept[following])[0] >= fitting_packed[shown - 1]
            ):
                break  # packing only adds time: no later layout enters the top `shown`
        predictions = {replace(p.layout, method=method): packing for p, packing in zip(candidates, packed)}
        predictions.update((layout, result()) for layout, result in extra.items())
    ranked = sorted((p for p in packed if p.memory.total <= memory_budget), key=lambda p: (p.step_ms, p.memory.total))
    if not ranked:
        smallest = min(packed, key=lambda p: p.memory.total)
        raise PlanError(
            f"--memory-gb {memory_budget / GiB:g}: no packed layout fits with its captures; the smallest needs "
            f"{smallest.memory.total / GiB:.2f} GiB per device ({smallest.layout.describe()})"
        )
    return SearchResult(
        tuple(ranked),
        tuple(fitting_first),
        method,
        *counts,
        len(packed),
        len(packed) - len(ranked),
        time.perf_counter() - started,
        predictions,
    )
