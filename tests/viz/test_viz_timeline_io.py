import json
from pathlib import Path

import pytest

from pipefisher.cli.main import main
from pipefisher.core.profile import uniform_profile
from pipefisher.planning.packing.pack import pack
from pipefisher.planning.simulate import simulate
from pipefisher.schedules import get_schedule
from pipefisher.viz.layout import recorded_panel
from builders import rules_of
from pipefisher.planning.timeline_file import (
    MAX_LISTED,
    OP_SPAN,
    SCHEMA,
    StepTimes,
    TimelineError,
    load_timeline,
    save_timeline,
)

ROOT = Path(__file__).resolve().parents[2]


def test_round_trip_keeps_steps_ops_and_times(tmp_path, bert_profile):
    timelines = pack(get_schedule("1f1b", 4, 4), bert_profile, rules_of(bert_profile)).timelines
    path = tmp_path / "t.json"
    save_timeline(timelines, path, starts=[10.0 * j + 5 for j in range(len(timelines))], name="measured")
    data = json.loads(path.read_text())
    assert data["schema"] == SCHEMA and data["time_unit"] == "ms" and len(data["ranks"]) == 4
    record = load_timeline(path)
    assert record.name == "measured" and record.step_ids == tuple(range(len(timelines)))
    assert record.starts == tuple(10.0 * j + 5 for j in range(len(timelines)))
    for saved, loaded in zip(timelines, record.steps):
        for before, after in zip(saved.ranks, loaded.ranks):
            assert sorted((str(iv.op), round(iv.start, 9), round(iv.end, 9)) for iv in before) == sorted(
                (str(iv.op), round(iv.start, 9), round(iv.end, 9)) for iv in after
            )


def test_a_version_1_recording_reads_its_ops_by_part(tmp_path):
    """v1 wrote a method's ops by letter (``0CA0:fc``, ``0IB:fc``): parts 0 and 1; v2 is written."""
    path = tmp_path / "t.json"
    ops = ["0F0", "0CA0:fc", "0B0", "0CB0:fc", "0SA:fc", "0IB:fc", "0P"]
    data = {
        "schema": "pipefisher.timeline/v1",
        "time_unit": "ms",
        "ranks": [[{"op": op, "start": float(i), "end": i + 1.0} for i, op in enumerate(ops)]],
    }
    path.write_text(json.dumps(data))
    (step,) = load_timeline(path).steps
    assert [iv.op.token for iv in step.ranks[0]] == ["F", "C0", "B", "C1", "S0", "R1", "P"]
    save_timeline([step], tmp_path / "v2.json")
    written = json.loads((tmp_path / "v2.json").read_text())
    assert written["schema"] == SCHEMA == "pipefisher.timeline/v2"
    assert [entry["op"] for entry in written["ranks"][0]] == [
        "0F0",
        "0C0.0:fc",
        "0B0",
        "0C1.0:fc",
        "0S0:fc",
        "0R1:fc",
        "0P",
    ]
    assert load_timeline(ROOT / "profiles" / "tiny-cpu-1f1b-timeline.json").steps, "the shipped v1 recording"


def test_without_steps_and_starts_a_recording_is_one_step_from_its_first_op(tmp_path):
    path = tmp_path / "t.json"
    ranks = [
        [{"op": "0F0", "start": 100.0, "end": 101.0}, {"op": "0B0", "start": 102.5, "end": 104.0}],
        [{"op": "1F0", "start": 101.0, "end": 102.0}, {"op": "1B0", "start": 102.0, "end": 102.5}],
    ]
    path.write_text(json.dumps({"schema": SCHEMA, "time_unit": "us", "ranks": ranks}))
    record = load_timeline(path)
    assert record.starts == (100.0,) and record.step_ids == (0,)
    panel = recorded_panel(record, "r")
    assert [(b.rank, b.start, b.end) for b in panel.boxes if b.op.kind.value == "B"] == [(0, 2.5, 4.0), (1, 2.0, 2.5)]
    assert panel.end == 4.0 and panel.bubble_fraction == pytest.approx(1 - 4.0 / 8.0)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"schema": "other/v1"}, "schema"),
        ({"time_unit": "fortnights"}, "time_unit"),
        ({"ranks": [[{"op": "0Q0", "start": 0, "end": 1}]]}, "ranks[0][0].op"),
        ({"ranks": [[{"op": "0F0", "start": 2, "end": 1}]]}, "ranks[0][0]: end 1.0 is before start 2.0"),
        ({"ranks": [[{"op": "0F0", "start": 0, "end": 1, "step": -1}]]}, "ranks[0][0].step"),
        ({"ranks": [[{"op": "0F0", "start": 0}]]}, "ranks[0][0].end: missing"),
        ({"ranks": [[{"op": "0F0", "start": 0, "end": 1, "rank": 0}]]}, "unknown field 'rank'"),
        ({"step_starts": [0, 1]}, "step_starts"),
        ({"step_times": [1, 2]}, "step_times: expected a list of 1 numbers"),
        ({"step_times": [-1]}, "step_times[0]: -1.0 is negative"),
        ({"step_times": ["1"]}, "step_times[0]: '1' is not a finite number"),
        ({"ranks": []}, "ranks"),
    ],
)
def test_malformed_files_name_the_field(tmp_path, change, message, capsys):
    data = {"schema": SCHEMA, "time_unit": "ms", "ranks": [[{"op": "0F0", "start": 0, "end": 1}]], **change}
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(TimelineError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_timeline(path)
    assert main(["viz", "--timeline", str(path), "-o", "-"]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_viz_draws_a_recording(tmp_path, capsys):
    schedule = get_schedule("1f1b", 4, 6)
    timeline = simulate(schedule, uniform_profile(4))
    path = tmp_path / "m.json"
    save_timeline([timeline, timeline], path)
    assert main(["viz", "--timeline", str(path), "-o", "-", "--width", "63"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"m.json: D=4, 2 steps\nsteps 0, 1 ({OP_SPAN}): 27, 27 units; mean 27 units\nbubble 33.3 %")
    rows = [line for line in out.splitlines() if line.startswith("rank ")]
    assert rows[3] == "rank 3 |...0aa1bb2cc3dd4ee5ff.........0aa1bb2cc3dd4ee5ff......|"


def test_a_recording_with_step_times_is_titled_with_them(tmp_path):
    """`step_times` (the run's own step times) replace the ops' span, which leaves out the end of step."""
    path = tmp_path / "t.json"
    ranks = [[{"op": "0F0", "start": 0.0, "end": 1.0, "step": 3}, {"op": "0F0", "start": 10.0, "end": 11.0, "step": 4}]]
    path.write_text(
        json.dumps(
            {"schema": SCHEMA, "time_unit": "ms", "step_starts": [0.0, 10.0], "step_times": [9.96, 8.0], "ranks": ranks}
        )
    )
    record = load_timeline(path)
    assert record.measured == StepTimes((3, 4), (9.96, 8.0), "ms")
    panel = recorded_panel(record, "r")
    assert panel.step_time == pytest.approx(8.98)
    assert panel.title == "r: D=1, 2 steps; steps 3, 4: 10.0, 8.0 ms; mean 9.0 ms; bubble 0.0 %"


def test_step_times_list_a_few_steps_and_sum_up_many():
    assert str(StepTimes((7,), (2.5,), "us", OP_SPAN)) == f"step 7 ({OP_SPAN}): 2.5 us"
    many = StepTimes(tuple(range(1, MAX_LISTED + 2)), tuple(float(t) for t in range(MAX_LISTED + 1)), "ms")
    assert str(many) == f"steps 1..{MAX_LISTED + 1}: mean {MAX_LISTED / 2:.1f} ms (min 0.0 ms, max {MAX_LISTED:.1f} ms)"
