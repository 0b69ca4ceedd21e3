"""The benchmark script runs and reports every task per size (no timing thresholds)."""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "experiments" / "kfac_benchmark.py"
_spec = importlib.util.spec_from_file_location("experiments_kfac_benchmark", SCRIPT)
benchmark = sys.modules[_spec.name] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(benchmark)


def test_benchmark_times_every_task_for_each_size():
    timings = [benchmark.time_layer(n, rows=32, repeats=5) for n in (8, 16)]
    assert [t.size for t in timings] == [8, 16]
    for t in timings:
        assert min(t.curvature_a, t.curvature_b, t.inverse_eigen, t.inverse_cholesky, t.precondition) > 0
    lines = benchmark.table(timings).splitlines()
    assert len(lines) == 4 and lines[2].startswith("| 8 | 32 |")


def test_median_ignores_an_outlier_that_would_dominate_the_mean():
    durations = iter([0.0, 0.001, 0.001, 0.05, 0.001, 0.001])  # warm-up, then 5 runs
    ms = benchmark.median_ms(lambda: time.sleep(next(durations)), repeats=5)
    assert 0.9 <= ms < 8  # the mean is above 10.8 ms
