"""One schedule of experiments/bench_exposed.py inside one 2-process group (`measure_schedule`,
a `run_group` worker): every arm built side by side on each rank, warmed up, then timed in
rounds with the arms alternated.

Per round, every arm runs one timed block of whole refresh cycles (at least `Timing.min_steps`
steps), in an order shuffled anew each round (seeded by `Timing.seed`, the schedule and the
round: the same on every rank), each block after a barrier (`Block`). A block's sample is the
slower rank's wall time over the block / its steps [ms], with the cores other processes of the
machine used meanwhile (machine-wide busy time from /proc/stat less the group's own CPU time,
over the wall time). With `Timing.interleave` the arms' blocks are interleaved step by step
(one step of each arm in the round's order, a barrier before each step, until every arm ran its
block): a slow drift of the machine's speed then falls on every arm alike. Warm-up: at least `Timing.warmup` steps and 2 cycles per arm (a method's
run measures its own exposed-time estimate on its second cycle: `Arm.extra`).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from experiments.common import machine_busy_seconds, progress
from experiments.exposed.arms import Arm, Layout
from experiments.exposed.stats import RankTime
from pipefisher.runtime.training import tokens_per_step


@dataclass(frozen=True)
class Timing:
    """How the arms of a group are timed: `rounds` rounds of one block per arm of at least
    `min_steps` steps (whole cycles), after at least `warmup` untimed steps (whole cycles, 2 at
    least); the order's `seed`; `record` one more block per arm with the ops' clock marks;
    `interleave` the arms' blocks step by step (module docstring); `group`: the number of this
    process group among the schedule's (its rounds' orders differ from the other groups')."""

    rounds: int
    min_steps: int
    warmup: int
    seed: int
    record: bool
    interleave: bool = False
    group: int = 0


def cycles_of(k: int, steps: int) -> int:
    """Whole cycles of `k` steps that hold at least `steps` steps (1 at least)."""
    return max(1, -(-steps // k))


class Block:
    """A timed region of the group (collective): `seconds`, the slower rank's wall time, and
    `other_cores`, the cores other processes used meanwhile (the same on every rank)."""

    def __enter__(self) -> Block:
        dist.barrier()
        self.machine, self.cpu, self.start = machine_busy_seconds(), time.process_time(), time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        wall = torch.tensor(
            [time.perf_counter() - self.start, machine_busy_seconds() - self.machine], dtype=torch.float64
        )
        ours = torch.tensor([time.process_time() - self.cpu], dtype=torch.float64)
        dist.all_reduce(wall, op=dist.ReduceOp.MAX)  # the slower rank; the machine's busy time (one machine)
        dist.all_reduce(ours, op=dist.ReduceOp.SUM)
        self.seconds = float(wall[0])
        self.other_cores = max(0.0, float(wall[1]) - float(ours)) / self.seconds


@dataclass
class RankResult:
    """What one rank measured, per arm (the first-order optimizer's name or a method's): its
    refresh interval `k`, per round its step time [ms] and the other processes' cores, the run's
    own exposed-share estimate (methods only), its recorded block on this rank (`RankTime`);
    the rounds' orders, the tokens per step and the seconds it took to build the arms."""

    rank: int
    k: dict[str, int] = field(default_factory=dict)
    step_ms: dict[str, list[float]] = field(default_factory=dict)
    other_cores: dict[str, list[float]] = field(default_factory=dict)
    own_estimate: dict[str, float | None] = field(default_factory=dict)
    cycle: dict[str, RankTime] = field(default_factory=dict)
    orders: list[list[str]] = field(default_factory=list)
    tokens_per_step: int = 0
    build_seconds: float = 0.0


def timed_blocks(
    arms: dict[str, Arm], order: list[str], steps: dict[str, int], interleave: bool
) -> dict[str, tuple[float, float]]:
    """One round: each arm of `order` runs `steps[name]` steps, as one block per arm in turn or,
    with `interleave`, one step of each arm in turn (a `Block` per step). Per arm its wall time
    [s] (the slower rank's, summed over its blocks) and the cores other processes used meanwhile."""
    timed: dict[str, tuple[float, float]] = {}
    if not interleave:
        for name in order:
            with Block() as block:
                arms[name].run(steps[name])
            timed[name] = (block.seconds, block.other_cores)
        return timed
    busy = {name: [0.0, 0.0] for name in order}  # seconds, core-seconds of other processes
    for index in range(max(steps.values())):
        for name in order:
            if index < steps[name]:
                with Block() as block:
                    arms[name].run(1)
                busy[name][0] += block.seconds
                busy[name][1] += block.other_cores * block.seconds
    return {name: (seconds, cores / seconds) for name, (seconds, cores) in busy.items()}


def measure_schedule(rank: int, world: int, layout: Layout, methods: list[str], timing: Timing) -> RankResult:
    """Every arm of `layout` (its first-order optimizer, then `methods`) on this rank, timed in
    rounds (module docstring); collective on the group's `world` ranks."""
    say = progress if rank == 0 else (lambda message: None)
    started = time.perf_counter()
    arms: dict[str, Arm] = {}
    for name in (layout.first_order, *methods):
        arms[name] = Arm(layout, None if name == layout.first_order else name, rank)
        say(f"{layout.schedule}: built {name} (k = {arms[name].k}), {time.perf_counter() - started:.0f} s")
    result = RankResult(rank, tokens_per_step=tokens_per_step(arms[layout.first_order].config))
    result.build_seconds = time.perf_counter() - started
    for name, arm in arms.items():
        result.k[name] = arm.k
        arm.run(max(2, cycles_of(arm.k, timing.warmup)) * arm.k)
        result.step_ms[name], result.other_cores[name] = [], []
    say(f"{layout.schedule}: warmed up, {time.perf_counter() - started:.0f} s")
    for round_ in range(timing.rounds):
        key = f"{timing.seed}:{layout.schedule}:{round_}" + (f":{timing.group}" if timing.group else "")
        order = random.Random(key).sample(list(arms), len(arms))
        result.orders.append(order)
        steps = {name: cycles_of(arm.k, timing.min_steps) * arm.k for name, arm in arms.items()}
        for name, (seconds, cores) in timed_blocks(arms, order, steps, timing.interleave).items():
            result.step_ms[name].append(1000 * seconds / steps[name])
            result.other_cores[name].append(cores)
        first = result.step_ms[layout.first_order][-1]
        ratios = ", ".join(f"{name} {result.step_ms[name][-1] / first:.3f}" for name in methods)
        say(
            f"{layout.schedule} round {round_ + 1}/{timing.rounds}: {layout.first_order} {first:.1f} ms/step; ratio {ratios}"
        )
    for name in methods:
        result.own_estimate[name] = arms[name].extra.get("exposed_share")
    if timing.record:
        result.cycle = {name: arm.record_cycles(rank, cycles_of(arm.k, timing.min_steps)) for name, arm in arms.items()}
    return result
