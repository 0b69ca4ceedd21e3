"""The packer: place a refresh cycle's curvature tasks (K-FAC's or Shampoo's, as the profile's
`method` says) into the bubbles of a pipeline schedule.

For every refresh interval k from the lower bound (ceil(work / bubble time) of the busiest rank)
up to the first k without overhead, it keeps the fastest predicted plan among: the ``fill``
greedy (largest ready task that fits) with leftovers at the end of the cycle or spread where they
cost least, the published PipeFisher rule's plan at that k, and the after-step placement at that
k. So at every k the plan is never predicted slower than the published rule's or than doing the
work after the step. Where the schedule splits the backward and `move_weights` is on, the fill
greedy also runs with the weight gradients (W ops) moving within their step
(`pipefisher.planning.packing.weights`: pulled earlier, ``first``, or postponed, ``last``), and those plans
join the candidates: a plan is never predicted slower than with the W ops where the schedule put
them. The list of (k, overhead) is the *frontier*.

The default k (`choose`): the smallest k on the frontier whose overhead, less what work that fits
no window costs at that k, stays within `max_overhead`; if work that fits no window still costs
more than `max_overhead`, k grows to amortise it while one more step saves at least `max_overhead`
of the step time. `max_refresh_steps` caps k. With `max_capture_mb`, curvature moves into earlier
steps (and, past the bubbles, right after its forward/backward, at some overhead) until the
captures held fit. K-FAC task times are the profile's `percentile` of its samples where it keeps
them; forward/backward times stay nominal (see `tasks_at_percentile`).
Pure Python: no torch.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from functools import cached_property

from pipefisher.core.ir import Op, OpKind, Schedule
from pipefisher.core.profile import Profile
from pipefisher.planning.memory.captures import capture_peaks
from pipefisher.planning.packing.greedy import STRATEGIES, Greedy, Strategy
from pipefisher.planning.packing.helpers import place_helpers
from pipefisher.planning.packing.windows import Placed, Windows, step_windows
from pipefisher.planning.packing.candidate import Candidate
from pipefisher.planning.packing.capture_cap import fit_capture
from pipefisher.planning.packing.bounds import lower_bounds, precondition_in_bubbles
from pipefisher.planning.packing.exposed import first_order_step_time
from pipefisher.planning.packing.options import PackOptions
from pipefisher.planning.packing.plan_builder import Built, PlanBuilder
from pipefisher.planning.packing.report import DeviceReport, FrontierPoint, PackResult, device_reports
from pipefisher.planning.packing.weights import WeightPolicy
from pipefisher.planning.plan import Plan, simulate_plan, simulate_plan_step
from pipefisher.planning.simulate import COLLECTIVES, Timeline, simulate
from pipefisher.planning.tasks import CurvatureTasks, build_tasks
from pipefisher.planning.vocabulary import TaskRules

__all__ = ["PackOptions", "PackResult", "DeviceReport", "FrontierPoint", "pack", "after_step_plan", "STRATEGIES"]

#: the greedy's horizon: a cycle needs at most this many steps to place what fits
_HORIZON = 512
_EXACT = 1e-9


class _Packing:
    """Candidate plans of one task set on one first-order timeline, cached per k."""

    def __init__(self, tasks: CurvatureTasks, first_order: Timeline, options: PackOptions):
        self.tasks, self.first_order, self.options = tasks, first_order, options
        self.horizon = _HORIZON
        self.windows: Windows = step_windows(tasks, first_order, options.margin)
        self.builder = PlanBuilder(tasks, first_order, self.windows)
        self.cache: dict = {}
        self._placed: dict[tuple[Strategy, WeightPolicy], Placed] = {}
        self._greedy: dict[tuple[Strategy, WeightPolicy], Greedy] = {}
        #: how the fill greedy may place weight gradients besides where the schedule put them
        moving = options.move_weights and tasks.schedule.splits_backward
        self.weight_policies: tuple[WeightPolicy, ...] = ("first", "last") if moving else ()
        self.bounds = lower_bounds(tasks, first_order, self.windows)
        self._best: dict[int, Candidate] = {}
        self.all_cycle_work = [op for ops in tasks.cycle for op in ops if op.kind not in COLLECTIVES]

    @property
    def precondition_time(self) -> float:
        """A step's time with preconditioning as its only K-FAC work."""
        return self.windows.preconditioned.step_time

    def greedy(self, strategy: Strategy, weights: WeightPolicy = "fixed") -> Greedy:
        """The greedy with `strategy` and W ops placed by `weights` (built once, run as needed)."""
        key = (strategy, weights)
        if key not in self._greedy:
            like = next(iter(self._greedy.values()), None)  # (its units are the same)
            self._greedy[key] = Greedy(self.tasks, self.first_order, self.windows, strategy, weights, like)
        return self._greedy[key]

    def placed(self, strategy: Strategy, weights: WeightPolicy = "fixed") -> Placed:
        """The greedy's placement with `strategy` and W ops placed by `weights` (run once)."""
        key = (strategy, weights)
        if key not in self._placed:
            self._placed[key] = self.greedy(strategy, weights).run(_HORIZON)
        return self._placed[key]

    def natural(self, strategy: Strategy) -> int:
        """Steps the greedy used for everything it placed."""
        placed = self.placed(strategy).tasks
        return 1 + max((p.slot.step for p in placed.values()), default=0)

    def evaluate(self, built: Built, source: str) -> Candidate:
        """The candidate of `built`: only its irregular steps are simulated."""
        plan = built.plan
        total = sum(
            simulate_plan_step(plan, j, self.tasks.durations, self.cache, self.tasks.graph).step_time
            if j in built.irregular
            else self.precondition_time
            for j in range(plan.refresh_steps)
        )
        simulated = all(j in built.irregular for j in range(plan.refresh_steps))
        return Candidate(plan, total, tuple(built.leftovers), source, simulated)

    def candidates(self, k: int) -> list[Candidate]:
        """The plans at k, fastest first (see the module docstring)."""
        if self.options.strategy == "published":
            return [self.evaluate(self.builder.plan(self.placed("published"), k, "tail"), "published rule")]
        found = self._fill_candidates(self.placed("fill"), k, "fill")
        for policy in self.weight_policies if self.overhead(found[0]) > _EXACT else ():
            found += self._fill_candidates(self.placed("fill", policy), k, f"fill, weight gradients {policy}")
        if self.overhead(min(found, key=lambda c: c.cycle_time)) > _EXACT:
            found.append(self.evaluate(self.builder.plan(self.placed("published"), k, "tail"), "published rule"))
            after = _after_step(self.tasks, k)
            # its preconditions run after each step's work, not in the bubbles: every step simulated
            found.append(self.evaluate(Built(after, self.all_cycle_work, frozenset(range(k))), "after-step"))
        return [c for _, _, c in sorted((c.cycle_time, i, c) for i, c in enumerate(found))]

    def _fill_candidates(self, placed: Placed, k: int, source: str) -> list[Candidate]:
        """The plans of one greedy placement at k: leftovers at the end, and, if they cost time,
        spread."""
        tail = self.builder.plan(placed, k, "tail")
        found = [self.evaluate(tail, source)]
        if tail.leftovers and self.overhead(found[0]) > _EXACT:
            found.append(self.evaluate(self.builder.plan(placed, k, "spread"), f"{source}, leftovers spread"))
        return found

    @property
    def evaluated(self) -> list[int]:
        return list(self._best)

    def best(self, k: int) -> Candidate:
        if k not in self._best:
            self._best[k] = self.candidates(k)[0]
        return self._best[k]

    def overhead(self, candidate: Candidate) -> float:
        """Mean step time beyond first-order + preconditioning, as a share of first-order."""
        k = candidate.refresh_steps
        return (candidate.cycle_time / k - self.precondition_time) / self.first_order.step_time

    @cached_property
    def unplaceable(self) -> tuple[Op, ...]:
        """Tasks the greedy placed nowhere: each fits no window of its rank."""
        placed = self.placed(self.options.strategy).tasks
        return tuple(op for op in self.all_cycle_work if op not in placed)

    def unavoidable(self, k: int, settled: int) -> float:
        """Overhead share at k of the work that fits no window: what the best plan at `settled`
        (a k where everything else fits) spends, spread over k steps instead."""
        return self.overhead(self.best(settled)) * settled / k


def choose(packing: _Packing, lower_bound: int) -> tuple[Candidate, list[FrontierPoint], str]:
    """The default plan, the frontier, and why (see the module docstring)."""
    options, budget = packing.options, packing.options.max_overhead
    cap = options.max_refresh_steps
    if options.refresh_steps is not None:
        chosen = packing.best(options.refresh_steps)
        return chosen, _frontier(packing, [chosen.refresh_steps]), f"k = {chosen.refresh_steps} was pinned"
    if options.strategy == "published":
        k = packing.natural("published") if cap is None else min(cap, packing.natural("published"))
        chosen = packing.best(k)
        return chosen, _frontier(packing, [k]), f"k = {k}: the published rule's own interval (all it could place)"
    settled = max(packing.natural("fill"), lower_bound)
    end = settled if cap is None else min(settled, cap)
    ks = list(range(min(lower_bound, end), end + 1))

    def fits(k: int) -> bool:
        overhead = packing.overhead(packing.best(k))
        return overhead <= budget + _EXACT or overhead - packing.unavoidable(k, settled) <= budget + _EXACT

    fit = next((k for k in ks if fits(k)), end)
    reason = f"k = {fit}: the smallest k whose overhead beyond work that fits no bubble is within {100 * budget:g} %"
    if fit == cap and fit < settled and not fits(cap):
        reason = f"k = {fit}: capped by max_refresh_steps; all work fits the bubbles from k = {settled}"
    k = fit
    if packing.overhead(packing.best(k)) > budget + _EXACT and packing.unplaceable:
        while (cap is None or k < cap) and k < _HORIZON:
            saving = packing.overhead(packing.best(k)) - packing.overhead(packing.best(k + 1))
            if saving < budget or saving <= _EXACT:
                break
            k += 1
        if k > fit:
            reason = (
                f"k = {k}: {len(packing.unplaceable)} tasks fit no bubble; k grew from {fit} to amortise them "
                f"while one more step saved at least {100 * budget:g} % of the step time"
                + (" (up to max_refresh_steps)" if k == cap else "")
            )
    listed = []
    for candidate in ks:  # up to the first k without overhead
        listed.append(candidate)
        if packing.overhead(packing.best(candidate)) <= _EXACT:
            break
    shown = sorted(set(listed) | {j for j in packing.evaluated if cap is None or j <= cap})
    return packing.best(k), _frontier(packing, shown), reason


def _frontier(packing: _Packing, ks: list[int]) -> list[FrontierPoint]:
    return [
        FrontierPoint(k, packing.overhead(packing.best(k)), packing.best(k).cycle_time / k, packing.best(k).source)
        for k in ks
    ]


@contextmanager
def _no_cyclic_gc() -> Iterator[None]:
    """Packing allocates ~10 objects per task and frees them by reference counting; the cyclic
    collector would rescan them over and over (a quarter of the time on large plans)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def pack(schedule: Schedule, profile: Profile, rules: TaskRules, options: PackOptions | None = None) -> PackResult:
    """Pack the curvature work of `schedule` (the tasks of the method of `rules`, with `profile`'s
    layers and times of that method) into its bubbles."""
    with _no_cyclic_gc():
        return _pack(schedule, profile, rules, options or PackOptions())


def packing_problem(
    schedule: Schedule, profile: Profile, rules: TaskRules, options: PackOptions
) -> tuple[CurvatureTasks, Timeline]:
    """The method's tasks (at `options.percentile` of their samples, split and replicated as the
    options say) and the first-order timeline they are packed into."""
    if options.percentile is not None:
        profile = tasks_at_percentile(profile, options.percentile)
    tasks = build_tasks(
        schedule,
        profile,
        rules,
        split=options.split,
        data_parallel=options.data_parallel,
        precondition=options.precondition,
    )
    return tasks, simulate(schedule, profile)


def _pack(schedule: Schedule, profile: Profile, rules: TaskRules, options: PackOptions) -> PackResult:
    tasks, first_order = packing_problem(schedule, profile, rules, options)
    packing = _Packing(tasks, first_order, options)
    lower_bound = max(packing.bounds)
    chosen, frontier, reason = choose(packing, lower_bound)
    memory = ""
    if options.max_capture_mb is not None:
        capped, memory, peaks = fit_capture(packing, chosen, int(options.max_capture_mb * 2**20))
        if capped is not chosen:  # the frontier and the reason are of the plans before the cap
            reason += (
                f"; then the {options.max_capture_mb:g} MiB capture cap moved curvature earlier, at "
                f"{100 * packing.overhead(capped):.2f} % overhead"
            )
            chosen = capped
    else:
        peaks = capture_peaks(chosen.plan, profile)
    if options.helpers and rules.helpers and options.data_parallel == 1 and schedule.num_pipes == 1:
        helped = _with_helpers(packing, chosen, tasks, free_k=options.refresh_steps is None)
        if helped is not chosen:
            reason += (
                f"; helpers: {len(helped.plan.helped)} layers' per-step work on other ranks"
                + (f", k = {helped.refresh_steps}" if helped.refresh_steps != chosen.refresh_steps else "")
                + f", mean step {chosen.cycle_time / chosen.refresh_steps:.4g} -> "
                f"{helped.cycle_time / helped.refresh_steps:.4g} {profile.time_unit}"
            )
            if helped.refresh_steps != chosen.refresh_steps:
                peaks = capture_peaks(helped.plan, profile)
            chosen = helped
    in_bubbles: Callable[[int], float] = lambda rank: precondition_in_bubbles(tasks, packing.windows, rank)
    return PackResult(
        plan=chosen.plan,
        simulated=lambda: simulate_plan(chosen.plan, tasks.durations, graph=tasks.graph),
        cycle_time=chosen.cycle_time,
        first_order=first_order,
        plain_first_order_step_time=first_order_step_time(schedule, tasks.durations),
        precondition_step_time=packing.precondition_time,
        lower_bound=lower_bound,
        devices=device_reports(tasks, first_order, chosen.plan, list(chosen.leftovers), in_bubbles, packing.bounds),
        options=options,
        profile=profile,
        unplaceable=packing.unplaceable,
        frontier=tuple(frontier),
        reason=reason,
        placement=chosen.source,
        capture_peaks=tuple(peaks),
        memory=memory,
        graph=tasks.graph,
        nominal=chosen.simulated and tasks.profile == profile,
    )


def tasks_at_percentile(profile: Profile, q: float) -> Profile:
    """`profile` with the method's tasks' times at their q-th percentile: what goes into the bubbles
    is sized to hold most of the time. Forward/backward times stay nominal: a higher percentile
    there would widen the bubbles, the opposite of a safety margin."""
    high = profile.at_percentile(q)
    return replace(
        profile, stages=tuple(replace(stage, layers=tail.layers) for stage, tail in zip(profile.stages, high.stages))
    )


def _with_helpers(packing: _Packing, chosen: Candidate, tasks: CurvatureTasks, free_k: bool) -> Candidate:
    """`chosen` with help ops where they shorten its cycle (`place_helpers`). With `free_k`, also
    the best plans at 2k and 4k (up to `max_refresh_steps`, under the capture cap), helped, and
    the smallest of those k whose mean step is within `max_overhead` of the first-order step of
    the longest's: help ops take the per-step work that has no bubble, and a longer cycle leaves
    the helpers' ends of step free of refresh work, as the packer's own rule grows k while work
    that fits no bubble costs more than `max_overhead`. `chosen` itself when no help op pays."""
    options, k = packing.options, chosen.refresh_steps
    cap = options.max_refresh_steps
    ks = [k * factor for factor in ((1, 2, 4) if free_k else (1,)) if cap is None or k * factor <= cap]

    def helped(each: int) -> tuple[float, Candidate]:
        """The exposed share of the best plan at k = `each`, helped, and that plan."""
        candidate = chosen if each == k else packing.best(each)
        if each != k and options.max_capture_mb is not None:
            candidate = fit_capture(packing, candidate, int(options.max_capture_mb * 2**20))[0]
        plan, cycle = place_helpers(candidate.plan, tasks.durations, tasks.graph)
        with_help = replace(candidate, plan=plan, cycle_time=cycle, simulated=True)
        return cycle / each / packing.first_order.step_time - 1, with_help

    tried = [helped(each) for each in ks]
    floor = min(share for share, _ in tried)
    best = next(candidate for share, candidate in tried if share <= floor + options.max_overhead + _EXACT)
    return best if best.plan.helped else chosen


def after_step_plan(
    schedule: Schedule,
    profile: Profile,
    rules: TaskRules,
    refresh_steps: int,
    split: bool = True,
    data_parallel: int = 1,
    precondition: bool = True,
) -> Plan:
    """The naive placement, for comparison: all of a cycle's curvature work in one block after the
    flush of its first step (curvature, syncs, refresh work, exchanges) after the step's folds,
    preconditioning at the end of every step (unless `precondition` is False, as `PackOptions`). Collectives go in one order on
    every rank (by stage, layer, kind and part)."""
    return _after_step(
        build_tasks(schedule, profile, rules, split=split, data_parallel=data_parallel, precondition=precondition),
        refresh_steps,
    )


def _after_step(tasks: CurvatureTasks, refresh_steps: int) -> Plan:
    schedule, profile = tasks.schedule, tasks.profile
    layer_index: dict[tuple[int, str | None], int] = {
        (stage, layer.name): i for stage, sp in enumerate(profile.stages) for i, layer in enumerate(sp.layers)
    }

    def collectives(ops: tuple[Op, ...], kinds: set[OpKind]) -> list[Op]:
        return sorted(
            (op for op in ops if op.kind in kinds),
            key=lambda op: (op.stage, layer_index[(op.stage, op.layer)], op.token),
        )

    def block(ops: tuple[Op, ...]) -> list[Op]:
        curvature = [op for op in ops if op.kind not in COLLECTIVES and op.kind is not OpKind.REFRESH]
        return (
            curvature
            + collectives(ops, {OpKind.SYNC})
            + [op for op in ops if op.kind is OpKind.REFRESH]
            + collectives(ops, {OpKind.EXCHANGE})
        )

    steps = []
    for step in range(refresh_steps):
        ranks = []
        for rank, compute in enumerate(schedule.ranks):
            work = block(tasks.cycle[rank]) if step == 0 else []
            folds = tuple(op for op in tasks.per_step[rank] if op.kind is OpKind.FOLD)
            preconditions = tuple(op for op in tasks.per_step[rank] if op.kind is not OpKind.FOLD)
            ranks.append(tuple(compute) + folds + tuple(work) + preconditions)
        steps.append(tuple(ranks))
    return Plan(schedule=schedule, steps=tuple(steps), method=tasks.profile.method, rules=tasks.rules)
