"""`pipefisher viz --compare`: the table equals the simulator's and packer's numbers, weight
gradients (W) and V-shape chunks are drawn in every output, bad entries exit 2 with one line."""

import argparse
import json
import subprocess
from itertools import groupby
import xml.etree.ElementTree as ET

import pytest

from pipefisher.cli.args import build_pipeline
from pipefisher.cli.main import main
from pipefisher.core.ir import OpKind
from pipefisher.core.profile import load_profile
from pipefisher.planning.packing.pack import pack
from pipefisher.planning.simulate import simulate
from pipefisher.planning.transformer_profile import BlockTimes, transformer_profile
from pipefisher.schedules import SCHEDULES, get_schedule
from pipefisher.viz.compare import Entry, compare, cycle_bubble_fraction, parse_entries
from pipefisher.viz.layout import first_steps, schedule_panel
from pipefisher.viz.stage_split import fit_stages
from pipefisher.viz.text import render_text
from builders import rules_of

SVG = "{http://www.w3.org/2000/svg}"
ENTRIES = "1f1b,zb-h1,zbv,1f1b+kfac,zb-h1+kfac"


def _compare_json(tmp_path, capsys, entries, *extra):
    assert main(["viz", "--compare", entries, *extra, "-o", str(tmp_path / "c.svg"), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_table_equals_simulate_and_pack(tmp_path, capsys, bert_profile_path):
    data = _compare_json(tmp_path, capsys, ENTRIES, "-D", "4", "-N", "8", "--profile", str(bert_profile_path))
    profile = load_profile(bert_profile_path)
    assert (data["stages"], data["micro_batches"], data["time_unit"]) == (4, 8, "ms")
    assert [row["entry"] for row in data["entries"]] == ENTRIES.split(",")
    for row in data["entries"]:
        schedule = get_schedule(row["schedule"], 4, 8)
        fitted = fit_stages(profile, schedule.num_stages)
        first_order = simulate(schedule, fitted)
        assert row["first_order_step_time"] == pytest.approx(first_order.step_time, rel=1e-12)
        if not row["packed"]:
            assert row["step_time"] == pytest.approx(first_order.step_time, rel=1e-12)
            assert row["bubble_fraction"] == pytest.approx(first_order.bubble_fraction, rel=1e-12)
            assert row["refresh_steps"] is None and row["overhead"] == 0
            continue
        result = pack(schedule, fitted, rules_of(fitted))
        assert result.first_order_step_time == pytest.approx(first_order.step_time, rel=1e-12)
        assert row["refresh_steps"] == result.refresh_steps
        assert row["step_time"] == pytest.approx(result.step_time, rel=1e-12)
        assert row["overhead"] == pytest.approx(result.step_time / first_order.step_time - 1, rel=1e-9)
        assert row["bubble_fraction"] == pytest.approx(cycle_bubble_fraction(result.timelines), rel=1e-12)


def test_text_table_shows_the_same_rows(tmp_path, capsys, bert_profile_path):
    args = ["viz", "--compare", "1f1b,1f1b+kfac", "-D", "4", "-N", "8", "--profile", str(bert_profile_path)]
    rows = {r["entry"]: r for r in _compare_json(tmp_path, capsys, "1f1b,1f1b+kfac", *args[3:])["entries"]}
    assert main([*args, "-o", str(tmp_path / "c.txt")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].startswith(f"profile {bert_profile_path}; D=4, N=8")
    assert lines[2].split() == ["entry", "bubble", "[%]", "k", "[steps]", "step", "[ms]", "overhead", "[%]"]
    for line in lines[3:]:
        entry, bubble, k, step, overhead = line.split()
        row = rows[entry]
        assert bubble == f"{100 * row['bubble_fraction']:.1f}" and step == f"{row['step_time']:.4g}"
        assert k == ("-" if row["refresh_steps"] is None else str(row["refresh_steps"]))
        assert overhead == f"{100 * row['overhead']:.2f}"


def test_a_d_stage_profile_is_cut_into_chunks_as_transformer_profile_cuts_the_model():
    times = BlockTimes(time_f=1.5, time_b=2.5, time_kron=3.0, time_inv=40.0, time_prec=2.0)
    four = transformer_profile(times, 12, 4, 768, 3072, 32)
    eight = fit_stages(four, 8)
    direct = transformer_profile(times, 12, 8, 768, 3072, 32)
    for got, want in zip(eight.stages, direct.stages, strict=True):
        assert (got.forward, got.backward) == pytest.approx((want.forward, want.backward))
        assert got.layers == want.layers
    assert fit_stages(four, 4) is four


def test_interleaved_and_v_shape_entries_use_one_d_stage_profile(bert_profile):
    schedules = ["interleaved", "zbv", "dualpipev"]
    rows = compare([Entry(name) for name in schedules], 4, 8, bert_profile)
    for name, row in zip(schedules, rows):
        schedule = get_schedule(name, 4, 8)
        assert row.step_time == pytest.approx(
            simulate(schedule, fit_stages(bert_profile, schedule.num_stages)).step_time
        )


def test_weight_gradients_are_drawn_in_the_figure_text_and_trace(tmp_path, bert_profile):
    schedule = get_schedule("zb-h1", 4, 8)
    weights = sum(op.kind is OpKind.WEIGHT for ops in schedule.ranks for op in ops)
    panel = schedule_panel(schedule, bert_profile)
    assert weights > 0 and sum(b.category == "weight" for b in panel.boxes) == weights
    from pipefisher.viz.chrome import chrome_trace
    from pipefisher.viz.figure import render_figure

    path = tmp_path / "w.svg"
    render_figure([panel], path)
    root = ET.parse(path).getroot()
    group = next(g for g in root.iter(f"{SVG}g") if g.get("id") == "ops0-weight")
    assert len(group.findall(f".//{SVG}path")) == weights
    assert "weight gradient W (split from the backward)" in [t.text for t in root.iter(f"{SVG}text")]
    events = [e for e in chrome_trace([panel])["traceEvents"] if e.get("cat") == "weight"]
    assert len(events) == weights and all("W" in e["name"] for e in events)
    text = render_text([panel], 160)
    assert all("w" in line for line in text.splitlines() if line.startswith("rank "))
    assert "w weight gradient W" in text


def test_v_shape_draws_both_chunks_on_their_ranks(bert_profile):
    schedule = get_schedule("zbv", 4, 8)
    panel = schedule_panel(schedule, fit_stages(bert_profile, 8))
    assert panel.title.startswith("zbv: D=4, N=8, v=2;")
    for box in panel.boxes:
        assert box.rank == schedule.rank_of(box.op)
        assert box.variant == box.op.stage // 4 and box.label == f"c{box.variant}:{box.op.micro_batch}"
    last = next(line for line in render_text([panel], 200).splitlines() if line.startswith("rank 3 "))
    runs = [char for char, _ in groupby(last.split("|")[1].lstrip("."))]
    assert runs[:2] == ["0", ")"]  # stage 3 (chunk 0), then stage 4 (chunk 1) of micro-batch 0
    assert {b.category for b in panel.boxes if b.variant == 1} == {"forward", "backward", "weight"}


def test_max_steps_draws_the_first_steps_of_a_cycle_and_keeps_its_numbers(
    tmp_path, capsys, bert_profile, bert_profile_path
):
    (row,) = compare([Entry("1f1b", "kfac")], 4, 8, bert_profile)
    assert len(row.panel.step_ids) == row.refresh_steps > 2
    cut = first_steps(row.panel, 2)
    assert cut.step_ids == (0, 1) and {b.step for b in cut.boxes} == {0, 1} and cut.end == row.panel.step_starts[2]
    assert cut.title == row.panel.title + "; first 2 steps drawn" and first_steps(cut, 2) is cut
    args = [
        "viz",
        "--compare",
        "1f1b+kfac",
        "-D",
        "4",
        "-N",
        "8",
        "--profile",
        str(bert_profile_path),
        "--width",
        "100",
    ]
    assert main([*args, "--max-steps", "2", "-o", "-"]) == 0
    out = capsys.readouterr().out
    assert "first 2 steps drawn" in out and "|2" not in next(
        line for line in out.splitlines() if line.startswith("step ")
    )
    assert out.splitlines()[-1].split()[:3] == ["1f1b+kfac", f"{100 * row.bubble_fraction:.1f}", str(row.refresh_steps)]


def test_without_a_profile_first_order_entries_run_on_simulates_unit_times(tmp_path, capsys):
    data = _compare_json(tmp_path, capsys, "1f1b,zb-h1,zbv,interleaved")
    assert (data["stages"], data["micro_batches"], data["time_unit"]) == (4, 8, "units")
    assert data["profile"] == "unit times (forward 1, backward 2 per stage)"
    for row in data["entries"]:
        # what `pipefisher simulate --schedule S -D 4 -N 8` simulates: unit times, split per chunk
        pipeline = argparse.Namespace(schedule=row["schedule"], stages=4, micro_batches=8, chunks=None, profile=None)
        timeline = simulate(*build_pipeline(pipeline))
        assert row["step_time"] == pytest.approx(timeline.step_time, rel=1e-12)
        assert row["bubble_fraction"] == pytest.approx(timeline.bubble_fraction, rel=1e-12)
    assert data["entries"][0]["step_time"] == pytest.approx(3 * (8 + 4 - 1))  # 1F1B: (N+D-1)(F+B)


def test_without_a_profile_compare_runs_in_a_fresh_process_anywhere(tmp_path):
    result = subprocess.run(
        ["pipefisher", "viz", "--compare", "1f1b,zb-h1", "-D", "4", "-N", "8", "-o", "c.txt"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[1] == "profile unit times (forward 1, backward 2 per stage); D=4, N=8"
    assert lines[3].split() == ["1f1b", "27.3", "-", "33", "0.00"] and (tmp_path / "c.txt").stat().st_size > 0


def test_kfac_entry_without_a_profile_exits_2_with_one_line(tmp_path):
    result = subprocess.run(
        ["pipefisher", "viz", "--compare", "1f1b,zb-h1+kfac", "-o", str(tmp_path / "x.svg")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and result.stdout == "" and result.stderr.count("\n") == 1
    assert result.stderr.startswith("pipefisher: error: zb-h1+kfac: needs --profile FILE")
    assert "python -m pipefisher.cli.bert_profile " in result.stderr and not (tmp_path / "x.svg").exists()


def test_parse_entries_takes_every_registered_schedule():
    names = sorted(SCHEDULES)
    assert parse_entries(",".join(f"{n},{n}+kfac" for n in names)) == [
        Entry(n, m) for n in names for m in (None, "kfac")
    ]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--compare", "1f1b,zigzag"], "--compare: 'zigzag' is not a schedule S or S+M; schedules: 1f1b, "),
        (["--compare", "1f1b+foo"], "--compare: '1f1b+foo' is not a schedule S or S+M; schedules: 1f1b, "),
        (["--compare", "1f1b,,gpipe"], "--compare: '' is not a schedule"),
        (
            ["--compare", "1f1b", "-D", "8", "--profile", "PROFILE"],
            "1f1b: the profile has 4 stages; it needs 8 (one per rank)\n",
        ),
        (
            ["--compare", "zbv", "-D", "3", "--profile", "PROFILE"],
            "zbv: the profile has 4 stages; it needs 3 (one per rank) or 6 (one per model chunk)",
        ),
        (["--schedule", "1f1b", "-D", "4", "-N", "4", "--json"], "--json applies to --compare"),
    ],
)
def test_bad_entries_exit_2_with_one_line(args, message, bert_profile_path, tmp_path, capsys):
    args = [str(bert_profile_path) if a == "PROFILE" else a for a in args]
    assert main(["viz", *args, "-o", str(tmp_path / "x.svg")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pipefisher: error: ") and message in err and err.count("\n") == 1
    if "is not a schedule" in message:
        assert all(name in err for name in SCHEDULES)


def test_json_needs_a_file_for_the_chart(capsys):
    assert main(["viz", "--compare", "1f1b", "-D", "2", "-N", "2", "-o", "-", "--json"]) == 2
    assert "use it with --compare and -o FILE" in capsys.readouterr().err


def test_bad_entry_from_a_real_process_has_no_traceback(tmp_path):
    result = subprocess.run(
        ["pipefisher", "viz", "--compare", "1f1b,zb-h1+foo", "-o", str(tmp_path / "x.png")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.count("\n") == 1 and "'zb-h1+foo'" in result.stderr and "1f1b" in result.stderr
