from dataclasses import replace

import pytest

from pipefisher.cli.main import main
from pipefisher.core.profile import uniform_profile
from pipefisher.schedules import get_schedule
from pipefisher.viz.layout import curvature_panel, schedule_panel
from pipefisher.viz.text import MIN_WIDTH, render_text
from builders import rules_of


def _rank_rows(text):
    return [line for line in text.splitlines() if line.startswith("rank ")]


def test_one_slice_per_time_unit_reproduces_the_readme_chart():
    panel = schedule_panel(get_schedule("1f1b", 4, 6), uniform_profile(4, 1.0, 2.0))
    assert _rank_rows(render_text([panel], 36)) == [
        "rank 0 |0123......aa4bb5cc.dd.ee.ff|",
        "rank 1 |.012....aa3bb4cc5dd.ee.ff..|",
        "rank 2 |..01..aa2bb3cc4dd5ee.ff....|",
        "rank 3 |...0aa1bb2cc3dd4ee5ff......|",
    ]


@pytest.mark.parametrize("width", [MIN_WIDTH, 57, 80, 200])
def test_one_row_per_rank_and_the_width_is_kept(width):
    panel = schedule_panel(get_schedule("chimera", 8, 16), uniform_profile(8))
    text = render_text([panel], width)
    rows = _rank_rows(text)
    assert [row.split("|")[0].split()[1] for row in rows] == [str(r) for r in range(8)]
    assert all(len(row) == width for row in rows)
    assert all(len(line) <= width for line in text.splitlines())


def test_axis_names_the_unit_and_ticks_in_time():
    panel = schedule_panel(get_schedule("gpipe", 2, 2), uniform_profile(2, 1.0, 2.0))
    lines = render_text([panel], 9 + 90).splitlines()  # 90 slices of 0.1 units for a 9-unit step
    assert lines[-3].startswith(" " * 8 + "+") and lines[-2].startswith("[units] 0 ")
    assert lines[-2].index(" 1 ") + 1 == 8 + 10  # the tick of time 1 sits 10 slices in


def test_compare_shares_one_time_scale(bert_profile):
    gpipe = schedule_panel(get_schedule("gpipe", 4, 4), bert_profile)
    packed = curvature_panel(get_schedule("gpipe", 4, 4), bert_profile, rules_of(bert_profile))
    text = render_text([gpipe, packed], 120)
    rows = _rank_rows(text)
    assert len(rows) == 8
    drawn = len(rows[0].rstrip("|").rstrip())  # the one step ends where the cycle has run a third
    assert abs(drawn - 9 - (120 - 10) * gpipe.end / packed.end) <= 2
    kfac_rows = "".join(rows[4:])
    assert all(symbol in kfac_rows for symbol in "+*<>=")
    assert any(line.startswith("step") and "|1" in line for line in text.splitlines())


def test_width_comes_from_the_terminal(monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "50")
    assert main(["viz", "--schedule", "1f1b", "-D", "4", "-N", "8", "-o", "-"]) == 0
    rows = _rank_rows(capsys.readouterr().out)
    assert len(rows) == 4 and all(len(row) == 50 for row in rows)


def test_too_narrow_exits_2(capsys):
    assert main(["viz", "--schedule", "1f1b", "-D", "4", "-N", "8", "-o", "-", "--width", "10"]) == 2
    err = capsys.readouterr().err
    assert "at least" in err and err.count("\n") == 1


def test_step_ends_show_after_the_last_op():
    base = uniform_profile(2)
    profile = replace(base, stages=tuple(replace(s, step_end=2.0) for s in base.stages))
    text = render_text([schedule_panel(get_schedule("gpipe", 2, 4), profile)], width=len("rank 0 ||") + 17)
    rows = _rank_rows(text)
    # GPipe D=2 N=4, F=1, B=2: rank 0 ends at 15, rank 1 at 13; then 2 units of step end each.
    assert rows[0].endswith("~~|") and rows[1].endswith("~~..|")
    assert "~ end of step (all-reduce, optimizer)" in " ".join(text.split())
