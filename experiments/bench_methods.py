"""Each method's own work on one stage's matrices, matrix by matrix (before) against batched over
same-shape matrices (after), with AdamW's step as the first-order yardstick.

The stage: --blocks transformer blocks of width --hidden, each with four (h, h) projections and
the MLP's (4h, h) and (h, 4h) weights (BERT-Base: --hidden 768), random gradients. Per method and
kind of work (step: the work of every step; refresh: one refresh cycle's factor work, as the
runtime's ops call it), the looped and the batched call alternate --repeats times (after one
untimed warm-up each); the table gives the median milliseconds of each, their ratio, the ATen ops
each dispatches but views (the host-boundness proxy: each is a kernel launch on a GPU) and the
largest difference between their results relative to the result's largest entry (the batched
call must compute what the loop does).

Batched where the runtime's op covers several matrices: Muon's orthogonalisation (the stage's P
op or replicated share: one stacked Newton–Schulz per shape group), SOAP's and Shampoo's step end
(stacked same-shape blocks, as a GPU engine does; a CPU engine steps block by block, its batched
products being the slower ones; Shampoo with SGD grafting here, whose direction does not depend on
the step count each looped call advances). A refresh op covers one matrix's factor, so its batching is over that
factor's same-size blocks only: the refresh rows time the ops as the runtime calls them, one arm
(looped = batched).

    python experiments/bench_methods.py --hidden 256 --blocks 4 --repeats 7
    python experiments/bench_methods.py --quick          # seconds, tiny shapes (the test runs it)
    python experiments/bench_methods.py --device cuda --hidden 768 --blocks 12
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from pipefisher.runtime.training import set_tf32
from pipefisher.methods.blocks import FACTORS
from pipefisher.methods.muon.engine import MuonEngine
from pipefisher.methods.muon.method import MuonConfig
from pipefisher.methods.shampoo.engine import ShampooEngine
from pipefisher.methods.shampoo.method import ShampooConfig
from pipefisher.methods.soap.engine import SoapEngine
from pipefisher.methods.soap.method import SoapConfig


#: the methods benchmarked (--methods), by the first word of their row's name, lower case
METHODS = ("adamw", "muon", "soap", "shampoo")


@dataclass(frozen=True)
class Row:
    """One line of the table: milliseconds (median), ATen ops per call, and the largest
    |looped - batched| over the largest |looped| entry."""

    method: str
    work: str
    looped_ms: float
    batched_ms: float
    looped_ops: int
    batched_ops: int
    difference: float


@dataclass
class Twin:
    """One of two equal stages and the method state over it."""

    net: nn.Module
    engine: Any


@dataclass(frozen=True)
class Case:
    """A method's work two ways on twin states: `looped` and `batched` each do it once on their
    own twin (`batched` None: the op is the unit, one arm, timed on the first twin only);
    `result(twin)` is what the work computed (to compare); `reset(twin)` restores its inputs (the
    gradients the work overwrote) before each call."""

    method: str
    work: str
    twins: tuple[Twin, Twin]
    looped: Callable[[Twin], object]
    batched: Callable[[Twin], object] | None
    result: Callable[[Twin], torch.Tensor]
    reset: Callable[[Twin], None]


class OpCounter(TorchDispatchMode):
    """Counts the ATen ops dispatched inside it that are not views (a view launches no kernel)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += not func.is_view
        return func(*args, **(kwargs or {}))


def stage(hidden: int, blocks: int, device: torch.device, seed: int = 0) -> nn.Sequential:
    """`blocks` blocks of q, k, v, o (h, h), MLP up (4h, h) and down (h, 4h) linear layers."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(blocks):
        layers += [nn.Linear(hidden, hidden, bias=False) for _ in range(4)]
        layers += [nn.Linear(hidden, 4 * hidden, bias=False), nn.Linear(4 * hidden, hidden, bias=False)]
    return nn.Sequential(*layers).to(device)


def set_gradients(net: nn.Module, gradients: list[torch.Tensor]) -> None:
    for p, g in zip(net.parameters(), gradients):
        p.grad = g.clone()


def grad_stack(net: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in net.parameters()])


def cases(hidden: int, blocks: int, device: torch.device) -> list[Case]:
    """The methods' work on twin stages with the same gradients."""
    nets = stage(hidden, blocks, device), stage(hidden, blocks, device)
    generator = torch.Generator(device=device).manual_seed(1)
    gradients = [torch.randn(p.shape, generator=generator, device=device) for p in nets[0].parameters()]

    def reset(twin: Twin) -> None:
        set_gradients(twin.net, gradients)

    found: list[Case] = []

    adams = (
        Twin(nets[0], torch.optim.AdamW(nets[0].parameters(), lr=1e-3, foreach=False)),
        Twin(nets[1], torch.optim.AdamW(nets[1].parameters(), lr=1e-3, foreach=True)),
    )
    found.append(
        Case(
            "AdamW (torch: for loop / foreach)",
            "step",
            adams,
            lambda t: t.engine.step(),
            lambda t: t.engine.step(),
            lambda t: torch.cat([p.detach().flatten() for p in t.net.parameters()]),
            reset,
        )
    )

    muons = (Twin(nets[0], MuonEngine(nets[0], MuonConfig())), Twin(nets[1], MuonEngine(nets[1], MuonConfig())))
    found.append(
        Case(
            "Muon",
            "step",
            muons,
            lambda t: [t.engine.orthogonalise([name]) for name in t.engine.names()],
            lambda t: t.engine.orthogonalise(t.engine.names()),
            lambda t: torch.cat([m.update.flatten() for m in t.engine.matrices.values()]),
            reset,
        )
    )

    soaps = (Twin(nets[0], SoapEngine(nets[0], SoapConfig())), Twin(nets[1], SoapEngine(nets[1], SoapConfig())))
    for twin in soaps:
        twin.engine.stack_blocks = True  # as on a GPU (a CPU engine steps block by block)
        reset(twin)
        twin.engine.precondition_all()  # the first bases
        twin.engine.snapshot()
    found.append(
        Case(
            "SOAP",
            "step",
            soaps,
            lambda t: [t.engine.precondition_all(keep=lambda q, p=p: q is p) for p in t.engine.parameters()],
            lambda t: t.engine.precondition_all(),
            lambda t: grad_stack(t.net),
            reset,
        )
    )
    found.append(refresh_case("SOAP", soaps, "refresh", "shared_basis"))

    # SGD grafting: the direction does not depend on the step count, which each looped call advances
    shampoo = ShampooConfig(grafting="sgd")
    shampoos = (Twin(nets[0], ShampooEngine(nets[0], shampoo)), Twin(nets[1], ShampooEngine(nets[1], shampoo)))
    for twin in shampoos:
        twin.engine.stack_blocks = True  # as on a GPU (a CPU engine steps block by block)
        reset(twin)
        twin.engine.capture()
        for info in twin.engine.matrices():
            for factor in FACTORS:
                twin.engine.update_statistics(info.name, factor)
                twin.engine.compute_root(info.name, factor)
            twin.engine.release(info.name)
        twin.engine.commit()
    found.append(
        Case(
            "Shampoo",
            "step",
            shampoos,
            lambda t: [t.engine.precondition_all(keep=lambda q, p=p: q is p) for p in t.net.parameters()],
            lambda t: t.engine.precondition_all(),
            lambda t: grad_stack(t.net),
            reset,
        )
    )
    found.append(refresh_case("Shampoo", shampoos, "compute_root", "shared_root"))
    return found


def refresh_case(label: str, twins: tuple[Twin, Twin], refresh: str, shared: str) -> Case:
    """The refresh of every factor of every matrix (engine method `refresh`), looped only: a refresh op
    already batches its factor's blocks; the result is every factor's `shared` tensor, concatenated."""

    def factors(t: Twin) -> list[tuple[str, str]]:
        return [(info.name, f) for info in t.engine.matrices() for f in FACTORS]

    return Case(
        label,
        "refresh",
        twins,
        lambda t: [getattr(t.engine, refresh)(name, f) for name, f in factors(t)],
        None,
        lambda t: torch.cat([getattr(t.engine, shared)(name, f) for name, f in factors(t)]),
        lambda t: None,
    )


def synchronise(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(work: Callable[[], object], device: torch.device) -> float:
    """One call's wall time in ms, the device synchronised before and after."""
    synchronise(device)
    start = time.perf_counter()
    work()
    synchronise(device)
    return 1000.0 * (time.perf_counter() - start)


def measure(case: Case, repeats: int, device: torch.device) -> Row:
    """The row of `case`: first each arm once from equal inputs (compared, and counted), then
    `repeats` alternated timings (the order flips every repeat)."""
    looped_twin, batched_twin = case.twins
    if case.batched is None:
        arms = [(case.looped, looped_twin)]
    else:
        arms = [(case.looped, looped_twin), (case.batched, batched_twin)]
    ops = []
    for work, twin in arms:
        case.reset(twin)
        with OpCounter() as counter:
            work(twin)
        ops.append(counter.count)
    difference = 0.0
    if case.batched is not None:
        reference, batched = case.result(looped_twin), case.result(batched_twin)
        difference = float((reference - batched).abs().max() / reference.abs().max().clamp(min=1e-30))
    samples: list[list[float]] = [[] for _ in arms]
    for repeat in range(repeats):
        for arm in range(len(arms)) if repeat % 2 == 0 else reversed(range(len(arms))):
            work, twin = arms[arm]
            case.reset(twin)
            samples[arm].append(timed(lambda: work(twin), device))
    medians = [statistics.median(s) for s in samples]
    return Row(case.method, case.work, medians[0], medians[-1], ops[0], ops[-1], difference)


def table(rows: list[Row]) -> str:
    lines = [
        "| method | work | looped ms | batched ms | looped / batched | looped ops | batched ops | rel. difference |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.method} | {r.work} | {r.looped_ms:.2f} | {r.batched_ms:.2f} | "
            f"{r.looped_ms / r.batched_ms:.2f} | {r.looped_ops} | {r.batched_ops} | {r.difference:.1e} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=256, help="block width h")
    parser.add_argument("--blocks", type=int, default=4, help="transformer blocks on the stage")
    parser.add_argument("--repeats", type=int, default=7, help="alternated timings per arm (median)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (or cuda:N)")
    parser.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's default)")
    parser.add_argument("--quick", action="store_true", help="tiny shapes, 3 repeats: seconds")
    parser.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated subset of {','.join(METHODS)}")
    parser.add_argument(
        "--tf32",
        action="store_true",
        help="CUDA float32 products on TF32 tensor cores, as run.tf32 (no effect on a CPU)",
    )
    args = parser.parse_args(argv)
    chosen = args.methods.split(",")
    unknown = [name for name in chosen if name not in METHODS]
    if unknown:
        parser.exit(2, f"bench_methods: --methods: {unknown[0]!r} is not one of {', '.join(METHODS)}\n")
    for name in ("hidden", "blocks", "repeats"):
        if getattr(args, name) < 1:
            parser.exit(2, f"bench_methods: --{name} must be at least 1, got {getattr(args, name)}\n")
    try:
        device = torch.device(args.device)
    except RuntimeError:
        parser.exit(2, f"bench_methods: --device {args.device!r} is not a torch device\n")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.exit(2, f"bench_methods: --device {args.device}: CUDA is not available\n")
    if args.quick:
        args.hidden, args.blocks, args.repeats, args.threads = 8, 2, 3, 1
    if args.threads:
        torch.set_num_threads(args.threads)
    set_tf32(args.tf32)
    rows = [
        measure(case, args.repeats, device)
        for case in cases(args.hidden, args.blocks, device)
        if case.method.split()[0].lower() in chosen
    ]
    command = " ".join(["python experiments/bench_methods.py", *(sys.argv[1:] if argv is None else argv)])
    print(
        f"{args.blocks} blocks of width {args.hidden} on {device} ({torch.get_num_threads()} threads"
        f"{', TF32 products' if args.tf32 and device.type == 'cuda' else ''}), "
        f"median of {args.repeats}; command: `{command}`\n"
    )
    print(table(rows))


if __name__ == "__main__":
    main()
