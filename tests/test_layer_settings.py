"""The planner's memory of a curvature method at its run-file settings (`layer_settings`): SOAP's
`fold: bubbles` holds a gradient-sized copy per matrix, `statistics_dtype: float32` halves the
statistics and their snapshot, a plan with P ops holds the rotated gradients, and a plan's help
ops hold their buffers on the helping rank (`pipefisher.planning.memory.helped`); a method
without per-micro-batch curvature tasks captures nothing (`capture_held`). Expected bytes are
counted here from BERT-Large's shapes, not from the memory models."""

from __future__ import annotations

from dataclasses import replace

import pytest
from builders import flop_context

from pipefisher.planning.memory.captures import capture_held
from pipefisher.planning.memory.helped import help_bytes_per_rank
from pipefisher.planning.packing.helpers import help_ops
from pipefisher.planning.packing.step_end import has_p_ops
from pipefisher.planning.planner.layer_models import profile_layers, step_momentum
from pipefisher.planning.planner.layout_memory import layout_memory, state_per_rank
from pipefisher.planning.planner.predict import plan_layout, predict

H, F = 1024, 4096
#: (rows, cols) of a BERT-Large block's Linear weights by the flop model's layer names
SHAPES = {
    "attention.query": (H, H),
    "attention.key": (H, H),
    "attention.value": (H, H),
    "attention.output": (H, H),
    "intermediate": (F, H),
    "output": (H, F),
}
#: the blocks of each of the 8 stages
BLOCKS = 3


def held(section: dict, p_ops: bool = False):
    found, layout = flop_context(**section)
    settings = found.layer_settings(layout, p_ops)
    return layout_memory(layout, found.sizes, "adamw", 0.0, "fp32", None, settings)


def squares(rows: int, cols: int, block: int = 1024) -> int:
    """Elements of a matrix's two factors cut into `block`-sized blocks (both sides divide here)."""
    return (rows // block) * (cols // block) * 2 * block * block if rows > block or cols > block else rows**2 + cols**2


ELEMENTS = sum(rows * cols for rows, cols in SHAPES.values())  # one block's matrices
FACTOR_ELEMENTS = sum(squares(*shape) for shape in SHAPES.values())


def test_a_stage_holds_a_gradient_sized_copy_per_matrix_with_its_statistics_folded_in_the_bubbles():
    step_end, bubbles = held({}), held({"fold": "bubbles"})
    assert bubbles.rank == step_end.rank
    assert bubbles.state - step_end.state == 4 * BLOCKS * ELEMENTS
    (plain, layout), (folding, _) = flop_context(), flop_context(fold="bubbles")
    assert predict(layout, folding).memory.state - predict(layout, plain).memory.state == 4 * BLOCKS * ELEMENTS


def test_float32_statistics_hold_half_the_statistics_and_their_snapshot():
    double, single = held({}), held({"statistics_dtype": "float32"})
    assert FACTOR_ELEMENTS == 24 * H * H
    assert double.state - single.state == 2 * (8 - 4) * BLOCKS * FACTOR_ELEMENTS


def test_p_ops_hold_each_matrixs_rotated_gradient():
    assert held({"helpers": True}, p_ops=True).state - held({"helpers": True}).state == 4 * BLOCKS * ELEMENTS


def test_blocks_of_2048_give_the_ffn_matrices_two_2048_x_2048_statistics_on_their_long_side():
    """An F x H matrix: 2 blocks of 2048 x 1024, so A is two 2048² blocks (not four 1024²) and B two
    1024² ones, 2 H² elements more than blocks of 1024; per element the statistic, its snapshot
    (float64) and the basis (float32)."""
    assert held({"block_size": 2048}).state - held({}).state == BLOCKS * 2 * (2 * H * H) * (8 + 8 + 4)


def test_a_packed_plans_memory_counts_its_help_ops_buffers_on_the_helping_rank():
    found, layout = flop_context(helpers=True)
    layout = replace(layout, refresh_steps=4)
    result, profile = plan_layout(layout, found)
    helps = help_ops(result.plan)
    assert has_p_ops(result.plan) and helps
    buffers = [0] * 8
    for rank, op in helps:  # gradient in, rotation out, and the bases of both factors
        rows, cols = SHAPES[op.layer.split(".", 1)[1]]
        buffers[rank] += 4 * (2 * rows * cols + squares(rows, cols))
    settings = found.layer_settings(layout, True)
    layers = profile_layers("soap", 1, found.sizes, profile, settings)
    assert help_bytes_per_rank(result.plan, layers) == buffers
    assert max(buffers) > 0 == buffers[0]
    states = state_per_rank(layout, found.sizes, "adamw", 0.0, None, settings)
    memory = predict(layout, found).memory  # rank 0 (the embeddings), held rotations and no help ops
    assert memory.state == states[memory.rank].total_bytes + buffers[memory.rank]


@pytest.mark.parametrize("method", ["soap", "shampoo", "muon"])
def test_a_method_without_curvature_tasks_captures_nothing_per_micro_batch(method):
    found, layout = flop_context(method)
    result, profile = plan_layout(layout, found)
    assert any(layer.capture_bytes and any(layer.capture_bytes) for layer in profile.stages[0].layers)
    assert all(not any(map(any, capture_held(result.plan, profile, rank))) for rank in range(8))
    kfac, kfac_layout = flop_context("kfac")
    kfac_plan, kfac_profile = plan_layout(kfac_layout, kfac)
    assert any(map(any, capture_held(kfac_plan.plan, kfac_profile, 0)))


@pytest.mark.parametrize("method, buffer", [("kfac", True), ("shampoo", True), ("muon", False), ("soap", False)])
def test_only_an_sgd_step_keeps_a_momentum_buffer_per_preconditioned_parameter(method, buffer):
    """K-FAC and Shampoo step with SGD at the section's momentum; `MuonStep` and `SoapStep` keep
    no state (Muon's momentum is its engine's buffer, counted with its layers)."""
    found, layout = flop_context(method)
    settings = found.layer_settings(layout, False)
    still, moving = (layout_memory(layout, found.sizes, "adamw", m, "fp32", None, settings).state for m in (0.0, 0.95))
    matrices = BLOCKS * ELEMENTS * 4  # rank 0's linear weights, fp32 (K-FAC's biases beside them)
    assert step_momentum(method, 0.95) == (0.95 if buffer else 0.0)
    assert (moving - still >= matrices) if buffer else (moving == still)
