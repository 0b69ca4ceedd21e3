"""Per-layer K-FAC task times on this CPU: curvature, inversion (eigen vs Cholesky), precondition.

A square ``nn.Linear(n, n)`` with bias per size: A is (n+1)², B is n², the micro-batch has
``--rows`` rows (tokens). Median over ``--repeats`` runs after one warm-up, one thread,
float32. Usage::

    python experiments/kfac_benchmark.py [--sizes 64 128 256 512 1024] [--rows 512]
        [--repeats 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from pipefisher.methods.kfac.factors import accumulate_covariance, damped_inverse, precondition_matrix
from pipefisher.cli.scripts import entry_point

DAMPING = 1e-3


@dataclass(frozen=True)
class LayerTiming:
    """Median milliseconds of each K-FAC task for one layer size (curvature per micro-batch)."""

    size: int
    rows: int
    curvature_a: float
    curvature_b: float
    inverse_eigen: float
    inverse_cholesky: float
    precondition: float


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    """Median wall time of ``fn()`` in milliseconds over ``repeats`` runs after one warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def time_layer(size: int, rows: int, repeats: int, seed: int = 0) -> LayerTiming:
    gen = torch.Generator().manual_seed(seed)
    a, e = torch.randn(rows, size, generator=gen), torch.randn(rows, size, generator=gen)
    a_total, b_total = torch.zeros(size + 1, size + 1), torch.zeros(size, size)
    accumulate_covariance(a_total, a, ones_column=True)
    accumulate_covariance(b_total, e, ones_column=False)
    factor_a = a_total / rows
    a_inv, _ = damped_inverse(factor_a, DAMPING, "eigen")
    b_inv, _ = damped_inverse(b_total / rows, DAMPING, "eigen")
    grad = torch.randn(size, size + 1, generator=gen)
    return LayerTiming(
        size=size,
        rows=rows,
        curvature_a=median_ms(lambda: accumulate_covariance(a_total, a, ones_column=True), repeats),
        curvature_b=median_ms(lambda: accumulate_covariance(b_total, e, ones_column=False), repeats),
        inverse_eigen=median_ms(lambda: damped_inverse(factor_a, DAMPING, "eigen"), repeats),
        inverse_cholesky=median_ms(lambda: damped_inverse(factor_a, DAMPING, "cholesky"), repeats),
        precondition=median_ms(lambda: precondition_matrix(grad, a_inv, b_inv), repeats),
    )


def table(timings: list[LayerTiming]) -> str:
    """Markdown table of the timings with the eigen/Cholesky ratio."""
    lines = [
        "| n | rows | curvature A | curvature B | inverse eigen | inverse Cholesky | eigen/Cholesky | precondition |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for t in timings:
        lines.append(
            f"| {t.size} | {t.rows} | {t.curvature_a:.3f} | {t.curvature_b:.3f} | {t.inverse_eigen:.3f} | "
            f"{t.inverse_cholesky:.3f} | {t.inverse_eigen / t.inverse_cholesky:.1f} | {t.precondition:.3f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 128, 256, 512, 1024])
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", metavar="PATH", help="also write the timings as JSON")
    args = parser.parse_args()
    if args.repeats < 5:
        parser.error("--repeats must be at least 5")
    torch.set_num_threads(1)
    timings = [time_layer(n, args.rows, args.repeats) for n in args.sizes]
    print(f"median ms over {args.repeats} runs, float32, 1 thread, torch {torch.__version__}\n")
    print(table(timings))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"unit": "ms", "timings": [asdict(t) for t in timings]}, f, indent=1)


if __name__ == "__main__":
    sys.exit(entry_point(main, "kfac_benchmark"))
