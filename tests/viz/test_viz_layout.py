import pytest

from pipefisher.core.ir import OpKind
from pipefisher.core.profile import ProfileError, uniform_profile
from pipefisher.planning.packing.pack import pack
from pipefisher.planning.simulate import simulate
from pipefisher.schedules import get_schedule
from pipefisher.viz.layout import curvature_panel, schedule_panel
from builders import rules_of


def _overlaps(boxes):
    """Pairs of boxes of one rank that run at the same time (zero-length launches excluded)."""
    by_rank = {}
    for box in boxes:
        if box.end > box.start:
            by_rank.setdefault(box.rank, []).append(box)
    clashes = []
    for row in by_rank.values():
        row.sort(key=lambda b: b.start)
        clashes += [(a, b) for a, b in zip(row, row[1:]) if b.start < a.end - 1e-9]
    return clashes


def test_schedule_panel_has_one_box_per_op_at_simulated_times():
    schedule = get_schedule("1f1b", 4, 6)
    profile = uniform_profile(4, 1.0, 2.0)
    panel = schedule_panel(schedule, profile)
    timeline = simulate(schedule, profile)
    assert len(panel.boxes) == sum(len(ops) for ops in schedule.ranks)
    expected = {(r, str(iv.op), iv.start, iv.end) for r, ivs in enumerate(timeline.ranks) for iv in ivs}
    assert {(b.rank, str(b.op), b.start, b.end) for b in panel.boxes} == expected
    assert panel.end == timeline.step_time == 27
    assert sum(b.end - b.start for b in panel.bubbles) == pytest.approx(timeline.bubble_fraction * 27 * 4)
    assert panel.title == "1f1b: D=4, N=6; step 27 units; bubble 33.3 %"


def test_labels_name_pipe_for_chimera_and_chunk_for_interleaved():
    chimera = schedule_panel(get_schedule("chimera", 4, 4), uniform_profile(4))
    labels = {(b.op.pipe, b.label, b.variant) for b in chimera.boxes if b.op.kind is OpKind.FORWARD and b.op.stage == 0}
    assert labels == {(0, "p0:0", 0), (0, "p0:1", 0), (1, "p1:2", 1), (1, "p1:3", 1)}
    interleaved = schedule_panel(get_schedule("interleaved", 2, 4, chunks=2), uniform_profile(4, 0.5, 1.0))
    second_chunk = [b for b in interleaved.boxes if b.op.stage >= 2]
    assert second_chunk and all(b.variant == 1 and b.label.startswith("c1:") for b in second_chunk)
    assert "v=2" in interleaved.title


def test_kfac_panel_lays_the_cycle_end_to_end_with_kfac_in_the_bubbles(bert_profile):
    schedule = get_schedule("gpipe", 4, 4)
    panel = curvature_panel(schedule, bert_profile, rules_of(bert_profile))
    result = pack(schedule, bert_profile, rules_of(bert_profile))
    k = result.refresh_steps
    assert panel.step_ids == tuple(range(k)) and panel.refresh_steps == k > 1
    assert panel.step_starts[1] == pytest.approx(result.timelines[0].step_time)
    assert panel.end == pytest.approx(sum(t.step_time for t in result.timelines))
    assert len(panel.boxes) == sum(len(ivs) for t in result.timelines for ivs in t.ranks)
    assert {b.category for b in panel.boxes} >= {"curvature-0", "curvature-1", "refresh-0", "refresh-1", "precondition"}
    assert not _overlaps(panel.boxes)
    for step, start in zip(panel.step_ids, panel.step_starts):  # every step's boxes lie inside it
        boxes = [b for b in panel.boxes if b.step == step]
        assert min(b.start for b in boxes) >= start - 1e-9
    assert "refresh every" in panel.title and "bubble utilisation" in panel.title


def test_kfac_panel_needs_kfac_layers():
    with pytest.raises(ProfileError, match="layers"):
        curvature_panel(get_schedule("gpipe", 2, 2), uniform_profile(2), rules_of(uniform_profile(2)))


def test_a_fold_is_drawn_and_named_apart_from_the_precondition_and_a_help_with_it():
    """SOAP's U op (the statistics fold) has its own colour class and legend, while its P op (the
    rotation in) and help ops share the precondition's, in the plan's picture and the trace's."""
    from pipefisher.core.ir import Op
    from pipefisher.methods.registry import task_rules
    from pipefisher.viz import action_figure
    from pipefisher.viz.layout import category, category_names

    fold, precondition = Op(OpKind.FOLD, 0, None, 0), Op(OpKind.PRECONDITION, 0, None, 0)
    help_op = Op(OpKind.HELP, 0, None, 0, "l0.0")
    assert (category(fold), category(precondition), category(help_op)) == ("fold", "precondition", "precondition")
    names = category_names(task_rules("soap").labels)
    assert (names["fold"], names["precondition"]) == ("statistics fold", "rotation in")
    assert [action_figure.category(str(op))[0] for op in (fold, precondition, help_op)] == [
        "fold",
        "precondition",
        "precondition",
    ]
