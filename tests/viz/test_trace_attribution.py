"""`pipefisher viz --trace DIR`: the method's work per rank, hidden and exposed
(`pipefisher.viz.trace_summary.method_attribution`), on a hand-made two-rank trace."""

import json

import pytest

from pipefisher.cli.main import main
from pipefisher.core.ir import Op, OpKind
from pipefisher.viz.trace_io import load_trace
from pipefisher.viz.trace_summary import method_attribution

F0, B0, F1, B1 = (
    Op(OpKind.FORWARD, 0, 0),
    Op(OpKind.BACKWARD, 0, 0),
    Op(OpKind.FORWARD, 1, 0),
    Op(OpKind.BACKWARD, 1, 0),
)
CURVATURE = Op(OpKind.CURVATURE, 1, 0, layer="l1", part=1)


def _event(name, start_ms, end_ms):
    return {"ph": "X", "cat": "user_annotation", "name": name, "ts": 1000 * start_ms, "dur": 1000 * (end_ms - start_ms)}


def _write_trace(folder, ranks):
    """One traced step (step 3, 8 ms) of `ranks`: per rank, (op, start ms, end ms)."""
    for rank, ops in enumerate(ranks):
        events = [_event("step 3", 0, 8)] + [_event(str(op), start, end) for op, start, end in ops]
        (folder / f"rank{rank}.json").write_text(json.dumps({"traceEvents": events}))


@pytest.fixture
def traced(tmp_path):
    # one micro-batch on 2 stages, F 1 ms, B 2 ms: the first-order step ends at 6 ms. Rank 0
    # preconditions for 0.5 ms after its backward, which ends the step: all exposed. Rank 1 runs
    # 2.5 ms of method work after its backward at 4 ms: it ends at 6.5, 0.5 ms after the
    # first-order step; the 2 ms before fill its bubble.
    _write_trace(
        tmp_path,
        [
            [(F0, 0.2, 1.2), (B0, 4.4, 6.4), (Op(OpKind.PRECONDITION, 0), 6.4, 6.9)],
            [(F1, 1.2, 2.2), (B1, 2.2, 4.2), (CURVATURE, 4.2, 5.2), (Op(OpKind.PRECONDITION, 1), 5.2, 6.7)],
        ],
    )
    return tmp_path


def test_method_work_splits_into_hidden_and_exposed(traced):
    shares = method_attribution(load_trace(traced))
    assert sorted(shares) == [(0, 3), (1, 3)]
    rank0, rank1 = shares[(0, 3)], shares[(1, 3)]
    assert (rank0.method, rank0.hidden, rank0.exposed) == pytest.approx((0.5, 0.0, 0.5))
    assert (rank1.method, rank1.hidden, rank1.exposed) == pytest.approx((2.5, 2.0, 0.5))
    for share in shares.values():  # the attribution sums to the method ops' time in the trace
        assert share.hidden + share.exposed == pytest.approx(share.method)


def test_a_trace_without_method_ops_has_no_attribution(tmp_path, capsys):
    _write_trace(tmp_path, [[(F0, 0, 1), (B0, 4, 6)], [(F1, 1, 2), (B1, 2, 4)]])
    assert method_attribution(load_trace(tmp_path)) == {}
    assert main(["viz", "--trace", str(tmp_path), "-o", "-", "--width", "80"]) == 0
    assert "method work" not in capsys.readouterr().out


def test_viz_prints_the_attribution_per_rank(traced, capsys):
    assert main(["viz", "--trace", str(traced), "-o", "-", "--width", "80"]) == 0
    out = capsys.readouterr().out
    assert "rank 0 step 3: 8.0 ms\n" in out
    assert "  method work 0.5 ms (6.2 % of the step): hidden 0.0 ms, exposed 0.5 ms (6.2 % of the step)" in out
    assert "  method work 2.5 ms (31.2 % of the step): hidden 2.0 ms, exposed 0.5 ms (6.2 % of the step)" in out
