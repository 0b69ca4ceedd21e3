"""The refresh work of SOAP and Shampoo on a group of same-size blocks (SOAP's
`pipefisher.methods.soap.basis.power_basis`: one power-iteration step and a QR; Shampoo's
`pipefisher.methods.shampoo.roots.eigen_root`: an inverse 4th root by eigendecomposition) in this
tree against the same functions at a git revision, side by side in one process: the calls
alternate, in an order that changes every repeat, and the table gives the median milliseconds of
each, their ratio, and the peak bytes of live tensors each call allocates (`LiveTensorBytes`) in
copies of the group's statistics. Both must return the same bits.

    python experiments/bench_refresh.py --against d5c69e6 --repeats 9
    python experiments/bench_refresh.py --against HEAD --quick     # seconds (the test runs it)
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
from pipefisher.methods.shampoo import roots
from pipefisher.methods.soap import basis
from pipefisher.runtime.training import LiveTensorBytes

ROOT = Path(__file__).resolve().parent.parent
#: (blocks in the group, block side, dtype of the statistics)
GROUPS = ((1, 512, torch.float64), (4, 128, torch.float64), (4, 1024, torch.float64), (1, 512, torch.float32))
QUICK = ((1, 64, torch.float64), (2, 32, torch.float32))


#: the timed work: (its row's name, its module now, the module's path, a call of the module on
#: (statistics, bases))
WORK = (
    ("SOAP basis", basis, "pipefisher/methods/soap/basis.py", lambda module, s, q: module.power_basis(s, q)),
    ("Shampoo root", roots, "pipefisher/methods/shampoo/roots.py", lambda module, s, q: module.eigen_root(s, 1e-6)),
)


def module_at(path: str, revision: str) -> types.ModuleType:
    """The module at `path` as it is at `revision` (ValueError naming it when git has none)."""
    found = subprocess.run(["git", "show", f"{revision}:{path}"], cwd=ROOT, capture_output=True, text=True)
    if found.returncode:
        raise ValueError(f"--against: git has no {path} at {revision!r}")
    module = types.ModuleType(f"{Path(path).stem}_at_{revision}")
    exec(compile(found.stdout, f"{path}@{revision}", "exec"), module.__dict__)
    return module


def peak_copies(call, stats: torch.Tensor) -> float:
    """Peak bytes of live tensors `call()` allocates, in copies of `stats`."""
    probe = LiveTensorBytes()
    with probe:
        call()
    return probe.peak / (stats.numel() * stats.element_size())


def row(name: str, call, now: types.ModuleType, before: types.ModuleType, group: tuple, repeats: int) -> str:
    blocks, side, dtype = group
    generator = torch.Generator().manual_seed(side)
    g = torch.randn(blocks, side, side // 2, dtype=dtype, generator=generator)
    stats, bases = g @ g.mT, torch.linalg.qr(torch.randn(blocks, side, side, generator=generator)).Q
    arms = {"before": lambda: call(before, stats, bases), "now": lambda: call(now, stats, bases)}
    results = {arm: work() for arm, work in arms.items()}
    if not all(torch.equal(a, b) for a, b in zip(results["before"], results["now"])):
        raise SystemExit(f"{name}, {blocks} x {side}²: the results differ from the revision's")
    times: dict[str, list[float]] = {arm: [] for arm in arms}
    for repeat in range(repeats):
        for arm in sorted(arms, reverse=bool(repeat % 2)):
            start = time.perf_counter()
            arms[arm]()
            times[arm].append(time.perf_counter() - start)
    before_ms, now_ms = (statistics.median(times[arm]) * 1e3 for arm in arms)
    copies = [peak_copies(work, stats) for work in arms.values()]
    label = f"{name}, {blocks} x {side}² {str(dtype).removeprefix('torch.')}"
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
        before = {path: module_at(path, args.against) for _, _, path, _ in WORK}
    except ValueError as error:
        parser.error(str(error))
    print(
        f"| group | {args.against} ms | now ms | now / {args.against} | peak copies {args.against} | peak copies now |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, now, path, call in WORK:
        for group in QUICK if args.quick else GROUPS:
            print(row(name, call, now, before[path], group, args.repeats), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(entry_point(main, "bench_refresh"))
