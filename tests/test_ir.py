import os
import subprocess
import sys
from dataclasses import replace

import pytest

from pipefisher.core.ir import Op, OpKind, Schedule, ScheduleError, backward, format_grid, forward, peak_activations
from pipefisher.schedules import SCHEDULES, get_schedule


@pytest.mark.parametrize(
    "text, op",
    [
        ("1F3", forward(1, 3)),
        ("0B0", backward(0, 0)),
        ("p1.2F5", forward(2, 5, pipe=1)),
        ("2C0.5:block0.fc1", Op(OpKind.CURVATURE, 2, 5, layer="block0.fc1", part=0)),
        ("p1.3C1.0:block1.attention.query", Op(OpKind.CURVATURE, 3, 0, pipe=1, layer="block1.attention.query", part=1)),
        ("0R0:fc", Op(OpKind.REFRESH, 0, layer="fc", part=0)),
        ("4S1:fc", Op(OpKind.SYNC, 4, layer="fc", part=1)),
        ("2C12.34:fc", Op(OpKind.CURVATURE, 2, 34, layer="fc", part=12)),
        ("1X:fc", Op(OpKind.EXCHANGE, 1, layer="fc")),
        ("3P", Op(OpKind.PRECONDITION, 3)),
        ("12F34", forward(12, 34)),
    ],
)
def test_string_form_round_trips(text, op):
    assert str(op) == text
    assert Op.parse(text) == op


@pytest.mark.parametrize(
    "text, op",
    [
        ("2CA5:block0.fc1", Op(OpKind.CURVATURE, 2, 5, layer="block0.fc1", part=0)),
        ("p1.3CB0:block1.attention.query", Op(OpKind.CURVATURE, 3, 0, pipe=1, layer="block1.attention.query", part=1)),
        ("0IA:fc", Op(OpKind.REFRESH, 0, layer="fc", part=0)),
        ("0IB:fc", Op(OpKind.REFRESH, 0, layer="fc", part=1)),
        ("4SA:fc", Op(OpKind.SYNC, 4, layer="fc", part=0)),
        ("4SB:fc", Op(OpKind.SYNC, 4, layer="fc", part=1)),
    ],
)
def test_the_version_1_string_form_is_read(text, op):
    """Plans written before parts had indices: A is part 0, B part 1; IA/IB are refresh work."""
    assert Op.parse(text) == op


@pytest.mark.parametrize(
    "text",
    [
        "",
        "F3",
        "1Q3",
        "1F",
        "1IA3:fc",
        "1CA3",
        "p.1F3",
        "-1F3",
        "1P2",
        "1R:fc",
        "1C0:fc",
        "1R0.3:fc",
        "1F0.3",
        "1CA0.3:fc",
    ],
)
def test_parse_rejects_malformed_ops(text):
    with pytest.raises(ScheduleError):
        Op.parse(text)


def test_ops_are_hashable_and_equal_by_value():
    assert len({forward(0, 1), Op.parse("0F1"), backward(0, 1)}) == 2


def test_an_op_unpickled_in_another_process_hashes_like_its_ops(tmp_path):
    """An op caches its hash, which depends on the process's string hash seed."""
    path = tmp_path / "op.pickle"
    write = f"import pickle; from pipefisher.core.ir import forward; open({str(path)!r}, 'wb').write(pickle.dumps(forward(1, 2)))"
    read = f"import pickle; from pipefisher.core.ir import forward; print(pickle.loads(open({str(path)!r}, 'rb').read()) in {{forward(1, 2)}})"
    for code, seed in ((write, "1"), (read, "2")):
        result = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, "PYTHONHASHSEED": seed}
        )
        assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "True"


def test_ops_copy_with_replace_and_reject_negative_fields():
    assert replace(forward(1, 2), stage=3) == forward(3, 2)
    with pytest.raises(ScheduleError, match="non-negative"):
        forward(-1, 0)


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_schedule_json_round_trip(name, tmp_path):
    schedule = get_schedule(name, 4, 8)
    path = tmp_path / "s.json"
    schedule.save(path)
    assert Schedule.load(path) == schedule


def test_malformed_schedule_json_is_a_schedule_error():
    with pytest.raises(ScheduleError, match="malformed"):
        Schedule.from_dict({"name": "x"})


def test_grid_marks_an_op_and_keeps_it_visible_in_long_lists():
    ranks = [[forward(0, m) for m in range(200)]]
    grid = format_grid(ranks, mark=[(0, 150)], max_columns=20)
    assert ">0F150<" in grid
    assert grid.count("0F") <= 20 and "…" in grid


def test_peak_activations_counts_unmatched_forwards():
    ops = [forward(0, 0), forward(0, 1), backward(0, 0), forward(0, 2), backward(0, 1), backward(0, 2)]
    assert peak_activations(ops) == 2
