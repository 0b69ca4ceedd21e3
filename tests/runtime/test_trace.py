"""`pipefisher run --trace DIR`: a profiler trace per rank with every executor action labelled,
and `pipefisher viz --trace` drawing it under the simulator's prediction."""

import json
import re
import subprocess
from collections import Counter
from pathlib import Path

import pytest

from pipefisher.config import load_config
from pipefisher.core.topology import Topology
from pipefisher.core.trace_labels import PREPARE
from pipefisher.planning.comm.plan import plan_actions
from pipefisher.runtime.pipeline.plan_runner import schedule_plan
from pipefisher.runtime.training.assembly import build_schedule

TINY = Path(__file__).resolve().parents[2] / "schedules" / "tiny-regression.yaml"


def pipefisher(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["pipefisher", *args], capture_output=True, text=True, timeout=180)


@pytest.fixture(scope="module")
def traced_run(tmp_path_factory) -> tuple[Path, str]:
    """The trace folder of a 4-step run (steps 3 and 4 traced) and the run's stdout."""
    folder = tmp_path_factory.mktemp("trace")
    done = pipefisher("run", str(TINY), "--steps", "4", "--trace", str(folder), "--master-port", "0")
    assert done.returncode == 0, done.stderr
    # the torch profiler's own log lines (kineto's profiler_start/stop) stay off
    assert all(line.startswith(("pipefisher", "step ")) for line in done.stderr.splitlines()), done.stderr
    return folder, done.stdout


@pytest.fixture(scope="module")
def traced(traced_run) -> Path:
    return traced_run[0]


def labels_of_step(path: Path, step: int) -> Counter:
    """The labelled regions inside a rank's region `step N` (1-based), the step's own region and
    torch's (`gloo:send`, `Optimizer.step#SGD.step`) excluded."""
    events = [
        e
        for e in json.loads(path.read_text())["traceEvents"]
        if e.get("ph") == "X" and e.get("cat") == "user_annotation"
    ]
    (region,) = [e for e in events if e["name"] == f"step {step}"]
    inside = [
        e["name"]
        for e in events
        if region["ts"] < e["ts"] <= region["ts"] + region["dur"] and not e["name"].startswith(("gloo:", "Optimizer."))
    ]
    return Counter(inside)


@pytest.mark.dist
def test_every_action_of_a_traced_step_is_a_labelled_region(traced):
    """Steps 3 and 4 are traced (run.trace_from 3, trace_steps 2); each rank's regions in step 3
    are exactly its actions of the plan, by their string form, plus the end of step, and in step 3
    (not the run's last) the building of the next step's micro-batches."""
    config = load_config(TINY)
    schedule = build_schedule(config)
    plan = plan_actions(Topology(schedule, 1), schedule_plan(schedule))
    assert sorted(p.name for p in traced.iterdir()) == ["rank0.json", "rank1.json"]
    for rank in range(2):
        last = Counter(str(action) for action in plan.steps[0][rank]) + Counter(["step end"])
        assert labels_of_step(traced / f"rank{rank}.json", 3) == last + Counter([PREPARE])
        assert labels_of_step(traced / f"rank{rank}.json", 4) == last


@pytest.mark.dist
def test_viz_draws_the_trace_under_its_prediction(traced, tmp_path):
    done = pipefisher("viz", str(TINY), "--trace", str(traced), "-o", "-", "--width", "100")
    assert done.returncode == 0, done.stderr
    assert "1f1b predicted (trace op times): D=2, N=4" in done.stdout
    assert f"measured ({traced.name}): D=2, 2 steps" in done.stdout
    assert "step    3" in done.stdout


@pytest.mark.dist
def test_viz_gives_the_step_times_the_run_printed(traced_run, tmp_path):
    """The run's printed step times of steps 3 and 4 are, digit for digit, the figure title's and
    the summary's; their mean is the mean of what the run printed to within its 0.1 ms."""
    from pipefisher.viz.trace_io import load_trace

    folder, stdout = traced_run
    printed = {int(m[1]): float(m[2]) for m in re.finditer(r"^step (\d+)/4 .*step time (\d+\.\d) ms", stdout, re.M)}
    measured = load_trace(folder).measured
    assert measured.step_ids == (3, 4) and measured.basis == "", measured
    assert [measured.number(t) for t in measured.times] == [f"{printed[3]:.1f}", f"{printed[4]:.1f}"], (
        measured,
        stdout,
    )
    assert float(measured.number(measured.mean)) == pytest.approx((printed[3] + printed[4]) / 2, abs=0.1 + 1e-9)
    listed = f"steps 3, 4: {measured.number(measured.times[0])}, {measured.number(measured.times[1])} ms; mean {measured.number(measured.mean)} ms"
    assert str(measured) == listed
    done = pipefisher("viz", str(TINY), "--trace", str(folder), "-o", "-", "--width", "150")
    assert done.returncode == 0, done.stderr
    (title,) = [line for line in done.stdout.splitlines() if line.startswith(f"measured ({folder.name}): ")]
    assert f"; {listed}; bubble " in title
    assert f"\nmeasured {listed}\n" in done.stdout
    rank0 = {int(m[1]): m[2] for m in re.finditer(r"^rank 0 step (\d+): (\d+\.\d) ms", done.stdout, re.M)}
    assert rank0 == {3: measured.number(measured.times[0]), 4: measured.number(measured.times[1])}


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ("--steps", "3"),
            "run.trace_from 3 + run.trace_steps 2: the trace would end at step 4, after the run's last step 3",
        ),
        (("--steps", "4", "--reference"), "--reference trains in one process without the executor"),
    ],
)
def test_a_trace_the_run_cannot_write_is_one_line(tmp_path, args, message):
    done = pipefisher("run", str(TINY), "--trace", str(tmp_path / "t"), *args)
    assert done.returncode == 2 and message in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert not (tmp_path / "t").exists()


def test_viz_of_a_folder_without_traces_is_one_line(tmp_path):
    done = pipefisher("viz", "--trace", str(tmp_path), "-o", "-")
    assert done.returncode == 2 and "holds no rank<R>.json trace" in done.stderr


@pytest.mark.dist
def test_viz_draws_every_action_of_a_traced_step(traced, tmp_path):
    from pipefisher.viz.action_figure import step_regions
    from pipefisher.viz.trace_io import trace_files

    step, regions = step_regions(trace_files(traced))
    assert step == 3
    for rank in range(2):
        assert Counter(r.label for r in regions if r.rank == rank) == labels_of_step(traced / f"rank{rank}.json", 3)
    done = pipefisher("viz", "--trace", str(traced), "--actions", "-o", str(tmp_path / "step.png"))
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "step.png").stat().st_size > 10_000


@pytest.mark.dist
def test_the_summary_accounts_for_each_traced_step(traced):
    from pipefisher.viz.trace_io import trace_files
    from pipefisher.viz.trace_summary import summarise

    summaries = summarise(trace_files(traced))
    assert [(s.rank, s.step) for s in summaries] == [(0, 3), (0, 4), (1, 3), (1, 4)]
    for s in summaries:
        assert {"forward", "backward", "end of step"} <= set(s.actions) and s.device_busy is None
        assert 0 <= s.outside_actions < s.wall


def test_the_summary_counts_overlapping_device_work_once(tmp_path):
    """Device busy time is the union of kernels and copies inside the step (µs in, ms out)."""
    from pipefisher.viz.trace_io import trace_files
    from pipefisher.viz.trace_summary import summarise

    def event(name, cat, ts, dur):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}

    events = [
        event("step 3", "user_annotation", 0, 10_000),
        event("0F0", "user_annotation", 100, 4_000),
        event("gemm", "kernel", 1_000, 2_000),
        event("add", "kernel", 2_000, 2_000),
        event("copy", "gpu_memcpy", 6_000, 500),
        event("late", "kernel", 20_000, 1_000),
    ]
    (tmp_path / "rank0.json").write_text(json.dumps({"traceEvents": events}))
    (summary,) = summarise(trace_files(tmp_path))
    assert (summary.step, summary.wall, summary.kernels) == (3, 10.0, 2)
    assert summary.device_busy == pytest.approx(3.5) and summary.actions == {"forward": 4.0}
    assert summary.outside_actions == pytest.approx(6.0)
    assert summary.top_kernels == (("gemm", 2.0), ("add", 2.0))
