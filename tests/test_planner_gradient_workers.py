"""The planner models gradient workers as the run has them (K-FAC's `grad_worker_fraction` below 1,
Muon on a replicated stage): no P ops, each worker's share of the preconditioning and the
broadcast of the preconditioned gradients in the step end, and the refresh results kept on the
workers only. Before, it packed P ops of the whole stage into the bubbles, left the broadcast out
and counted every replica's inverses."""

from __future__ import annotations

import pytest

from pipefisher.config import load_config
from pipefisher.core.ir import OpKind
from pipefisher.planning.planner.candidates import Layout
from pipefisher.planning.planner.flop_times import FlopTimes
from pipefisher.planning.planner.hardware import hardware_of
from pipefisher.planning.planner.model_sizes import model_sizes
from pipefisher.planning.planner.predict import PlanContext, layout_profile, plan_layout, predict
from pipefisher.planning.planner.sources import MS_PER_UNIT
from pipefisher.planning.transformer_profile import block_layer_shapes
from tests.test_planner_hardware import BASE_RUN

BANDWIDTH_GBPS = 10.0


def _context(method: str, section_changes: dict) -> PlanContext:
    config = load_config(BASE_RUN).with_overrides(**({method: section_changes} if section_changes else {}))
    sizes = model_sizes(config)
    source = FlopTimes.check(sizes, hardware_of("h100"), "fp32", method, config.section(method))
    return PlanContext(sizes, source, "adamw", config.section(method), dp_bandwidth_gbps=BANDWIDTH_GBPS)


@pytest.mark.parametrize(
    ("method", "section_changes", "schedule", "data_parallel", "block", "bias"),
    [
        ("kfac", {"grad_worker_fraction": 0.5}, "1f1b", 2, 2, 1),  # 1 worker of 2 replicas per layer
        ("kfac", {"grad_worker_fraction": 0.5}, "1f1b", 4, 2, 1),  # 2 blocks of 2 replicas
        ("muon", {}, "chimera", 1, 2, 0),  # one worker per matrix over the two pipes' copies
    ],
)
def test_workers_share_the_preconditioning_and_broadcast_it_in_the_step_end(
    method, section_changes, schedule, data_parallel, block, bias
):
    context = _context(method, section_changes)
    sizes = context.sizes
    layout = Layout(2, data_parallel, 1, schedule, 1, 4, 8, method=method)
    assert context.workers_per_layer(layout) == data_parallel * (2 if schedule == "chimera" else 1) // block
    source = context.source.profile(2, 8, 1)
    stage = layout_profile(layout, context).stages[0]
    # stage 0 is 6 of BERT-Base's 12 blocks; its preconditioned gradients, fp32, broadcast by a
    # ring over the block's ranks: each sends (block - 1) / block of them
    elements = 6 * sum(dout * (din + bias) for _, din, dout in block_layer_shapes(sizes.hidden, sizes.ffn, 1))
    broadcast_ms = elements * 4 * (block - 1) / block / (BANDWIDTH_GBPS * 1e9) * 1e3
    share_ms = sum(layer.precondition for layer in source.stages[0].layers) / block
    per_ms = MS_PER_UNIT[source.time_unit]
    added = stage.method_step_end - source.stages[0].method_step_end
    assert added * per_ms == pytest.approx(share_ms * per_ms + broadcast_ms, rel=1e-3)
    assert stage.step_end - stage.method_step_end == pytest.approx(
        source.stages[0].step_end - source.stages[0].method_step_end
    )


def test_the_plan_has_no_p_ops_and_the_inverses_are_on_the_workers_only():
    layout = Layout(2, 2, 1, "1f1b", 1, 4, 8, method="kfac")
    workers, everyone = _context("kfac", {"grad_worker_fraction": 0.5}), _context("kfac", {})

    def p_ops(context: PlanContext) -> int:
        plan = plan_layout(layout, context)[0].plan
        return sum(op.kind is OpKind.PRECONDITION for op in plan.curvature_ops())

    assert p_ops(workers) == 0 and p_ops(everyone) > 0
    shared, whole = predict(layout, workers), predict(layout, everyone)
    assert shared.memory.state < whole.memory.state  # the captures follow the packing, k 8 against 10
    assert shared.reduce_ms == pytest.approx(whole.reduce_ms)  # the broadcasts are not the reduction's
