"""Each method names its own work: its declaration's `WorkLabels` (parts and their refresh work,
its per-step work), which the pack report, the viz legends and the profile's time keys follow;
no report calls every method's work "inverses (roots)"."""

import pytest

from builders import layered_profile, rules_of
from pipefisher.methods.registry import methods, task_rules
from pipefisher.planning.packing.pack import PackOptions, pack
from pipefisher.planning.packing.text import format_pack_report
from pipefisher.planning.vocabulary import TaskRules, WorkLabels
from pipefisher.schedules import get_schedule
from pipefisher.viz.layout import packed_panel
from pipefisher.viz.text import render_text

WORDS = {
    "kfac": (("A factor", "B factor"), "inverse", "preconditioning"),
    "shampoo": (("left", "right"), "root", "preconditioning"),
    "soap": (("left", "right"), "basis", "rotation in"),
    "muon": ((), "refresh", "orthogonalisation"),
}


@pytest.mark.parametrize("name", list(WORDS))
def test_the_built_in_methods_declare_their_words(name):
    labels = task_rules(name).labels
    assert (labels.parts, labels.refresh, labels.precondition) == WORDS[name]
    assert labels.method == methods()[name].label, "the declaration's label names the method in reports"
    assert list(task_rules(name).parts) == list(range(len(WORDS[name][0])))


def test_the_timed_fields_are_the_profiles_keys_by_part():
    assert task_rules("kfac").timed_fields == (
        "curvature.0",
        "curvature.1",
        "sync.0",
        "sync.1",
        "refresh.0",
        "refresh.1",
        "precondition",
    )
    assert task_rules("shampoo").timed_fields == ("sync.0", "refresh.0", "refresh.1", "precondition")
    assert task_rules("muon").timed_fields == ("precondition",)
    assert task_rules("soap").timed_fields == ("refresh.0", "refresh.1", "precondition", "fold")
    assert task_rules("soap").labels.fold == "statistics fold", "the U op's work, in the FLOP/s report"


def test_labels_read_as_the_method_says():
    labels = WorkLabels(parts=("left", "right"), refresh="basis")
    assert (labels.part_work(1), labels.refreshes) == ("right basis", "bases")
    assert WorkLabels(parts=(), refresh="inverse").refreshes == "inverses"
    with pytest.raises(ValueError, match="more than 2 parts"):
        TaskRules(curvature=False, syncs=(), sync_of=(), precondition=False, labels=WorkLabels(parts=("a", "b", "c")))


@pytest.mark.parametrize("name, refresh", [("kfac", "inverse"), ("shampoo", "root"), ("soap", "basis")])
def test_the_pack_report_and_the_legend_name_the_methods_work(name, refresh):
    schedule = get_schedule("1f1b", 2, 4)
    profile = layered_profile(2, method=name, curvature=0.05 if name == "kfac" else 0.0)
    result = pack(schedule, profile, rules_of(profile), PackOptions(split=False))
    report = format_pack_report(result)
    assert f"no {refresh} splitting" in report and f"{methods()[name].label} task times" in report
    assert "inverses (roots)" not in report
    legend = render_text([packed_panel(schedule, result)], width=120)
    parts = WORDS[name][0]
    assert f"{parts[0]} {refresh}" in legend and f"{parts[1]} {refresh}" in legend


def test_muons_per_step_work_is_its_orthogonalisation():
    schedule = get_schedule("1f1b", 2, 4)
    profile = layered_profile(2, method="muon", curvature=0.0, inverse=0.0, precondition=0.5)
    result = pack(schedule, profile, rules_of(profile))
    assert "orthogonalisation/step" in format_pack_report(result)
    assert "orthogonalisation" in render_text([packed_panel(schedule, result)], width=120)
