"""experiments/bench_refresh.py: SOAP's and Shampoo's refresh in this tree against a git revision's, the
same bits, times and peak copies in one table; a revision git does not have is one line, exit 2."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "experiments" / "bench_refresh.py"


def run(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *flags], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_the_quick_table_compares_the_refresh_with_a_revisions():
    done = run("--against", "HEAD", "--quick", "--repeats", "2")
    assert done.returncode == 0, done.stderr
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ") and "x" in line.split("|")[1]]
    assert len(rows) == 4
    for row in rows:
        before_copies, now_copies = (float(cell) for cell in row.strip("| ").split(" | ")[-2:])
        assert now_copies <= before_copies


def test_an_unknown_revision_is_one_line_and_exit_2():
    done = run("--against", "no-such-revision", "--quick")
    assert done.returncode == 2 and "--against" in done.stderr and "Traceback" not in done.stderr
