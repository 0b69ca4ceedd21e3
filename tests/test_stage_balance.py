"""The planner's uneven stage splits (`pipeline.stage_blocks`): the balanced cut of the blocks
(`balanced_counts`, against every cut enumerated), each time source's profile at a split, the
memory model's stages, and `pipefisher plan` proposing, predicting and writing them."""

from __future__ import annotations

import itertools
import json
import random
from dataclasses import replace

import pytest

from pipefisher.cli.main import main
from pipefisher.config import load_config
from pipefisher.core.profile import load_profile
from pipefisher.core.stage_split import balanced_counts, counts_text
from pipefisher.planning.planner.candidates import Layout, layout_of_run
from pipefisher.planning.planner.flop_times import FlopTimes
from pipefisher.planning.planner.hardware import hardware_of
from pipefisher.planning.planner.layout_memory import stage_parameters
from pipefisher.planning.planner.model_sizes import model_sizes
from pipefisher.planning.planner.predict import first_order_time
from pipefisher.planning.planner.run_layout import run_layout
from pipefisher.planning.planner.sources import ReferenceTimes
from pipefisher.planning.planner.stage_balance import balanced_split, block_times
from pipefisher.planning.planner.table import run_file_of
from pipefisher.planning.transformer_profile import BlockTimes, transformer_profile
from tests.test_planner_hardware import BASE_RUN

GPT2_RUN = "schedules/gpt2-medium-chimera-8x8.yaml"
TINY_RUN = "schedules/tiny-cpu.yaml"
TINY_PROFILE = "profiles/tiny-cpu-1f1b.yaml"


def _every_cut(weights: list[float], parts: int) -> list[tuple[int, ...]]:
    """Every cut of the blocks into `parts` contiguous non-empty stages, as counts."""
    cuts = []
    for ends in itertools.combinations(range(1, len(weights)), parts - 1):
        bounds = (0, *ends, len(weights))
        cuts.append(tuple(b - a for a, b in zip(bounds, bounds[1:])))
    return cuts


def _loads(weights: list[float], counts: tuple[int, ...]) -> list[float]:
    bounds = list(itertools.accumulate(counts, initial=0))
    return [sum(weights[a:b]) for a, b in zip(bounds, bounds[1:])]


@pytest.mark.parametrize("seed", range(40))
def test_the_balanced_cut_is_the_best_of_every_cut(seed: int) -> None:
    rng = random.Random(seed)
    blocks = rng.randint(2, 9)
    parts = rng.randint(1, blocks)
    # equal blocks with a heavier first and last (embeddings, head), or any weights
    weights = [1.0] * blocks if seed % 2 else [rng.choice([0.5, 1.0, 2.0]) for _ in range(blocks)]
    weights[0] += rng.choice([0.0, 0.4])
    weights[-1] += rng.choice([0.0, 1.3, 2.4])
    cuts = _every_cut(weights, parts)
    best = min(max(_loads(weights, cut)) for cut in cuts)
    optimal = [cut for cut in cuts if max(_loads(weights, cut)) <= best + 1e-9]
    evenest = min(sum(x * x for x in _loads(weights, cut)) for cut in optimal)
    expected = min(cut for cut in optimal if sum(x * x for x in _loads(weights, cut)) <= evenest + 1e-9)
    assert balanced_counts(weights, parts) == expected


def test_equal_blocks_split_evenly_and_a_heavy_head_sheds_blocks() -> None:
    assert balanced_counts([1.0] * 12, 4) == (3, 3, 3, 3)
    assert balanced_counts([1.0] * 11 + [3.4], 4) == (3, 4, 4, 1)  # the head stage keeps one block
    assert balanced_counts([1.0] * 3 + [3.4], 2) == (3, 1)
    with pytest.raises(ValueError, match="num_stages"):
        balanced_counts([1.0] * 3, 4)


def test_a_split_is_written_in_a_few_characters() -> None:
    assert counts_text((3, 1)) == "3/1"
    assert counts_text((6, 6, 7, 5)) == "6/6/7/5"
    assert counts_text((1,) * 32 + (2,) * 32) == "1x32/2x32"
    assert counts_text((2, 1, 1, 1, 3)) == "2/1x3/3"


def test_a_profile_at_a_split_holds_each_stages_blocks_and_their_time() -> None:
    times = BlockTimes(2.0, 4.0, 1.0, 3.0, 0.5)
    even = transformer_profile(times, 4, 2, 64, 256)
    split = transformer_profile(times, 4, 2, 64, 256, stage_blocks=(3, 1))
    assert transformer_profile(times, 4, 2, 64, 256, stage_blocks=(2, 2)) == even
    assert [len(stage.layers) for stage in split.stages] == [18, 6]
    assert {layer.name.split(".")[0] for layer in split.stages[1].layers} == {"block3"}
    assert [(stage.forward, stage.backward) for stage in split.stages] == [(6.0, 12.0), (2.0, 4.0)]


def test_the_reference_times_have_no_head_so_their_balance_is_the_even_split() -> None:
    sizes = model_sizes(load_config(BASE_RUN))
    source = ReferenceTimes.open("profiles/reference/bert-base_time_memory_p100.csv", sizes)
    assert balanced_split(source, sizes.blocks, 4, 32, 1) == ()
    assert balanced_split(source, sizes.blocks, 5, 32, 1) == (2, 2, 2, 3, 3)  # 12 blocks on 5: no even split


def test_the_flop_model_moves_blocks_off_the_stage_with_the_head() -> None:
    sizes = model_sizes(load_config(GPT2_RUN))
    source = FlopTimes.check(sizes, hardware_of("h100"), "bf16", "kfac", load_config(GPT2_RUN).section("kfac"))
    counts = balanced_split(source, sizes.blocks, 4, 8, 1)
    assert sum(counts) == sizes.blocks and counts[-1] < sizes.blocks // 4
    weights = block_times(source, sizes.blocks, 8, 1)
    assert weights[-1] > 1.5 * weights[1]  # the head: the premise
    even = source.profile(4, 8, 1)
    balanced = source.profile(4, 8, 1, stage_blocks=counts)
    assert max(s.forward + s.backward for s in balanced.stages) < max(s.forward + s.backward for s in even.stages)
    # the optimizer step's bytes follow each stage's blocks
    step_ends = [stage.step_end for stage in balanced.stages]
    assert step_ends[0] / step_ends[-1] == pytest.approx(counts[0] / counts[-1])


def test_a_measured_profile_is_resplit_by_block_and_taken_as_is_at_its_own_split() -> None:
    config = load_config(TINY_RUN)
    measured = load_profile(TINY_PROFILE)
    _, context = run_layout(config, measured, TINY_PROFILE)
    split = context.source.profile(2, measured.micro_batch_size, 1, stage_blocks=(3, 1))
    assert context.source.profile(2, measured.micro_batch_size, 1, stage_blocks=(2, 2)) == measured
    held = [{layer.name.split(".")[2] for layer in stage.layers if "layer." in layer.name} for stage in split.stages]
    assert held == [{"0", "1", "2"}, {"3"}]
    total = sum(s.forward for s in measured.stages)
    assert sum(s.forward for s in split.stages) == pytest.approx(total)  # time moves, none is lost
    assert split.stages[1].forward < measured.stages[1].forward
    # measured at [3, 1], it is the source's [3, 1] profile as it is
    _, again = run_layout(config.with_overrides(pipeline={"stage_blocks": [3, 1]}), split, TINY_PROFILE)
    assert again.source.profile(2, measured.micro_batch_size, 1, stage_blocks=(3, 1)) is split


def test_a_methods_end_of_step_work_is_resplit_and_left_out_of_the_first_order_step() -> None:
    """A profile measured with Shampoo or SOAP times their preconditioning in the end of step
    (`method_step_end`): resplit by block it moves with the blocks, and the planner's first-order
    step (every layout's baseline and AdamW's own prediction) is simulated without it."""
    config = load_config(TINY_RUN)
    plain = load_profile(TINY_PROFILE)
    extra = [2.0, 5.0]  # the method's share of each stage's end of step, in the profile's unit
    stages = tuple(
        replace(stage, step_end=stage.step_end + more, method_step_end=more) for stage, more in zip(plain.stages, extra)
    )
    measured = replace(plain, stages=stages)
    _, context = run_layout(config, measured, TINY_PROFILE)
    split = context.source.profile(2, measured.micro_batch_size, 1, stage_blocks=(3, 1))
    # stage 0 takes all of the old stage 0's blocks and half of stage 1's; the last keeps the rest
    assert [stage.method_step_end for stage in split.stages] == pytest.approx([2.0 + 5.0 / 2, 5.0 / 2])
    assert all(stage.method_step_end <= stage.step_end for stage in split.stages)
    layout, _ = run_layout(config, measured, TINY_PROFILE)
    _, plain_context = run_layout(config, plain, TINY_PROFILE)
    assert first_order_time(layout, context) == pytest.approx(first_order_time(layout, plain_context))


def test_the_run_files_split_is_its_layout_and_is_predicted_faster() -> None:
    config = load_config(TINY_RUN)
    uneven = config.with_overrides(pipeline={"stage_blocks": [3, 1]})
    layout, context = run_layout(uneven, load_profile(TINY_PROFILE), TINY_PROFILE)
    assert layout.stage_blocks == (3, 1)
    even_layout = replace(layout, stage_blocks=())
    assert first_order_time(layout, context)[0] < first_order_time(even_layout, context)[0]
    # the memory model's stages hold their own blocks
    sizes = context.sizes
    assert sum(stage_parameters(layout, sizes)) == sum(stage_parameters(even_layout, sizes))
    assert stage_parameters(layout, sizes)[0] > stage_parameters(even_layout, sizes)[0]


def test_a_written_layout_carries_its_split_and_an_even_one_drops_it() -> None:
    raw = {
        "model": {"kind": "bert", "preset": "bert-4x128"},
        "data": {"kind": "bert"},
        "pipeline": {"stages": 2, "stage_blocks": [3, 1]},
    }
    layout = Layout(2, 1, 1, "1f1b", 1, 4, 8, method="adamw", stage_blocks=(1, 3))
    assert "stage_blocks:\n  - 1\n  - 3" in run_file_of(raw, layout)
    assert "stage_blocks" not in run_file_of(raw, replace(layout, stage_blocks=()))
    pipeline = load_config(TINY_RUN).with_overrides(pipeline={"stage_blocks": [1, 3]}).pipeline
    assert layout_of_run(pipeline, 8, "adamw").stage_blocks == (1, 3)


def test_plan_proposes_an_uneven_split_where_no_even_one_exists(tmp_path, capsys) -> None:
    """BERT-Base's 12 blocks on 7 GPUs (7 is prime: no tensor or data parallelism divides it at this
    batch): seven stages, split unevenly; the run file it writes loads; `--even-splits` refuses."""
    out = tmp_path / "best.yaml"
    argv = ["plan", str(BASE_RUN), "--gpus", "7", "--memory-gb", "16", "--packed", "2", "--top", "2"]
    assert main([*argv, "--json", "-o", str(out)]) == 0
    best = json.loads(capsys.readouterr().out)["ranked"][0]["layout"]
    assert best["stages"] == 7 and sum(best["stage_blocks"]) == 12
    assert load_config(out).pipeline.stage_blocks == tuple(best["stage_blocks"])
    assert main([*argv, "--even-splits"]) == 2
    assert "--gpus 7" in capsys.readouterr().err
