"""The scripts in experiments/ (the README and docs/performance.md quote them) still start, and the executor benchmarks
still run end to end on a tiny model."""

import subprocess
import sys
from pathlib import Path

import pytest

from pipefisher.methods.registry import methods

ROOT = Path(__file__).resolve().parents[1]
#: the scripts (the package's other modules, `__init__` and `common`, are not run)
SCRIPTS = sorted(path for path in (ROOT / "experiments").glob("*.py") if "__main__" in path.read_text())


def run(script: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "experiments" / script), *args], capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.parametrize("script", [path.name for path in SCRIPTS])
def test_every_experiment_answers_help(script):
    result = run(script, "--help")
    assert result.returncode == 0, result.stderr
    assert "usage:" in result.stdout


@pytest.mark.dist
@pytest.mark.slow
def test_the_executor_benchmark_runs_and_its_variants_start_alike():
    tiny = [
        "--micro-batches",
        "2",
        "--repeats",
        "1",
        "--steps",
        "1",
        "--warmup",
        "1",
        "--hidden",
        "16",
        "--heads",
        "2",
        "--ffn",
        "32",
        "--seq-len",
        "4",
        "--layers",
        "2",
        "--micro-batch-size",
        "2",
    ]
    result = run("bench_executor.py", *tiny, timeout=240)
    assert result.returncode == 0, result.stderr
    assert "max relative difference" in result.stdout and "-> OK" in result.stdout
    assert "| gpipe (torch ScheduleGPipe) | 2 |" in result.stdout


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("method", methods())
def test_the_pipefisher_benchmark_runs(method, tmp_path):
    tiny = [
        "--method",
        method,
        "--schedules",
        "1f1b",
        "--repeats",
        "1",
        "--min-steps",
        "2",
        "--max-rounds",
        "1",
        "--warmup-cycles",
        "1",
        "--profile-warmup",
        "1",
        "--profile-repeats",
        "1",
        "--micro-batches",
        "2",
        "--micro-batch-size",
        "2",
        "--layers",
        "2",
        "--hidden",
        "16",
        "--heads",
        "2",
        "--ffn",
        "32",
        "--seq-len",
        "8",
        "--refresh-steps",
        "2",
        "--no-reprofile",
        "--profile-dir",
        str(tmp_path),
    ]
    result = run("bench_pipefisher.py", *tiny, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "1F1B" in result.stdout or "1f1b" in result.stdout
    assert f"{method} layers" in result.stdout, "the packing profile lists the method's layers"


@pytest.mark.dist
@pytest.mark.slow  # about 13 s here; slow as the other benchmarks' smoke runs
def test_the_executor_benchmark_compares_the_zero_bubble_schedules_with_torchs():
    """Issue 18: pipefisher's zb-h1/zbv/dualpipev beside torch's ScheduleInterleavedZeroBubble (one
    stage per rank), ScheduleZBVZeroBubble and ScheduleDualPipeV (two per rank, in a V), same model:
    both sides of every pair run, start from the same loss, and the table gives both medians and the ratios."""
    tiny = [
        "--schedules",
        "zb-h1",
        "zbv",
        "dualpipev",
        "--micro-batches",
        "4",
        "--repeats",
        "2",
        "--steps",
        "1",
        "--warmup",
        "1",
        "--hidden",
        "16",
        "--heads",
        "2",
        "--ffn",
        "32",
        "--seq-len",
        "4",
        "--layers",
        "4",
        "--micro-batch-size",
        "2",
    ]
    result = run("bench_executor.py", *tiny, timeout=240)
    assert result.returncode == 0, result.stderr
    assert "max relative difference" in result.stdout and "-> OK" in result.stdout, result.stdout
    for schedule, torch_name in [
        ("zb-h1", "ScheduleInterleavedZeroBubble"),
        ("zbv", "ScheduleZBVZeroBubble"),
        ("dualpipev", "ScheduleDualPipeV"),
    ]:
        row = next(
            line for line in result.stdout.splitlines() if line.startswith(f"| {schedule} (torch {torch_name}) | 4 |")
        )
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        # pipefisher's median, torch's median, the ratio of medians, the paired ratio
        assert all(float(cell) > 0 for cell in cells[2:6]), row
    assert "registers no schedule" not in result.stdout


@pytest.mark.dist
@pytest.mark.slow  # a profile, two plans and a 2-process group with two runs: 3.5 min at load 11 on 2 cores
def test_the_zero_step_time_experiment_measures_and_predicts_the_ratio(tmp_path):
    """One round of one step each: both runs are timed and both run files predicted."""
    smoke = ["--rounds", "1", "--steps", "1", "--warmup", "1", "--micro-batch-size", "2", "--profile-repeats", "1"]
    result = run("zero_step_time.py", *smoke, "--out", str(tmp_path), timeout=400)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("| 1 | ") == 1 and result.stdout.count("| 3 | ") == 1
    assert "ZeRO-3 / ZeRO-1: measured " in result.stdout and "predicted by pipefisher plan " in result.stdout


@pytest.mark.slow  # about 40 s here: 12 tiny reference runs with held-out evaluation
def test_the_convergence_study_runs_end_to_end_on_held_out_text(tmp_path):
    """--quick: AdamW and the first registered curvature method on both workloads; the target is
    the median of AdamW's final held-out losses, every tuned method gets a table row, and the
    figure and the evaluations are written."""
    import csv

    out = tmp_path / "conv"
    result = run("convergence.py", "--quick", "--cache", str(tmp_path / "cache"), "--out", str(out), timeout=240)
    assert result.returncode == 0, result.stderr
    method = next(iter(methods()))
    rows = list(csv.DictReader(open(out.with_suffix(".csv"))))
    for workload, loss in (("bert", "MLM"), ("gpt2", "LM")):
        adamw = [
            row for row in rows if row["workload"] == workload and row["method"] == "adamw" and row["step"] == "30"
        ]
        tuned = {row["lr"] for row in adamw if row["seed"] != "0"}
        assert len(tuned) == 1, "the seeds beyond 0 run at the tuned setting"
        finals = sorted(float(row["held_out_loss"]) for row in adamw if row["lr"] in tuned)
        assert len(finals) == 2 and f"held-out {loss} loss {finals[1]:.3f}, " in result.stdout
    assert result.stdout.count(f"| {method} | lr ") == 6 and result.stdout.count("| adamw | lr ") == 6
    assert result.stdout.count("- adamw: lr 0.0003, 0.001; best ") == 2, "each workload says how AdamW was tuned"
    assert (
        out.with_suffix(".png").stat().st_size > 10_000 and out.with_suffix(".md").read_text() in result.stdout + "\n"
    )


@pytest.mark.slow  # a few seconds: 96 kept runs and 12 step times read, nothing trained
def test_the_published_convergence_study_is_made_of_its_kept_records(tmp_path):
    """docs/convergence.md's command, training nothing (--cached-only), gives back its every table
    row, target and tuning line from the records kept in the repository."""
    page = ROOT / "docs" / "convergence.md"
    command = next(line for line in page.read_text().splitlines() if line.startswith("Command: `"))
    argv = command.split("`")[1].split()[2:]
    argv[argv.index("--out") + 1] = str(tmp_path / "again")
    again = run("convergence.py", *argv, "--cached-only", timeout=300)
    assert again.returncode == 0, again.stderr
    kept = [line for line in page.read_text().splitlines() if line.startswith(("|", "Target:", "- "))]
    regenerated = (tmp_path / "again.md").read_text().splitlines()
    assert len(kept) > 40 and kept == [line for line in regenerated if line.startswith(("|", "Target:", "- "))]


#: the one experiment that reaches behind the runtime's public API, on purpose: bench_executor times
#: the executor's own methods (and torch's) by wrapping them, in `install_profiling`
BEHIND_THE_API = {("bench_executor.py", "install_profiling")}


def test_experiments_use_the_runtime_through_its_public_api():
    """Experiments import the runtime from `pipefisher.runtime.training` (names it exports), a
    script's entry point from `pipefisher.cli.scripts`, and nothing private of the package; tests
    import experiments as the `experiments` package, not through sys.path."""
    import ast
    import pkgutil

    import pipefisher.runtime.training as public

    found = []
    for path in sorted((ROOT / "experiments").rglob("*.py")):
        tree = ast.parse(path.read_text())
        scopes = {
            id(node): function.name
            for function in ast.walk(tree)
            if isinstance(function, ast.FunctionDef)
            for node in ast.walk(function)
        }
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom) or not (node.module or "").startswith("pipefisher."):
                continue
            where = f"{path.relative_to(ROOT)}:{node.lineno}"
            names = [alias.name for alias in node.names]
            if node.module == "pipefisher.runtime.training":
                found += [f"{where} {name} (not exported)" for name in names if name not in public.__all__]
            elif node.module.startswith("pipefisher.runtime"):
                if (path.name, scopes.get(id(node))) not in BEHIND_THE_API:
                    found.append(f"{where} {node.module}")
            elif node.module.startswith("pipefisher.cli") and node.module != "pipefisher.cli.scripts":
                if (node.module, tuple(names)) != ("pipefisher.cli.training", ("profile_run",)):
                    found.append(f"{where} {node.module}")
            found += [f"{where} {node.module}.{name} (private)" for name in names if name.startswith("_")]
    assert found == []
    # importing a submodule binds its name on the package, over an export of the same name
    submodules = {module.name for module in pkgutil.iter_modules(public.__path__)}
    assert not submodules & set(public.__all__)
    through_the_path = [
        path.name
        for path in (ROOT / "tests").rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call)
        and ast.unparse(node.func) in ("sys.path.insert", "sys.path.append")
        and "experiments" in ast.unparse(node)
    ]
    assert through_the_path == []
