import time
from dataclasses import replace
import xml.etree.ElementTree as ET

import pytest

from pipefisher.core.profile import uniform_profile
from pipefisher.schedules import get_schedule
from pipefisher.viz.figure import render_figure
from pipefisher.viz.layout import curvature_panel, schedule_panel
from builders import rules_of

SVG = "{http://www.w3.org/2000/svg}"


def _groups(path):
    """SVG group id -> number of <path> elements in it."""
    root = ET.parse(path).getroot()
    return {g.get("id"): len(g.findall(f".//{SVG}path")) for g in root.iter(f"{SVG}g") if g.get("id")}


def _ops_drawn(groups, panel):
    return sum(n for gid, n in groups.items() if gid.startswith(f"ops{panel}-"))


def _texts(path):
    return [t.text or "" for t in ET.parse(path).getroot().iter(f"{SVG}text")]


def _labels(path, panel):
    """Texts of the box labels of `panel`."""
    root = ET.parse(path).getroot()
    return [
        t.text
        for g in root.iter(f"{SVG}g")
        if (g.get("id") or "").startswith(f"label{panel}-")
        for t in g.iter(f"{SVG}text")
    ]


def test_svg_has_one_shape_per_op_and_per_bubble(tmp_path):
    panel = schedule_panel(get_schedule("1f1b", 4, 6), uniform_profile(4))
    path = tmp_path / "f.svg"
    render_figure([panel], path)
    groups = _groups(path)
    assert groups["ops0-forward"] == groups["ops0-backward"] == 24
    assert _ops_drawn(groups, 0) == len(panel.boxes)
    assert groups["bubbles0"] == len(panel.bubbles) > 0
    assert sorted(_labels(path, 0)) == sorted(str(b.op.micro_batch) for b in panel.boxes)  # every box labelled
    texts = _texts(path)
    assert panel.title in texts and "time [units]" in texts and "bubble (idle)" in texts


def test_kfac_and_compare_panels_each_get_their_ops_and_step_marks(tmp_path, bert_profile):
    schedule = get_schedule("chimera", 4, 4)
    panels = [schedule_panel(schedule, bert_profile), curvature_panel(schedule, bert_profile, rules_of(bert_profile))]
    path = tmp_path / "c.svg"
    render_figure(panels, path)
    groups = _groups(path)
    assert _ops_drawn(groups, 0) == len(panels[0].boxes)
    assert _ops_drawn(groups, 1) == len(panels[1].boxes)
    assert groups["ops1-sync-launch"] == sum(b.category == "sync" for b in panels[1].boxes) > 0
    for category in ("curvature-0", "curvature-1", "refresh-0", "refresh-1", "precondition"):
        assert groups[f"ops1-{category}"] > 0
    texts = _texts(path)
    assert [t for t in texts if t.startswith(" step ")] == [f" step {j}" for j in panels[1].step_ids]
    assert "lighter: pipe 1 / later chunk" in texts


def test_large_case_drops_labels_and_renders_fast(tmp_path):
    panel = schedule_panel(get_schedule("1f1b", 32, 128), uniform_profile(32))
    for suffix in (".svg", ".png"):
        path = tmp_path / f"big{suffix}"
        started = time.perf_counter()
        render_figure([panel], path)
        assert time.perf_counter() - started < 5.0
    assert _ops_drawn(_groups(tmp_path / "big.svg"), 0) == 32 * 256
    assert not _labels(tmp_path / "big.svg", 0)
    assert (tmp_path / "big.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_labels_name_the_pipe_where_they_fit(tmp_path):
    path = tmp_path / "chimera.svg"
    render_figure([schedule_panel(get_schedule("chimera", 4, 4), uniform_profile(4))], path)
    labels = _labels(path, 0)
    assert {"p0:0", "p1:2"} <= set(labels) and len(labels) == 32


def test_step_ends_are_drawn_after_each_ranks_last_op(tmp_path):
    base = uniform_profile(4)
    profile = replace(base, stages=tuple(replace(s, step_end=1.5) for s in base.stages))
    panel = schedule_panel(get_schedule("gpipe", 4, 4), profile)
    assert [(e.rank, e.start, e.end) for e in panel.step_ends] == [
        (0, 21.0, 22.5),
        (1, 19.0, 20.5),
        (2, 17.0, 18.5),
        (3, 15.0, 16.5),
    ]
    for rank in range(4):  # boxes, bubbles and step ends tile the rank's row without overlap
        pieces = sorted(
            (s.start, s.end) for kind in (panel.boxes, panel.bubbles, panel.step_ends) for s in kind if s.rank == rank
        )
        assert pieces[0][0] == 0 and pieces[-1][1] == panel.end == 22.5
        assert all(a[1] == pytest.approx(b[0]) for a, b in zip(pieces, pieces[1:]))
    path = tmp_path / "f.svg"
    render_figure([panel], path)
    assert _groups(path)["step-ends0"] == 4
    assert "end of step (all-reduce, optimizer)" in _texts(path)
