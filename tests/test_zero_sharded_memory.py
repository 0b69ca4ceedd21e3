"""The memory model under ZeRO-2/3 (FSDP2, `pipefisher.planning.memory.sharded`): its formulas
against a hand computation, the measured GPT-2 tiny layout (docs/zero_memory.md), the peak's
order against ZeRO-1, and the planner's memory of a ZeRO-3 run file. Pure Python, fast."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from pipefisher.cli.main import main
from pipefisher.config import load_config
from pipefisher.core.topology import Topology
from pipefisher.planning.memory.sharded import shard_elements, sharded_stage
from pipefisher.planning.memory.state import StageState, optimizer_state, rank_memory
from pipefisher.planning.planner.candidates import Layout
from pipefisher.planning.planner.layout_memory import layout_memory, state_per_rank
from pipefisher.planning.planner.model_sizes import model_sizes
from pipefisher.schedules import get_schedule

MiB = 2**20
BERT_BASE = Path(__file__).resolve().parents[1] / "schedules" / "bert-base-1f1b-4x4.yaml"

# A hand-sized stage: embedding (6, 4); blocks of 20, 30 and 10 elements; a head (5, 4) whose
# 5 rows pad to 3 per shard over 2 replicas.
SHAPES = ((6, 4), (4, 4), (4,), (6, 4), (6,), (2, 4), (2,), (5, 4))
SMALL = StageState(
    tuple(rows * (cols[0] if cols else 1) for rows, *cols in SHAPES),
    shapes=SHAPES,
    blocks=(20, 30, 10),
)


def _one_stage(data_parallel: int, micro_batches: int = 4) -> Topology:
    return Topology(get_schedule("1f1b", 1, micro_batches), data_parallel=data_parallel)


def test_shards_are_fsdp2_padded_row_chunks():
    assert shard_elements(20, (5, 4), 2) == 12  # ceil(5 / 2) = 3 rows of 4
    assert shard_elements(6, (6,), 4) == 2
    assert shard_elements(7, (), 2) == 4  # no shape: the flat tensor
    assert shard_elements(24, (6, 4), 1) == 24


def test_small_stage_matches_a_hand_computation():
    assert SMALL.numel == 104
    shards = 12 + 8 + 2 + 12 + 3 + 4 + 1 + 12  # each row count halved, rounded up, times its columns
    adamw = optimizer_state("adamw")
    for zero, gathered, per_op in ((2, 104, False), (3, 44 + 30 + 20, True)):  # ZeRO-3: the rest + 2 largest blocks
        (rank,) = rank_memory(_one_stage(2), [SMALL], adamw, zero)[:1]
        assert rank.parameter_bytes == rank.gradient_bytes == 4 * shards
        assert rank.optimizer_bytes == 8 * shards + 4 * len(SHAPES)  # two moments and a step tensor each
        assert rank.peak_parameter_bytes == 4 * shards + 4 * gathered
        assert rank.peak_gradient_bytes == 4 * 104  # the whole unreduced gradient
        assert rank.stages[0].gathered_per_op is per_op
        assert rank.total_bytes == rank.peak_parameter_bytes + rank.peak_gradient_bytes + rank.optimizer_bytes
    half = 4 * 104 // 2  # (R - 1) / R of the stage's fp32 bytes
    assert sharded_stage(SMALL.parameters, SHAPES, SMALL.blocks, 2, 2, micro_batches=4).traffic == half + half
    assert sharded_stage(SMALL.parameters, SHAPES, SMALL.blocks, 2, 3, micro_batches=4).traffic == half + 8 * half


def test_chimera_shards_over_a_pipes_replicas_and_sums_over_the_pipes():
    """2 pipes x 2 replicas: a stage's 4 copies, FSDP2 over each pipe's 2, then the shards'
    all-reduce over the 2 pipes in the traffic."""
    topology = Topology(get_schedule("chimera", 2, 4), data_parallel=2)
    two_copies = rank_memory(_one_stage(2), [SMALL], optimizer_state("sgd"), 3)[0].stages[0]
    rank = rank_memory(topology, [SMALL, SMALL], optimizer_state("sgd"), 3)[0]
    for stage in rank.stages:
        assert stage.parameter_bytes == two_copies.parameter_bytes
        assert stage.grad_comm_bytes == two_copies.grad_comm_bytes + stage.gradient_bytes  # ring all-reduce over 2


def test_without_blocks_zero3_gathers_the_whole_stage():
    whole = replace(SMALL, blocks=())
    (rank,) = rank_memory(_one_stage(2), [whole], optimizer_state("sgd"), 3)[:1]
    assert rank.peak_parameter_bytes == rank.parameter_bytes + 4 * 104


def test_an_unreplicated_stage_is_not_sharded():
    for zero in (2, 3):
        assert rank_memory(_one_stage(1), [SMALL], optimizer_state("adamw"), zero) == rank_memory(
            _one_stage(1), [SMALL], optimizer_state("adamw"), 0
        )


def _gpt2_tiny(vocab: int = 4000, positions: int = 256, hidden: int = 128, blocks: int = 4) -> StageState:
    """GPT-2 tiny of schedules/gpt2-tiny-cpu.yaml on one stage, in `module.parameters()` order
    (Conv1D weights are (in, out); the LM head is the tied word embedding)."""
    h = hidden
    block = [(h,), (h,), (h, 3 * h), (3 * h,), (h, h), (h,), (h,), (h,), (h, 4 * h), (4 * h,), (4 * h, h), (h,)]
    shapes = [(vocab, h), (positions, h)] + block * blocks + [(h,), (h,)]
    sizes = [rows * (cols[0] if cols else 1) for rows, *cols in shapes]
    return StageState(tuple(sizes), shapes=tuple(shapes), blocks=(sum(sizes[2:14]),) * blocks)


def test_gpt2_tiny_at_rest_matches_the_measured_bytes_and_the_lecture_ratio():
    stage = _gpt2_tiny()
    assert stage.numel == 1_338_112  # Ψ, as experiments/zero_sharded_memory.py counts it
    adamw = optimizer_state("adamw")
    resting = {
        zero: [r.parameter_bytes + r.gradient_bytes for r in rank_memory(_one_stage(2), [stage], adamw, zero)]
        for zero in (1, 2, 3)
    }
    assert [round(b / MiB, 3) for b in resting[1]] == [10.209, 10.209]  # measured: 10.209 MiB per rank
    for zero in (2, 3):
        assert [round(b / MiB, 3) for b in resting[zero]] == [5.104, 5.104]  # measured: 5.104 MiB
        assert [b / a for a, b in zip(resting[1], resting[zero])] == [0.5, 0.5]  # 1 / N_d


@pytest.mark.parametrize("replicas", [2, 4])
def test_in_step_peaks_order_against_zero1(replicas):
    stage = _gpt2_tiny()
    adamw = optimizer_state("adamw")
    ranks = {zero: rank_memory(_one_stage(replicas), [stage], adamw, zero)[0] for zero in (1, 2, 3)}
    one, two, three = ranks[1], ranks[2], ranks[3]
    for sharded in (two, three):  # the whole gradient accumulates before the one reduce-scatter
        assert sharded.peak_gradient_bytes == one.gradient_bytes
        assert sharded.optimizer_bytes <= adamw.tensor_bytes(stage.numel) // replicas + 4 * len(stage.parameters)
    # ZeRO-2 holds the whole parameters plus its shard: above ZeRO-1 by the shard, less the state it saves
    assert two.peak_parameter_bytes == one.parameter_bytes + two.parameter_bytes
    assert two.total_bytes - one.total_bytes == two.parameter_bytes + two.optimizer_bytes - one.optimizer_bytes
    # ZeRO-3 gathers the rest of the stage and two of its four blocks at once
    block = 4 * stage.blocks[0]
    assert three.peak_parameter_bytes == one.parameter_bytes - 2 * block + three.parameter_bytes
    assert three.total_bytes < two.total_bytes


def test_zero3_gathers_only_the_largest_op_of_a_rank_with_two_stages():
    stage = _gpt2_tiny(blocks=2)
    topology = Topology(get_schedule("interleaved", 1, 4, 2), data_parallel=2)
    rank = rank_memory(topology, [stage, stage], optimizer_state("sgd"), 3)[0]
    assert len(rank.stages) == 2
    gathered = rank.stages[0].gathered_bytes
    assert rank.peak_parameter_bytes == rank.parameter_bytes + gathered  # one op at a time
    held = rank_memory(topology, [stage, stage], optimizer_state("sgd"), 2)[0]
    assert held.peak_parameter_bytes == held.parameter_bytes + 2 * 4 * stage.numel  # held through the step


def test_the_planner_counts_zero3_of_a_run_file():
    sizes = model_sizes(load_config(BERT_BASE))
    layout = Layout(4, 2, 1, "1f1b", 1, 8, 8, zero=1, method="adamw")
    one = state_per_rank(layout, sizes, "adamw", 0.0)
    three = state_per_rank(replace(layout, zero=3), sizes, "adamw", 0.0)
    for a, b in zip(one, three):
        assert b.parameter_bytes + b.gradient_bytes < a.parameter_bytes + a.gradient_bytes
        assert b.peak_gradient_bytes == a.gradient_bytes
    use = layout_memory(replace(layout, zero=3), sizes, "adamw", 0.0)
    assert use.state == three[use.rank].total_bytes  # the peak: gathered parameters, unreduced gradient


def test_plan_reports_a_zero3_run_file_layout(tmp_path, capsys):
    raw = yaml.safe_load(BERT_BASE.read_text())
    found = {}
    for zero in (1, 3):
        raw["optimizer"] = {**raw["optimizer"], "name": "adamw", "zero": zero}
        raw["pipeline"]["data_parallel"] = 2
        path = tmp_path / f"zero{zero}.yaml"
        path.write_text(yaml.safe_dump(raw))
        assert (
            main(["plan", str(path), "--gpus", "8", "--memory-gb", "16", "--packed", "1", "--top", "1", "--json"]) == 0
        )
        found[zero] = json.loads(capsys.readouterr().out)["run_file_layout"]
    assert found[3]["layout"]["zero"] == 3 and found[1]["layout"]["zero"] == 1
    assert found[3]["memory_bytes"]["state"] != found[1]["memory_bytes"]["state"]
