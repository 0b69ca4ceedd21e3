"""experiments/gpu_speed.sh, the one script a session lent a GPU runs: every Python script it calls
exists and takes every flag the script passes it, and the two parts no other test runs
(`executor_host.py`, `gpu_check.py`) run end to end on the CPU with what they report holding, so a
GPU session does not find them broken."""

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "experiments" / "gpu_speed.sh"


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=240, cwd=ROOT)


def test_the_gpu_script_parses_and_names_scripts_that_exist():
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, timeout=30).returncode == 0
    named = re.findall(r"python (experiments/\w+\.py)", SCRIPT.read_text())
    assert {"experiments/executor_host.py", "experiments/gpu_check.py", "experiments/bench_methods.py"} <= set(named)
    assert all((ROOT / path).is_file() for path in named), named


def _parts() -> list[tuple[str, list[str]]]:
    """Each `part NAME SECONDS python SCRIPT ARGS...` of the script (continuation lines joined):
    the script and the flags it is given."""
    text = SCRIPT.read_text().replace("\\\n", " ")
    found = []
    for line in text.splitlines():
        match = re.match(r"part \S+ \d+ python (experiments/\w+\.py)(.*)", line.strip())
        if match:
            found.append((match.group(1), re.findall(r"(?<!\S)(--[\w-]+)", match.group(2))))
    return found


def test_every_flag_the_gpu_script_passes_is_one_its_script_takes():
    parts = _parts()
    assert len(parts) >= 5
    for script in sorted({script for script, _ in parts}):
        result = run(script, "--help")
        assert result.returncode == 0, result.stderr
        for flag in {flag for name, flags in parts if name == script for flag in flags}:
            assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", result.stdout), (script, flag)


def test_executor_host_casts_each_weight_once_per_step_where_the_reference_casts_per_micro_batch():
    result = run(
        "experiments/executor_host.py", "--run", "schedules/gpt2-tiny-cpu.yaml", "--micro-batches", "2", "--steps", "1"
    )
    assert result.returncode == 0, result.stderr
    row = next(line for line in result.stdout.splitlines() if line.startswith("| schedules/gpt2-tiny-cpu.yaml |"))
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    assert int(cells[1]) > 0  # weights autocast casts
    assert cells[2] == "[2] / [1]"  # before: once per micro-batch; after: once per step
    assert float(cells[3].split(" / ")[1]) == 0.0  # nothing built inside the step's ops


def test_gpu_check_trains_a_one_stage_world_on_the_cpu(tmp_path):
    out = tmp_path / "syncs.json"
    result = run(
        "experiments/gpu_check.py",
        "schedules/tiny-cpu.yaml",
        "--device",
        "cpu",
        "--precision",
        "bf16",
        "--optimizer",
        "muon",
        "--steps",
        "3",
        "--sync-debug",
        "1",
        "--json",
        str(out),
    )
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(summary["losses"]) == 3 and all(0 < loss < 20 for loss in summary["losses"])
    assert summary["median_step_ms"] > 0
    written = json.loads(out.read_text())
    assert len(written["steps"]) == 3 and written["syncs"] == summary["syncs"]
