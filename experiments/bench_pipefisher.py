"""PipeFisher on this machine: first-order vs after-step vs packed curvature work (K-FAC, or
Shampoo with --method shampoo), and how well the simulator predicts the measured step times.

Two ranks (gloo on 127.0.0.1, one thread each), one 2-stage pipeline, a Transformer whose K-FAC
work fits the bubbles (long sequences make forward/backward heavy next to the Linear factors).
Per schedule, one 2-process group:

1. builds three executors (same seeds, so the same initial model): `first-order` (SGD),
   `after-step` (the method's cycle of work in one block after its first step) and `packed` (its
   work in the bubbles);
2. measures one profile on the real executor (`measure_profile`), saves it and packs it once
   for the packer's k, lower bound and predicted overhead; both K-FAC variants are then built
   from that profile file with kfac.refresh_steps pinned to that k (same data, same k, same
   math, different placement; re-profiling is switched off so the plans stay fixed);
3. runs `--warmup-cycles` cycles of every variant, then rounds of timed blocks with the variants
   alternated (A B C, C B A, ...) and a barrier before each block, until `--repeats` rounds were
   quiet (see 4) or `--max-rounds` / `--time-budget` are used up. A block is whole
   refresh cycles (a multiple of k steps, at least `--min-steps`); its sample is the slower
   rank's wall time over the block divided by its steps. Before each round a short profile is
   measured as well (same period as the timings: the machine's speed drifts);
4. reports, per variant, the median step time and its ratio to first-order (ratio of medians,
   and median of the back-to-back ratios); the same over the "quiet" rounds only, in which other
   processes of the machine used at most CLEAN_LOAD cores during each block (from /proc/stat
   minus our ranks' CPU time); the simulator's prediction (`simulate(schedule, profile)` for
   first-order, the trainer's `predicted_step_ms` for K-FAC) against the measured median, from
   the packing profile and from the median of the profiles measured between rounds; the step
   losses of after-step vs packed; and where each rank's time goes (per op kind: wall from the
   executor's recorder, CPU time and minor page faults of the op's thread, profiled time), per
   step of the refresh cycle too, to explain gaps between prediction and measurement.

Nothing in the package is changed.

Usage: python experiments/bench_pipefisher.py [--method kfac|shampoo|... (a registered method)] [--schedules 1f1b gpipe chimera] [--repeats 7]
       [--max-rounds 20] [--time-budget 75] [--min-steps 4] [--warmup-cycles 2]
       [--micro-batches 4] [--micro-batch-size 2] [--hidden 128] [--heads 4] [--ffn 256]
       [--seq-len 512] [--layers 2] [--inverse eigen] [--refresh-steps K]
A full run takes about 1.5 min on a quiet machine and at most about 5 min on a busy one.
"""

from __future__ import annotations

import argparse
import math
import os
import resource
import shlex
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
import yaml

from pipefisher.methods.registry import method_of_profile
from pipefisher.config import RunConfig, config_from_dict
from pipefisher.core.ir import OpKind
from pipefisher.core.profile import Profile, time_key
from pipefisher.methods.registry import method_of, methods
from pipefisher.planning.packing.pack import pack
from pipefisher.planning.plan import cycle_time, simulate_plan
from pipefisher.planning.simulate import COLLECTIVES, OpDurations, simulate
from pipefisher.runtime.training import (
    ExecutorExtension,
    PipeFisherTrainer,
    PlanRunner,
    build_executor,
    build_run,
    measure_profile,
    method_inputs,
    pack_options,
    run_group,
    schedule_plan,
)
from pipefisher.cli.scripts import entry_point

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout: experiments
from experiments.common import machine_busy_seconds  # noqa: E402

STAGES = 2
VARIANTS = ("first-order", "after-step", "packed")
KFAC_VARIANTS = ("after-step", "packed")
#: op kinds grouped for the "where the time goes" table
GROUPS = {
    OpKind.FORWARD: "F",
    OpKind.BACKWARD: "B",
    OpKind.CURVATURE: "curv",
    OpKind.REFRESH: "inv",
    OpKind.PRECONDITION: "precond",
    OpKind.FOLD: "precond",
    OpKind.HELP: "precond",
    OpKind.SYNC: "comm",
    OpKind.EXCHANGE: "comm",
}
GROUP_ORDER = ("F", "B", "curv", "inv", "precond", "comm")
#: a round is quiet when other processes used at most this many cores during each of its blocks
CLEAN_LOAD = 0.15


def config_dict(args: dict, schedule: str, variant: str, k: int = 0, profile: str = "") -> dict:
    method = args["method"]
    placement = {
        "refresh_steps": k,
        "margin": args["margin"],
        "percentile": args["percentile"],
        "placement": "after-step" if variant == "after-step" else "packed",
        "profile": profile,
        # the plans must stay fixed during the benchmark: no re-profiling
        "reprofile_threshold": 1e9,
        "reprofile_patience": 10**6,
    }
    own = {
        "kfac": {"damping": args["damping"], "inverse": args["inverse"]},
        "shampoo": {"epsilon": 1e-6, "lr": args["shampoo_lr"]},
    }.get(method, {})  # other methods: their defaults
    return {
        "model": {
            "kind": "transformer",
            "layers": args["layers"],
            "hidden": args["hidden"],
            "heads": args["heads"],
            "ffn": args["ffn"],
            "seq_len": args["seq_len"],
            "input_dim": 16,
            "output_dim": 4,
        },
        "data": {"kind": "synthetic", "seed": 0, "micro_batch_size": args["micro_batch_size"]},
        "pipeline": {
            "schedule": schedule,
            "stages": STAGES,
            "micro_batches": args["micro_batches"],
            "data_parallel": 1,
        },
        "optimizer": {"name": "sgd" if variant == "first-order" else method, "lr": args["lr"]},
        method: {**own, **placement},
        "run": {"steps": 1, "seed": 0, "backend": "gloo", "timeout": 120},
    }


# -- measuring ---------------------------------------------------------------------------------
def load_average() -> str:
    try:
        with open("/proc/loadavg") as f:
            return f.read().split()[0]
    except OSError:
        return "?"


class Window:
    """Wall time of a collective region (slowest rank) and the cores other processes used."""

    def __enter__(self) -> Window:
        dist.barrier()
        self.machine, self.cpu, self.start = machine_busy_seconds(), time.process_time(), time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        wall = torch.tensor(
            [time.perf_counter() - self.start, machine_busy_seconds() - self.machine], dtype=torch.float64
        )
        ours = torch.tensor([time.process_time() - self.cpu], dtype=torch.float64)
        dist.all_reduce(wall, op=dist.ReduceOp.MAX)  # slowest rank; machine-wide busy time (ranks share one machine)
        dist.all_reduce(ours, op=dist.ReduceOp.SUM)
        self.seconds = float(wall[0])
        self.foreign = max(0.0, float(wall[1]) - float(ours)) / self.seconds  # identical on every rank


def thread_faults() -> int:
    return resource.getrusage(getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)).ru_minflt


class _Recorder(ExecutorExtension):
    """Every op's clock marks to `record(op, start, end)`."""

    records = True

    def __init__(self, record):
        self.record = record


class _TimedHandlers(ExecutorExtension):
    """The executor's handlers, each wrapped to time it."""

    def __init__(self, wrapped):
        self.wrapped = wrapped

    def handlers(self):
        return self.wrapped


class Variant:
    """One executor (and PipeFisherTrainer for K-FAC) with its own step counter and statistics."""

    def __init__(self, name: str, config: RunConfig, rank: int, device: torch.device):
        self.name, self.config, self.rank = name, config, rank
        self.executor, self.schedule = build_executor(config, rank, device)  # collective
        self.trainer: PipeFisherTrainer | None = None
        self.step = 0
        self.cycle_step = 0
        self.losses: list[float] = []
        self.round: int | None = None  # timed round being recorded, or None
        #: round -> statistics of this rank (see _stats)
        self.rounds: dict[int, dict] = {}
        self._last_end = 0.0
        self.executor.extend(_Recorder(self._record))

    @staticmethod
    def _stats() -> dict:
        return {
            "steps": 0,
            "tail": 0.0,  # ms after the last op of a step: sends, gradient all-reduce, optimizer, loss sum
            "step_ms": defaultdict(list),  # cycle step -> step wall times
            "wall": defaultdict(float),
            "cpu": defaultdict(float),
            "faults": defaultdict(float),  # group -> total
            "cycle": defaultdict(lambda: [0.0, 0.0, 0.0]),  # (cycle step, "F+B"|"K-FAC") -> [wall, cpu, faults]
        }

    def _current(self) -> dict | None:
        return None if self.round is None else self.rounds.setdefault(self.round, self._stats())

    def _record(self, op, start: float, end: float) -> None:
        self._last_end = end
        stats = self._current()
        if stats is not None:
            ms = 1000 * (end - start)
            stats["wall"][GROUPS[op.kind]] += ms
            stats["cycle"][(self.cycle_step, "F+B" if op.kind.is_compute else "K-FAC")][0] += ms

    def attach_trainer(self) -> None:
        self.trainer = PipeFisherTrainer(self.config, self.executor, self.rank, self.executor.tied)

    def wrap_handlers(self) -> None:
        """CPU time and minor page faults of each op on this thread (recording rounds only)."""

        def wrap(kind, handler):
            def timed(op):
                stats = self._current()
                if stats is None:
                    return handler(op)
                cpu, faults = time.thread_time(), thread_faults()
                try:
                    return handler(op)
                finally:
                    cpu, faults = 1000 * (time.thread_time() - cpu), thread_faults() - faults
                    stats["cpu"][GROUPS[kind]] += cpu
                    stats["faults"][GROUPS[kind]] += faults
                    cell = stats["cycle"][(self.cycle_step, "F+B" if kind.is_compute else "K-FAC")]
                    cell[1] += cpu
                    cell[2] += faults

            return timed

        self.executor.extend(
            _TimedHandlers({kind: wrap(kind, handler) for kind, handler in self.executor.handlers.items()})
        )

    @property
    def k(self) -> int:
        return self.trainer.curvature_plan.refresh_steps if self.trainer else 1

    def run(self, steps: int) -> None:
        runner = self.trainer or PlanRunner(self.executor, self.rank, schedule_plan(self.schedule), self.executor.tied)
        for _ in range(steps):
            self.cycle_step = runner.cycle_step
            start = time.perf_counter()
            result = runner.run_step(self.step)
            self.losses.append(result.loss)
            stats = self._current()
            if stats is not None:
                stats["steps"] += 1
                stats["tail"] += 1000 * (start + result.seconds - self._last_end)
                stats["step_ms"][self.cycle_step].append(1000 * result.seconds)
            self.step += 1

    def plain_rounds(self) -> dict[int, dict]:
        """Statistics without defaultdicts/lambdas (picklable)."""
        return {
            r: {key: dict(value) if isinstance(value, defaultdict) else value for key, value in s.items()}
            for r, s in self.rounds.items()
        }


# -- plans and profiles --------------------------------------------------------------------------
def median_profile(profiles: list[Profile]) -> Profile:
    """Field-by-field median of profiles of the same run."""
    med = statistics.median
    layer_fields = [(work, part) for work in ("curvature", "refresh", "sync") for part in (0, 1)] + [
        ("precondition", None)
    ]
    stages = []
    for index, stage in enumerate(profiles[0].stages):
        group = [p.stages[index] for p in profiles]
        layers = tuple(
            layer.with_times({time_key(w, p): med([g.layers[i].time(w, p) for g in group]) for w, p in layer_fields})
            for i, layer in enumerate(stage.layers)
        )
        stages.append(
            replace(
                stage,
                forward=med([g.forward for g in group]),
                backward=med([g.backward for g in group]),
                p2p=med([g.p2p for g in group]),
                layers=layers,
            )
        )
    return replace(profiles[0], stages=tuple(stages))


def curvature_orders(plan) -> dict[tuple, list]:
    """(pipe, stage, layer, kind) -> micro-batches in the order their curvature is accumulated."""
    orders: dict[tuple, list] = defaultdict(list)
    for step in plan.steps:
        for ops in step:
            for op in ops:
                if op.kind is OpKind.CURVATURE:
                    orders[(op.pipe, op.stage, op.layer, op.token)].append(op.micro_batch)
    return orders


def predicted_groups(variant: Variant, profile: Profile, schedule) -> dict[str, float]:
    """Profiled time per step of this rank's ops, per group (a whole cycle's mean)."""
    durations = OpDurations(profile)
    rank = variant.executor.topology.pipeline_rank(variant.rank)
    steps = variant.trainer.curvature_plan.plan.steps if variant.trainer else [schedule.ranks]
    totals: dict[str, float] = defaultdict(float)
    for step_ops in steps:
        for op in step_ops[rank]:
            if op.kind not in COLLECTIVES:
                totals[GROUPS[op.kind]] += durations(op) / len(steps)
    return dict(totals)


# -- one schedule, on every rank ----------------------------------------------------------------
def bench_schedule(rank: int, world: int, args: dict, schedule: str, profile_path: str) -> dict:
    device = torch.device("cpu")
    load_start = load_average()
    variants = {v: Variant(v, config_from_dict(config_dict(args, schedule, v)), rank, device) for v in VARIANTS}
    first = variants["first-order"]
    sched, cfg = first.schedule, variants["packed"].config
    modules = {key: s.module for key, s in first.executor.stages.items()}
    method = method_of(cfg).runtime_parts()
    skip = method.skip(build_run(cfg).model)

    def profile_now(warmup: int, repeats: int) -> tuple[Profile, float, float]:
        """A profile on the first-order executor (gradients dropped: no variant changes), the
        seconds it took and the cores other processes used meanwhile."""
        with Window() as window:  # the profiler's own hooks replace the variant's recorder meanwhile
            measured, _ = measure_profile(
                first.executor,
                rank,
                modules,
                cfg.data.micro_batch_size,
                method.timer(method_inputs(cfg), modules, skip),
                warmup=warmup,
                repeats=repeats,
            )
        return measured, window.seconds, window.foreign

    # -- one profile to pack from; both K-FAC variants load it, with k pinned ------------------
    profile, profile_seconds, profile_load = profile_now(args["profile_warmup"], args["profile_repeats"])
    if rank == 0:
        profile.save(profile_path)
    dist.barrier()
    options = pack_options(cfg)
    packed_result = pack(sched, profile, method_of_profile(profile).rules, options)
    chosen_k = packed_result.refresh_steps
    if args["refresh_steps"]:  # pin another k for both K-FAC variants (the packer's choice is still reported)
        packed_result = pack(
            sched, profile, method_of_profile(profile).rules, replace(options, refresh_steps=args["refresh_steps"])
        )
    k = packed_result.refresh_steps
    for name in KFAC_VARIANTS:
        variant = variants[name]
        variant.config = config_from_dict(config_dict(args, schedule, name, k=k, profile=profile_path))
        variant.attach_trainer()
        assert variant.k == k, (name, variant.k, k)
    for variant in variants.values():
        variant.wrap_handlers()

    # -- warm-up, then alternated timed blocks of whole cycles ---------------------------------
    block_steps = k * max(1, math.ceil(args["min_steps"] / k))
    for variant in variants.values():
        variant.run(args["warmup_cycles"] * k)
    samples: dict[str, list[float]] = defaultdict(list)
    foreign: dict[str, list[float]] = defaultdict(list)
    interleaved: list[tuple[Profile, float]] = []
    # Rounds go on until `repeats` of them were quiet (other processes below CLEAN_LOAD cores in
    # every block), or `max_rounds` / the time budget run out; every rank takes the same decision.
    budget_end = time.perf_counter() + args["time_budget"]
    repeat = quiet = 0
    while True:
        if args["reprofile"]:
            measured, _, load = profile_now(1, 2)
            interleaved.append((measured, load))
        loads = []
        for name in VARIANTS if repeat % 2 == 0 else reversed(VARIANTS):
            variant = variants[name]
            variant.round = repeat
            with Window() as window:
                variant.run(block_steps)
            variant.round = None
            samples[name].append(1000 * window.seconds / block_steps)
            foreign[name].append(window.foreign)
            loads.append(window.foreign)
        repeat += 1
        quiet += max(loads) <= CLEAN_LOAD
        more = torch.tensor(
            [
                quiet < args["repeats"]
                and repeat < args["max_rounds"]
                and (repeat < args["repeats"] or time.perf_counter() < budget_end)
            ],
            dtype=torch.int32,
        )
        dist.broadcast(more, src=0)
        if not more.item():
            break

    result = {
        "rank": rank,
        "rounds": {name: v.plain_rounds() for name, v in variants.items()},
        "predicted_groups": {name: predicted_groups(v, profile, sched) for name, v in variants.items()},
    }
    if rank == 0:
        plans = {name: variants[name].trainer.curvature_plan.plan for name in KFAC_VARIANTS}
        after_orders, packed_orders = curvature_orders(plans["after-step"]), curvature_orders(plans["packed"])
        quiet = [p for p, load in interleaved if load <= CLEAN_LOAD]
        median = median_profile(quiet if len(quiet) >= 2 else [p for p, _ in interleaved]) if interleaved else None
        result.update(
            schedule=schedule,
            load=(load_start, load_average()),
            samples=dict(samples),
            foreign=dict(foreign),
            losses={name: v.losses for name, v in variants.items()},
            k=k,
            chosen_k=chosen_k,
            block_steps=block_steps,
            lower_bound=packed_result.lower_bound,
            pack_overhead=packed_result.overhead,
            pack_step=packed_result.step_time,
            pack_first_order=packed_result.first_order_step_time,
            pack_precondition_step=packed_result.precondition_step_time,
            unplaceable=len(packed_result.unplaceable),
            bubble_utilization=packed_result.bubble_utilization,
            reordered=(sum(after_orders[key] != packed_orders.get(key) for key in after_orders), len(after_orders)),
            predicted={
                "first-order": simulate(sched, profile).step_time,
                **{name: variants[name].trainer.predicted_step_ms for name in KFAC_VARIANTS},
            },
            predicted_steps={
                "first-order": [simulate(sched, profile).step_time],
                **{name: [t.step_time for t in simulate_plan(plans[name], profile)] for name in KFAC_VARIANTS},
            },
            predicted_interleaved=None
            if median is None
            else {
                "first-order": simulate(sched, median).step_time,
                **{name: cycle_time(simulate_plan(plans[name], median)) / k for name in KFAC_VARIANTS},
            },
            interleaved_quiet=(len(quiet), len(interleaved)),
            profile=profile.to_dict(),
            profile_seconds=profile_seconds,
            profile_load=profile_load,
            interleaved_profile=None if median is None else median.to_dict(),
        )
    return result


# -- reporting -----------------------------------------------------------------------------------
def fmt(x: float) -> str:
    return f"{x:.1f}"


def profile_lines(data: dict) -> list[str]:
    lines = []
    for index, stage in enumerate(data["stages"]):
        layers = stage["layers"]
        total = lambda key: sum(sum(layer.get(key, [])) if key != "precondition" else layer[key] for layer in layers)
        lines.append(
            f"  stage {index}: forward {stage['forward']:.1f}, backward {stage['backward']:.1f}, p2p {stage['p2p']:.2f}, step end {stage.get('step_end', 0.0):.1f}, "
            f"curvature {total('curvature'):.1f} per micro-batch, refresh {total('refresh'):.1f}, "
            f"precondition {total('precondition'):.1f}, syncs {total('sync'):.1f} (ms, {len(layers)} {data.get('method', 'kfac')} layers)"
        )
    return lines


def report(results: list[dict], args: dict) -> dict:
    """Print the schedule's tables; return what the summary needs."""
    rank0 = results[0]
    schedule, samples, foreign, k = rank0["schedule"], rank0["samples"], rank0["foreign"], rank0["k"]
    rounds = len(samples["first-order"])
    quiet = [i for i in range(rounds) if all(foreign[v][i] <= CLEAN_LOAD for v in VARIANTS)]
    use = quiet if len(quiet) >= 3 else list(range(rounds))
    label = f"the {len(quiet)} quiet rounds" if use is quiet else "all rounds (fewer than 3 quiet ones)"

    print(f"\n## {schedule}\n")
    print(
        f"packing profile (measured in {rank0['profile_seconds']:.1f} s, other processes {rank0['profile_load']:.2f} cores):"
    )
    print("\n".join(profile_lines(rank0["profile"])))
    if rank0["interleaved_profile"]:
        n_quiet, n_all = rank0["interleaved_quiet"]
        print(
            f"median of the {n_quiet if n_quiet >= 2 else n_all} {'quiet ' if n_quiet >= 2 else ''}profiles "
            f"measured between the rounds ({n_quiet} of {n_all} quiet):"
        )
        print("\n".join(profile_lines(rank0["interleaved_profile"])))
    if rank0["chosen_k"] != k:
        print(f"\nthe packer chose k = {rank0['chosen_k']}; --refresh-steps pins k = {k} (figures below for k = {k})")
    print(
        f"\npacker (on the packing profile): k = {k}, lower bound = {rank0['lower_bound']}, predicted packing overhead "
        f"{100 * rank0['pack_overhead']:.2f} % ({args['method']} step {rank0['pack_step']:.1f} ms; first-order "
        f"{rank0['pack_first_order']:.1f} ms, + preconditioning {rank0['pack_precondition_step']:.1f} ms), "
        f"bubble utilisation {100 * rank0['bubble_utilization']:.0f} %, tasks that fit no bubble: {rank0['unplaceable']}"
    )
    print(
        f"load average {rank0['load'][0]} at start, {rank0['load'][1]} at end; timed: {rounds} rounds x "
        f"{rank0['block_steps']} steps ({rank0['block_steps'] // k} cycles of k = {k}) per variant after "
        f"{args['warmup_cycles']} warm-up cycles\n"
    )

    def medians(indices):
        return {v: statistics.median(samples[v][i] for i in indices) for v in VARIANTS}

    def paired(v, indices):
        return statistics.median(samples[v][i] / samples["first-order"][i] for i in indices)

    every, chosen = medians(range(rounds)), medians(use)
    print(
        f"| variant | median ms/step (all {rounds} rounds) | ratio | paired ratio | median ms/step ({len(quiet)} quiet rounds) "
        f"| ratio | paired ratio | samples ms/step (other processes' cores) |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for v in VARIANTS:
        q = (
            f"{fmt(medians(quiet)[v])} | {medians(quiet)[v] / medians(quiet)['first-order']:.3f} | {paired(v, quiet):.3f}"
            if quiet
            else "- | - | -"
        )
        cells = " ".join(f"{s:.0f}({f:.2f})" for s, f in zip(samples[v], foreign[v]))
        print(
            f"| {v} | {fmt(every[v])} | {every[v] / every['first-order']:.3f} | {paired(v, range(rounds)):.3f} | {q} | {cells} |"
        )

    print(f"\nprediction vs measured median over {label}:\n")
    print(
        "| variant | predicted (packing profile) ms | measured ms | predicted / measured | predicted (interleaved profiles) ms | predicted / measured |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    interleaved = rank0["predicted_interleaved"] or {}
    for v in VARIANTS:
        p, q = rank0["predicted"][v], interleaved.get(v)
        extra = f"{fmt(q)} | {q / chosen[v]:.3f}" if q else "- | -"
        print(f"| {v} | {fmt(p)} | {fmt(chosen[v])} | {p / chosen[v]:.3f} | {extra} |")

    reordered, factors = rank0["reordered"]
    why = (
        f"; the plans accumulate the micro-batches of {reordered} of {factors} factors in a different order, "
        "which changes float rounding"
        if reordered
        else ""
    )
    after, packed = rank0["losses"]["after-step"], rank0["losses"]["packed"]
    if after == packed:
        print(
            f"\nloss check: after-step and packed step losses are bitwise identical over all {len(after)} steps "
            f"(first {after[0]:.6f}, last {after[-1]:.6f}; first-order last {rank0['losses']['first-order'][-1]:.6f}){why}"
        )
    else:
        diff = max(abs(a - b) for a, b in zip(after, packed))
        rel = max(abs(a - b) / max(abs(a), 1e-30) for a, b in zip(after, packed))
        finite = all(math.isfinite(x) for x in after + packed)
        verdict = "identical up to float rounding" if rel < 1e-4 and finite else "DIFFERENT"
        print(
            f"\nloss check: after-step and packed step losses {verdict} over {len(after)} steps: max |diff| {diff:.3g}, "
            f"relative {rel:.3g} (last {after[-1]:.6f} vs {packed[-1]:.6f}){why}"
        )

    # where the time goes, over the rounds used above
    print(
        f"\nwhere the time goes over {label}, ms per step: wall (recorder, without receive waits) / CPU of the op's "
        "thread / profiled; end of step = after the last op (sends and gradient all-reduces still in flight, "
        "optimizer, the step's reduction; simulated as the profile's grad_reduce and step_end); idle = step wall - busy wall - end of step (waiting for the other rank):\n"
    )
    print(
        "| variant | rank | "
        + " | ".join(GROUP_ORDER)
        + " | busy | step wall | end of step | idle | page faults per step |"
    )
    print("| --- | --- | " + " | ".join("---" for _ in GROUP_ORDER) + " | --- | --- | --- | --- | --- |")
    for v in VARIANTS:
        for result in results:
            stats = [result["rounds"][v][i] for i in use if i in result["rounds"][v]]
            steps = sum(s["steps"] for s in stats)
            total = lambda key, group: sum(s[key].get(group, 0.0) for s in stats) / steps
            predicted = result["predicted_groups"][v]
            cells = []
            for g in GROUP_ORDER:
                w, c, p = total("wall", g), total("cpu", g), predicted.get(g, 0.0)
                cells.append("-" if w == 0 and p == 0 else f"{w:.1f} / {c:.1f} / {p:.1f}")
            busy = [sum(total(key, g) for g in GROUP_ORDER) for key in ("wall", "cpu")]
            wall = sum(sum(ms) for s in stats for ms in s["step_ms"].values()) / steps
            faults = sum(total("faults", g) for g in GROUP_ORDER)
            tail = sum(s["tail"] for s in stats) / steps
            print(
                f"| {v} | {result['rank']} | "
                + " | ".join(cells)
                + f" | {busy[0]:.1f} / {busy[1]:.1f} / {sum(predicted.values()):.1f} | {wall:.1f} | {tail:.1f} | "
                f"{wall - busy[0] - tail:.1f} | {faults:.0f} |"
            )

    print(
        f"\nper step of the refresh cycle over {label} (step 0 captures the curvature's inputs): median step wall "
        "measured vs predicted (packing profile); per rank, per step, F+B and K-FAC ops as wall / CPU ms / page faults:\n"
    )
    print(
        "| variant | cycle step | measured ms | predicted ms | "
        + " | ".join(f"rank {r['rank']} F+B | rank {r['rank']} K-FAC" for r in results)
        + " |"
    )
    print("| --- | --- | --- | --- | " + " | ".join("--- | ---" for _ in results) + " |")
    for v in VARIANTS:
        predicted = rank0["predicted_steps"][v]
        for j in range(len(predicted)):
            times = [ms for i in use for ms in rank0["rounds"][v][i]["step_ms"].get(j, [])]
            cells = []
            for r in results:
                stats = [r["rounds"][v][i] for i in use]
                count = sum(len(s["step_ms"].get(j, [])) for s in stats)
                for what in ("F+B", "K-FAC"):
                    cell = [
                        sum(s["cycle"].get((j, what), [0, 0, 0])[x] for s in stats) / max(count, 1) for x in range(3)
                    ]
                    cells.append(f"{cell[0]:.1f} / {cell[1]:.1f} / {cell[2]:.0f}" if any(cell) else "-")
            print(f"| {v} | {j} | {fmt(statistics.median(times))} | {fmt(predicted[j])} | " + " | ".join(cells) + " |")
    return {"rank0": rank0, "every": every, "chosen": chosen, "label": label, "quiet": len(quiet), "rounds": rounds}


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--method", choices=list(methods()), default="kfac", help="the curvature method of the two packed variants"
    )
    parser.add_argument(
        "--schedules", nargs="+", default=["1f1b", "gpipe", "chimera"], choices=["1f1b", "gpipe", "chimera"]
    )
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--min-steps", type=int, default=4, help="timed steps per block, rounded up to whole cycles")
    parser.add_argument(
        "--max-rounds",
        type=int,
        default=20,
        help="rounds are added until --repeats of them were quiet, up to this many",
    )
    parser.add_argument(
        "--time-budget",
        type=float,
        default=75.0,
        help="seconds per schedule after which no round is added beyond --repeats",
    )
    parser.add_argument("--warmup-cycles", type=int, default=2)
    parser.add_argument("--profile-warmup", type=int, default=2)
    parser.add_argument("--profile-repeats", type=int, default=5)
    parser.add_argument(
        "--no-reprofile",
        dest="reprofile",
        action="store_false",
        help="skip the short profiles measured before each round (the second prediction)",
    )
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--ffn", type=int, default=256)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument(
        "--shampoo-lr",
        type=float,
        default=1e-3,
        help="shampoo.lr: its steps take Adam's size (grafting), so --lr's SGD scale would diverge and "
        "leave denormal gradients that slow every backward on a CPU",
    )
    parser.add_argument("--damping", type=float, default=0.01)
    parser.add_argument("--inverse", choices=["eigen", "cholesky"], default="eigen")
    parser.add_argument(
        "--margin", type=float, default=0.0, help="kfac.margin: share of each bubble the packer keeps free"
    )
    parser.add_argument(
        "--percentile", type=float, default=90.0, help="kfac.percentile: the packer's percentile of measured op times"
    )
    parser.add_argument(
        "--refresh-steps", type=int, default=0, help="pin k for both K-FAC variants (0: the packer's choice)"
    )
    parser.add_argument(
        "--profile-dir", default="", help="where to keep the measured profiles (default: a new temp dir)"
    )
    parser.add_argument("--deadline", type=float, default=300.0, help="seconds per schedule before its group is killed")
    args = vars(parser.parse_args())

    script = os.path.relpath(sys.argv[0]) if os.path.exists(sys.argv[0]) else sys.argv[0]
    print(f"# PipeFisher benchmark: first-order vs {args['method']} after-step vs {args['method']} packed\n")
    print(f"command: `{' '.join(shlex.quote(a) for a in ['python', script, *sys.argv[1:]])}`")
    print(f"options: {args}")
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, {STAGES} ranks (gloo, 1 thread each)\n")
    print(
        f"run config of the {args['method']} variants (first-order: optimizer.name sgd; {args['method']}.refresh_steps = the "
        f"packer's k, {args['method']}.profile = the measured profile; pipeline.schedule per section):\n"
    )
    print("```yaml")
    print(
        yaml.safe_dump(
            config_dict(args, args["schedules"][0], "packed", k=0, profile="<measured>"), sort_keys=False
        ).rstrip()
    )
    print("```")
    directory = args["profile_dir"] or tempfile.mkdtemp(prefix="bench_pipefisher_")
    os.makedirs(directory, exist_ok=True)
    print(f"\nprofiles are kept in {directory}")

    total = time.perf_counter()
    summary = []
    for schedule in args["schedules"]:
        started = time.perf_counter()
        results = run_group(
            bench_schedule,
            STAGES,
            args=(args, schedule, os.path.join(directory, f"profile-{schedule}.yaml")),
            backend="gloo",
            timeout=120,
            deadline=args["deadline"],
        )
        summary.append(report(sorted(results, key=lambda r: r["rank"]), args))
        print(f"\n({schedule}: {time.perf_counter() - started:.0f} s)", flush=True)

    print("\n## Summary\n")
    print(
        "| schedule | k | lower bound | packer's predicted overhead | quiet rounds | first-order ms | after-step ms (ratio) | packed ms (ratio) |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for s in summary:
        r, m = s["rank0"], s["chosen"]
        fo = m["first-order"]
        print(
            f"| {r['schedule']} | {r['k']} | {r['lower_bound']} | {100 * r['pack_overhead']:.2f} % | {s['quiet']} of {s['rounds']} | "
            f"{fmt(fo)} | {fmt(m['after-step'])} ({m['after-step'] / fo:.3f}) | {fmt(m['packed'])} ({m['packed'] / fo:.3f}) |"
        )
    print("\n(medians over the quiet rounds when there were at least 3, else over all rounds)\n")
    print(
        "| schedule | variant | predicted ms (packing profile) | measured ms | predicted / measured | predicted ms (interleaved profiles) | predicted / measured |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for s in summary:
        r, m = s["rank0"], s["chosen"]
        for v in ("first-order", "packed"):
            p, q = r["predicted"][v], (r["predicted_interleaved"] or {}).get(v)
            extra = f"{fmt(q)} | {q / m[v]:.3f}" if q else "- | -"
            print(f"| {r['schedule']} | {v} | {fmt(p)} | {fmt(m[v])} | {p / m[v]:.3f} | {extra} |")
    print(f"\ntotal {time.perf_counter() - total:.0f} s")


if __name__ == "__main__":
    sys.exit(entry_point(main, "bench_pipefisher"))
