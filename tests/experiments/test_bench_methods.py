"""experiments/bench_methods.py: the quick run prints the table with every method, the batched work
computes what the per-matrix loop does with fewer dispatched ops; bad flags are one line, exit 2."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "experiments" / "bench_methods.py"


def bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300, cwd=ROOT)


def test_the_quick_run_tables_every_method_and_batched_equals_looped():
    result = bench("--quick")
    assert result.returncode == 0, result.stderr
    assert "command: `python experiments/bench_methods.py --quick`" in result.stdout
    rows = {}
    for line in result.stdout.splitlines():
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if line.startswith("| ") and cells[0] != "method":
            rows[(cells[0], cells[1])] = cells
    assert set(rows) == {
        ("AdamW (torch: for loop / foreach)", "step"),
        ("Muon", "step"),
        ("SOAP", "step"),
        ("SOAP", "refresh"),
        ("Shampoo", "step"),
        ("Shampoo", "refresh"),
    }
    for (method, work), cells in rows.items():
        looped_ms, batched_ms = float(cells[2]), float(cells[3])
        looped_ops, batched_ops, difference = int(cells[5]), int(cells[6]), float(cells[7])
        assert looped_ms > 0 and batched_ms > 0, method
        assert difference <= 1e-5, (method, work, difference)
        if work == "step":
            assert batched_ops < looped_ops, (method, looped_ops, batched_ops)
        else:
            assert batched_ops == looped_ops and looped_ms == batched_ms, (method, work)


def test_bad_flags_are_one_line_and_exit_2():
    result = bench("--hidden", "0")
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        "bench_methods: --hidden must be at least 1, got 0"
    ]
    result = bench("--methods", "adamw,soup")
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        "bench_methods: --methods: 'soup' is not one of adamw, muon, soap, shampoo"
    ]
    result = bench("--device", "nonsense")
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
