"""The layout planner with ZeRO-2/3 (FSDP2) among its candidates: which layouts get them
(`fsdp_allowed`, `fsdp_problem`'s rules and `CurvatureMethod.shards`), the step-time cost of
FSDP2's collectives (the ring model at the data-parallel bandwidth), and the choice: ZeRO-3 where
only it fits, ZeRO-1 where memory is ample. Pure Python, fast.

The model is BERT-Base's sizes with 11 blocks, so 4 GPUs cannot split it into a pipeline (11 is
prime) and the time source gives tensor-parallel degree 1 only (as a measured profile does): the
layouts are D1 x DP4 with a choice of gradient path."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from pipefisher.cli.main import main
from pipefisher.config import RunSettings, load_config
from pipefisher.core.settings import ConfigError
from pipefisher.core.stage_split import balanced_counts
from pipefisher.methods.registry import methods
from pipefisher.planning.comm.volume import ring_bytes
from pipefisher.planning.planner.candidates import Layout, SearchSpace, enumerate_layouts, fsdp_allowed
from pipefisher.planning.planner.layout_memory import stage_parameters
from pipefisher.planning.planner.model_sizes import model_sizes
from pipefisher.planning.planner.predict import PlanContext, first_order_time, layout_profile, predict, step_end_time
from pipefisher.planning.planner.search import GiB, search
from pipefisher.planning.planner.sources import ReferenceTimes

ROOT = Path(__file__).resolve().parents[1]
BASE_RUN = ROOT / "schedules" / "bert-base-1f1b-4x4.yaml"
REFERENCE_CSV = ROOT / "profiles" / "reference" / "bert-base_time_memory_p100.csv"
BLOCKS = 11
GLOBAL_BATCH = 256
MICRO_BATCH = 16


def _context(rule: str = "adamw") -> PlanContext:
    sizes = model_sizes(load_config(BASE_RUN))
    sizes = replace(sizes, shape=replace(sizes.shape, blocks=BLOCKS))
    return PlanContext(sizes, ReferenceTimes.open(REFERENCE_CSV, sizes), rule)


def _space(**changes) -> SearchSpace:
    """D1 x DP4 at one micro-batch size, 1F1B, no recomputation, an fp32 run's settings."""
    space = SearchSpace(
        4, GLOBAL_BATCH, (MICRO_BATCH,), (1,), schedules=("1f1b",), recompute=("none",), run=RunSettings()
    )
    return replace(space, **changes)


def _layout(zero: int, method: str = "adamw") -> Layout:
    return Layout(1, 4, 1, "1f1b", 1, GLOBAL_BATCH // (4 * MICRO_BATCH), MICRO_BATCH, zero=zero, method=method)


def test_sharded_candidates_only_where_fsdp2_runs_the_layout():
    context = _context()
    paths = {(layout.zero, layout.powersgd_rank) for layout in enumerate_layouts(_space(), context.sizes, "adamw")}
    assert paths == {(0, 0), (1, 0), (2, 0), (3, 0)}
    assert {layout.zero for layout in enumerate_layouts(_space(run=None), context.sizes, "adamw")} == {0, 1}
    assert {layout.zero for layout in enumerate_layouts(_space(), context.sizes, "lamb")} == {0, 1}
    bf16 = _space(run=RunSettings(precision="bf16"))
    assert {layout.zero for layout in enumerate_layouts(bf16, context.sizes, "adamw")} == {0, 1, 2, 3}
    fp16 = _space(run=RunSettings(precision="fp16"))
    assert {layout.zero for layout in enumerate_layouts(fp16, context.sizes, "adamw")} == {0, 1}
    # a curvature method gets them exactly when its declaration says it shards
    for name, method in methods().items():
        zeros = {layout.zero for layout in enumerate_layouts(_space(), context.sizes, "adamw", planned=name)}
        assert zeros == ({0, 1, 2, 3} if method.shards else {0, 1}), name


@pytest.mark.parametrize(
    ("name", "changes", "zero1"),
    [
        ("shampoo", {}, True),
        ("kfac", {}, True),
        ("kfac", {"grad_worker_fraction": 0.5}, False),
        ("soap", {}, False),
        ("muon", {}, False),
    ],
)
def test_zero1_candidates_only_where_the_run_takes_them(name, changes, zero1, tmp_path):
    """The planner tries ZeRO-1 for a curvature method exactly where its section's
    `zero1_problem` allows it, the rule `run` checks: a layout it proposes loads as a run file."""
    context = _context()
    config = load_config(BASE_RUN)
    section = replace(config.section(name), **changes)
    layouts = enumerate_layouts(_space(), context.sizes, "adamw", planned=name, section=section)
    assert (1 in {layout.zero for layout in layouts}) == zero1
    raw = yaml.safe_load(BASE_RUN.read_text())
    raw["pipeline"].update(stages=1, data_parallel=4, micro_batches=4)
    raw["optimizer"] = {**raw.get("optimizer", {}), "name": name, "zero": 1}
    raw[name] = {**raw.get(name, {}), **changes}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(raw))
    if zero1:
        load_config(path)
    else:
        with pytest.raises(ConfigError, match="optimizer.zero|grad_worker_fraction"):
            load_config(path)


def test_fsdp_allowed_follows_the_run_file_rules():
    run = RunSettings()
    assert fsdp_allowed(_layout(0), "sgd", run)
    assert not fsdp_allowed(replace(_layout(0), data_parallel=1), "adamw", run)  # no replicas: nothing to shard
    assert fsdp_allowed(replace(_layout(0), tensor_parallel=2), "adamw", run)
    assert not fsdp_allowed(replace(_layout(0), stages=2, schedule="zb-h1", micro_batches=8), "adamw", run)
    chimera = replace(_layout(0), stages=2, schedule="chimera", micro_batches=8)
    assert fsdp_allowed(chimera, "adamw", run)  # sharded over each pipe's 4 replicas
    assert not fsdp_allowed(replace(chimera, data_parallel=1), "adamw", run)
    two_stages = replace(_layout(0), stages=2, schedule="gpipe", micro_batches=8)
    assert fsdp_allowed(two_stages, "adamw", run)
    assert not fsdp_allowed(two_stages, "adamw", run, tied=True)  # a weight the first and last stage share
    assert fsdp_allowed(_layout(0), "adamw", run, tied=True)  # on one stage the tie is within it
    assert not fsdp_allowed(_layout(0), "adamw", RunSettings(compile=True))


def test_a_tied_model_gets_sharded_candidates_on_one_stage_only():
    bert = _context().sizes
    assert bert.tied  # pipefisher's BERT ties its decoder to the word embedding
    space = replace(_space(), gpus=8)
    even = replace(bert, shape=replace(bert.shape, blocks=12))  # 12 blocks: 1, 2 or 4 stages on 8 GPUs
    layouts = enumerate_layouts(space, even, "adamw")
    assert {layout.stages for layout in layouts} == {1, 2, 4}
    assert {layout.stages for layout in layouts if layout.zero > 1} == {1}
    untied = replace(even, tied=False)
    assert {layout.stages for layout in enumerate_layouts(space, untied, "adamw") if layout.zero > 1} == {1, 2, 4}
    # 10 blocks on 4 stages (no even split): the balanced split is sharded as an even one is, but
    # not where the model is tied
    ten = replace(untied, shape=replace(untied.shape, blocks=10))

    def balance(layout):
        return () if 10 % layout.pieces == 0 else balanced_counts([1.0] * 10, layout.pieces)

    sharded = [layout for layout in enumerate_layouts(space, ten, "adamw", balance=balance) if layout.zero > 1]
    assert {(layout.stages, layout.stage_blocks) for layout in sharded} >= {(4, (2, 2, 3, 3))}
    tied = replace(ten, tied=True)
    assert {
        layout.stages for layout in enumerate_layouts(space, tied, "adamw", balance=balance) if layout.zero > 1
    } == {1}
    tiny = model_sizes(load_config(ROOT / "schedules" / "tiny-regression.yaml"))
    assert not tiny.tied


def test_fsdp_collectives_cost_step_time_by_the_ring_model():
    context = _context()
    profiles = {zero: layout_profile(_layout(zero), context, syncs=False) for zero in (1, 2, 3)}
    scale = 1e3 / (context.dp_bandwidth_gbps * 1e9)  # ms per byte (the reference profile is in ms)
    (numel,) = stage_parameters(_layout(3), context.sizes)
    gather = ring_bytes("broadcast", 4 * numel, 4) * scale
    reduce_scatter = ring_bytes("reduce", 4 * numel, 4) * scale
    one, two, three = (profiles[zero].stages[0] for zero in (1, 2, 3))
    # ZeRO-2: a reduce-scatter and one all-gather a step, ZeRO-1's volume; no time inside the ops
    assert two.grad_reduce == pytest.approx(one.grad_reduce)
    assert (two.forward, two.backward) == (one.forward, one.backward)
    # ZeRO-3: the reduce-scatter at the end, an all-gather of the stage in every forward and backward
    assert three.grad_reduce == pytest.approx(reduce_scatter)
    assert three.forward == pytest.approx(one.forward + gather)
    assert three.backward == pytest.approx(one.backward + gather)
    steps = {zero: predict(_layout(zero), context).step_ms for zero in (1, 2, 3)}
    assert steps[2] == pytest.approx(steps[1]) and steps[3] > steps[1]


def test_the_planner_picks_zero3_where_only_it_fits_and_zero1_where_memory_is_ample():
    context = _context()
    memory = {zero: predict(_layout(zero), context).memory.total for zero in (0, 1, 2, 3)}
    assert memory[3] < min(memory[0], memory[1], memory[2])  # the premise: ZeRO-3 needs the least
    # even splits only: the 11 blocks then fit one stage alone, so the search varies the gradient path only
    tight = search(_space(), context, "adamw", (memory[3] + min(memory[1], memory[2])) // 2, uneven=False)
    assert [p.layout.zero for p in tight.ranked] == [3]
    ample = search(_space(), context, "adamw", 64 * GiB, uneven=False)
    assert ample.best.layout.zero == 1  # as fast as plain data parallelism and ZeRO-2, and the smallest of them
    assert ample.best.step_ms < predict(_layout(3), context).step_ms


def test_a_curvature_methods_gradient_path_is_chosen_with_its_step_end():
    """Shampoo on D1 x DP4: ZeRO-1 and ZeRO-2 share the first-order step and ZeRO-2 needs less
    memory, but under ZeRO-1 each owner preconditions a quarter of the matrices in its step end
    and under ZeRO-2 every replica all of them: the search keeps ZeRO-1, the faster packed step."""
    context = replace(_context(), section=load_config(BASE_RUN).section("shampoo"))
    one, two = (_layout(zero, "shampoo") for zero in (1, 2))
    assert first_order_time(one, context) == first_order_time(two, context)  # the premise
    assert predict(two, context).memory.total < predict(one, context).memory.total
    assert step_end_time(one, context) < step_end_time(two, context)
    best = search(_space(), context, "shampoo", 64 * GiB, uneven=False).best
    assert best.layout.zero == 1 and best.step_ms == predict(one, context).step_ms < predict(two, context).step_ms


def test_the_plan_command_offers_zero3(tmp_path, capsys):
    """`pipefisher plan` on an AdamW run file of the 11-block model: ZeRO-3 under a budget only it
    fits (at the smallest micro-batch size the reference times give), and the run file it writes
    loads (the run file's checks hold)."""
    bert = tmp_path / "bert-11.json"
    bert.write_text(
        json.dumps(
            {"model_type": "bert", "num_hidden_layers": BLOCKS, "hidden_size": 768, "num_attention_heads": 12}
            | {"intermediate_size": 3072, "vocab_size": 30522, "hidden_dropout_prob": 0.1}
        )
    )
    raw = yaml.safe_load(BASE_RUN.read_text())
    raw["model"] = {"kind": "bert", "config_json": str(bert), "seq_len": 128}
    raw["optimizer"] = {"name": "adamw", "lr": 0.001}
    raw["data"]["micro_batch_size"] = MICRO_BATCH
    raw["pipeline"] = {"schedule": "1f1b", "stages": 1, "data_parallel": 4, "micro_batches": 4}
    del raw["kfac"]
    run = tmp_path / "run.yaml"
    run.write_text(yaml.safe_dump(raw))
    sizes = model_sizes(load_config(run))
    context = PlanContext(sizes, ReferenceTimes.open(REFERENCE_CSV, sizes), "adamw")
    smallest = [Layout(1, 4, 1, "1f1b", 1, GLOBAL_BATCH // 4, 1, zero=zero, method="adamw") for zero in (1, 3)]
    budget = sum(predict(layout, context).memory.total for layout in smallest) / 2  # micro-batches of 1
    out = tmp_path / "best.yaml"
    argv = ["plan", str(run), "--gpus", "4", "--memory-gb", f"{budget / GiB:.4f}", "--reserve-gb", "0"]
    argv += ["--max-tensor-parallel", "1", "--even-splits"]  # 11 blocks: one stage only
    assert main([*argv, "--reference-csv", str(REFERENCE_CSV), "--json", "-o", str(out)]) == 0
    best = json.loads(capsys.readouterr().out)["ranked"][0]["layout"]
    assert (best["zero"], best["data_parallel"], best["stages"]) == (3, 4, 1)
    assert load_config(out).optimizer.zero == 3
