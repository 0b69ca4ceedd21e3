"""SOAP's refresh (`pipefisher.methods.soap.basis.power_basis`: one power-iteration step and a QR
of a group of same-size blocks) in this tree against the same module at a git revision, side by
side in one process: the calls alternate, in an order that changes every repeat, and the table
gives the median milliseconds of each, their ratio, and the peak bytes of live tensors each call
allocates (`LiveTensorBytes`) in copies of the group's statistics. Both must return the same bits.

    python experiments/bench_soap_refresh.py --against d5c69e6 --repeats 9
    python experiments/bench_soap_refresh.py --against HEAD --quick     # seconds (the test runs it)
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

import torch

from pipefisher.cli.scripts import entry_point
from pipefisher.methods.soap import basis
from pipefisher.runtime.training import LiveTensorBytes

ROOT = Path(__file__).resolve().parent.parent
#: (blocks in the group, block side, dtype of the statistics)
GROUPS = ((1, 512, torch.float64), (4, 128, torch.float64), (4, 1024, torch.float64), (1, 512, torch.float32))
QUICK = ((1, 64, torch.float64), (2, 32, torch.float32))


def module_at(revision: str) -> types.ModuleType:
    """`pipefisher.methods.soap.basis` as it is at `revision` (ValueError naming it when git has none)."""
    found = subprocess.run(
        ["git", "show", f"{revision}:pipefisher/methods/soap/basis.py"], cwd=ROOT, capture_output=True, text=True
    )
    if found.returncode:
        raise ValueError(f"--against: git has no pipefisher/methods/soap/basis.py at {revision!r}")
    module = types.ModuleType(f"basis_at_{revision}")
    exec(compile(found.stdout, f"basis.py@{revision}", "exec"), module.__dict__)
    return module


def peak_copies(call, stats: torch.Tensor) -> float:
    """Peak bytes of live tensors `call()` allocates, in copies of `stats`."""
    probe = LiveTensorBytes()
    with probe:
        call()
    return probe.peak / (stats.numel() * stats.element_size())


def row(before: types.ModuleType, blocks: int, side: int, dtype: torch.dtype, repeats: int) -> str:
    generator = torch.Generator().manual_seed(side)
    g = torch.randn(blocks, side, side // 2, dtype=dtype, generator=generator)
    stats, bases = g @ g.mT, torch.linalg.qr(torch.randn(blocks, side, side, generator=generator)).Q
    arms = {"before": lambda: before.power_basis(stats, bases), "now": lambda: basis.power_basis(stats, bases)}
    results = {name: call() for name, call in arms.items()}
    if not all(torch.equal(a, b) for a, b in zip(results["before"], results["now"])):
        raise SystemExit(f"{blocks} x {side}²: the refresh's results differ from the revision's")
    times: dict[str, list[float]] = {name: [] for name in arms}
    for repeat in range(repeats):
        for name in sorted(arms, reverse=bool(repeat % 2)):
            start = time.perf_counter()
            arms[name]()
            times[name].append(time.perf_counter() - start)
    before_ms, now_ms = (statistics.median(times[name]) * 1e3 for name in arms)
    copies = [peak_copies(call, stats) for call in arms.values()]
    label = f"{blocks} x {side}² {str(dtype).removeprefix('torch.')}"
    return (
        f"| {label} | {before_ms:.2f} | {now_ms:.2f} | {now_ms / before_ms:.3f} | {copies[0]:.2f} | {copies[1]:.2f} |"
    )


def main() -> int:
    parser = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--against", required=True, help="the git revision to compare with (e.g. HEAD, a commit)")
    parser.add_argument("--repeats", type=int, default=9, help="alternated calls per arm (default 9)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--quick", action="store_true", help="tiny groups (seconds)")
    args = parser.parse_args()
    if args.repeats < 1 or args.threads < 1:
        parser.error("--repeats and --threads must be at least 1")
    torch.set_num_threads(args.threads)
    try:
        before = module_at(args.against)
    except ValueError as error:
        parser.error(str(error))
    print(
        f"| group | {args.against} ms | now ms | now / {args.against} | peak copies {args.against} | peak copies now |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for blocks, side, dtype in QUICK if args.quick else GROUPS:
        print(row(before, blocks, side, dtype, args.repeats), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(entry_point(main, "bench_soap_refresh"))
