import json

import pytest

from pipefisher.cli.main import main
from pipefisher.core.ir import Op
from pipefisher.core.profile import load_profile


def _trace(tmp_path, *args):
    out = tmp_path / "trace.json"
    assert main(["viz", *args, "-o", str(out)]) == 0
    return json.loads(out.read_text())


def test_one_complete_event_per_op_with_durations_in_microseconds(tmp_path):
    trace = _trace(tmp_path, "--schedule", "1f1b", "-D", "4", "-N", "8")
    ops = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(ops) == 4 * 16
    assert len({(e["tid"], e["name"]) for e in ops}) == len(ops)
    for event in ops:
        op = Op.parse(event["name"])
        assert event["pid"] == 0 and event["tid"] == op.stage  # 1F1B: stage s on rank s
        assert event["dur"] == pytest.approx(1000.0 if op.kind.value == "F" else 2000.0)  # units as ms
        assert event["args"]["kind"] == op.kind.name and event["args"]["micro_batch"] == op.micro_batch
    assert max(e["ts"] + e["dur"] for e in ops) == pytest.approx(33 * 1000.0)
    names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert names == {r: f"rank {r}" for r in range(4)}
    assert trace["otherData"]["time_unit"] == "units"


def test_kfac_cycle_and_compare_give_one_process_per_schedule(tmp_path, bert_profile_path):
    trace = _trace(tmp_path, "--compare", "gpipe,gpipe+kfac", "-D", "4", "-N", "4", "--profile", str(bert_profile_path))
    events = trace["traceEvents"]
    processes = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert processes[0].startswith("gpipe:") and processes[1].startswith("gpipe + PipeFisher:")
    steps = [e for e in events if e["ph"] == "i" and e["pid"] == 1]
    assert len(steps) >= 2 and steps[0]["ts"] == 0
    profile = load_profile(bert_profile_path)
    layers = {layer.name: layer for stage in profile.stages for layer in stage.layers}
    inverses = [
        e
        for e in events
        if e["ph"] == "X" and e["pid"] == 1 and e["args"]["kind"] == "REFRESH" and e["args"]["part"] == 0
    ]
    assert len(inverses) == len(layers)  # every layer's A is inverted once per cycle, on its own rank
    for event in inverses:
        assert event["dur"] == pytest.approx(layers[event["args"]["layer"]].time("refresh", 0) * 1000.0)
    first = [e for e in events if e["ph"] == "X" and e["pid"] == 0]
    assert len(first) == 4 * 8 and all(e["args"]["step"] == 0 for e in first)


def test_step_ends_are_complete_events(tmp_path):
    profile = tmp_path / "p.yaml"
    profile.write_text(
        "stages: [{forward: 1, backward: 2, step_end: 0.5}, {forward: 1, backward: 2, step_end: 0.25}]\n"
    )
    trace = _trace(tmp_path, "--schedule", "1f1b", "-D", "2", "-N", "4", "--profile", str(profile))
    ends = sorted((e["tid"], e["ts"], e["dur"]) for e in trace["traceEvents"] if e.get("cat") == "step_end")
    assert ends == [(0, 15000.0, 500.0), (1, 13000.0, 250.0)]
