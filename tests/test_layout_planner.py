"""The layout planner (`pipefisher plan`): enumeration, prediction, memory budget, run file, refusals."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from pipefisher.cli.main import main
from pipefisher.config import config_from_dict, load_config
from pipefisher.core.profile import load_profile
from pipefisher.planning.planner.candidates import Layout, SearchSpace, enumerate_layouts
from pipefisher.planning.planner.model_sizes import PlanError, model_sizes
from pipefisher.planning.planner.layout_memory import layout_memory
from pipefisher.planning.planner.predict import PlanContext, layout_profile, pack_options, predict
from pipefisher.planning.planner.search import GiB, search
from pipefisher.planning.planner.sources import ReferenceTimes, block_of, part_flops, resplit
from pipefisher.planning.planner.table import run_file_of
from pipefisher.planning.packing.pack import pack
from pipefisher.planning.plan import cycle_time, simulate_plan
from pipefisher.planning.simulate import simulate
from builders import rules_of

ROOT = Path(__file__).resolve().parents[1]
BASE_RUN = ROOT / "schedules" / "bert-base-1f1b-4x4.yaml"
REFERENCE = ROOT / "profiles" / "reference"


def _context(run: Path = BASE_RUN, name: str = "bert-base") -> tuple[PlanContext, int]:
    config = load_config(run)
    sizes = model_sizes(config)
    source = ReferenceTimes.open(REFERENCE / f"{name}_time_memory_p100.csv", sizes)
    batch = config.data.micro_batch_size * config.pipeline.micro_batches * config.pipeline.data_parallel
    return PlanContext(sizes, source, config.kfac.first_order, config.kfac), batch


def test_enumeration_respects_the_gpus_the_model_the_schedules_and_the_global_batch():
    context, batch = _context()
    sizes = context.sizes
    layouts = enumerate_layouts(SearchSpace(8, batch, context.source.micro_batch_sizes), sizes, "lamb")
    assert 100 < len(layouts) < 5000
    for layout in layouts:
        assert layout.gpus == 8 and layout.global_batch == batch
        assert sizes.heads % layout.tensor_parallel == 0 and sizes.ffn % layout.tensor_parallel == 0
        assert sizes.blocks % layout.pieces == 0
        assert layout.zero <= (layout.data_parallel > 1)
        layout.build_schedule()  # buildable
        if layout.schedule == "chimera":
            assert layout.stages % 2 == 0 and layout.micro_batches % layout.stages == 0
    assert {layout.schedule for layout in layouts} >= {
        "gpipe",
        "1f1b",
        "interleaved",
        "chimera",
        "zb-h1",
        "zbv",
        "dualpipev",
    }
    assert {layout.recompute for layout in layouts} == {"none", "selective", "blocks"}


def test_a_prediction_is_the_simulation_and_the_packing_of_its_layout():
    context, _ = _context()
    layout = Layout(4, 2, 1, "1f1b", 1, 4, 16, method="kfac")
    prediction = predict(layout, context)
    profile = layout_profile(layout, context)
    assert prediction.first_order_ms == pytest.approx(simulate(layout.build_schedule(), profile).step_time)
    packed = pack(layout.build_schedule(), profile, rules_of(profile), pack_options(layout, context))
    assert prediction.layout.refresh_steps == packed.refresh_steps
    assert prediction.step_ms == pytest.approx(cycle_time(simulate_plan(packed.plan, profile)) / packed.refresh_steps)
    assert prediction.reduce_ms > 0  # two data-parallel copies reduce their gradients
    # captures and refresh copies at their joint peak with the activations: no more than the separate peaks
    before = layout_memory(layout, context.sizes, context.first_order, context.momentum, context.precision)
    assert prediction.memory.captures > 0 and prediction.memory.activations <= before.activations
    assert prediction.memory.total > before.total
    assert prediction.tokens_per_s == pytest.approx(16 * 4 * 2 * 128 / (prediction.step_ms / 1e3))


def test_the_budget_drops_what_does_not_fit_and_the_best_run_file_loads_back():
    context, batch = _context()
    space = SearchSpace(4, batch, (16, 32), recompute=("none",))
    roomy = search(space, context, "kfac", 64 * GiB, top=2, shown=2)
    smallest = min(p.memory.total for p in roomy.first_order)
    budget = max(p.memory.total for p in roomy.first_order) - 1  # below a layout's state and activations
    tight = search(space, context, "kfac", budget, top=2, shown=2)
    assert tight.over_budget > roomy.over_budget
    assert all(p.memory.total <= budget for p in tight.ranked)
    assert tight.packed <= 2
    with pytest.raises(PlanError, match="smallest needs"):
        search(space, context, "kfac", smallest // 4, top=2)
    raw = yaml.safe_load(BASE_RUN.read_text())
    best = tight.best.layout
    loaded = config_from_dict(yaml.safe_load(run_file_of(raw, best)))
    assert (
        loaded.pipeline.schedule,
        loaded.pipeline.stages,
        loaded.pipeline.micro_batches,
        loaded.pipeline.data_parallel,
        loaded.pipeline.tensor_parallel,
        loaded.data.micro_batch_size,
        loaded.optimizer.name,
        loaded.kfac.refresh_steps,
    ) == (
        best.schedule,
        best.stages,
        best.micro_batches,
        best.data_parallel,
        best.tensor_parallel,
        best.micro_batch_size,
        "kfac",
        best.refresh_steps,
    )


def test_a_measured_profile_resplits_by_blocks():
    profile = load_profile(ROOT / "profiles" / "tiny-cpu-1f1b.yaml")
    sizes = model_sizes(load_config(ROOT / "schedules" / "tiny-cpu.yaml"))
    four = resplit(profile, 4, sizes)
    assert [sorted({block_of(layer.name) for layer in stage.layers} - {None}) for stage in four.stages] == [
        [0],
        [1],
        [2],
        [3],
    ]
    assert sorted(layer.name for stage in four.stages for layer in stage.layers) == sorted(
        layer.name for stage in profile.stages for layer in stage.layers
    )
    assert sum(s.forward for s in four.stages) == pytest.approx(sum(s.forward for s in profile.stages))
    assert sum(s.backward for s in four.stages) == pytest.approx(sum(s.backward for s in profile.stages))
    assert four.stages[-1].layers[-1].name == profile.stages[-1].layers[-1].name  # the heads stay last
    # the heads' flops (vocabulary projection and transform, on BERT's masked positions) stay with
    # the last piece, not spread over the blocks
    block, head = part_flops(sizes)
    assert sizes.shape.head_rows < sizes.seq_len
    assert four.stages[3].forward / four.stages[2].forward == pytest.approx((block + head) / block)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["MLP", "--gpus", "2"], "model.kind: mlp"),
        (["schedules/tiny-regression.yaml", "--gpus", "2"], "no times to plan with"),
        ([str(BASE_RUN), "--gpus", "7", "--even-splits"], "--gpus 7"),
        ([str(BASE_RUN), "--gpus", "4", "--profile", "profiles/tiny-cpu-1f1b.yaml"], "blocks"),
        ([str(BASE_RUN), "--gpus", "4", "--memory-gb", "0.1", "--reserve-gb", "0"], "smallest needs"),
    ],
)
def test_what_cannot_be_planned_is_refused_in_one_line(argv, message, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(ROOT)
    if argv[0] == "MLP":
        mlp = tmp_path / "mlp.yaml"
        mlp.write_text("model: {kind: mlp}\n")
        argv = [str(mlp), *argv[1:]]
    if "--memory-gb" not in argv:
        argv = argv + ["--memory-gb", "16"]
    assert main(["plan", *argv, "--packed", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and message in err


def test_the_cli_ranks_the_layouts_and_writes_the_best(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    out = tmp_path / "best.yaml"
    assert (
        main(["plan", str(BASE_RUN), "--gpus", "4", "--memory-gb", "16", "--packed", "3", "--top", "3", "-o", str(out)])
        == 0
    )
    text = capsys.readouterr().out
    assert "step [ms]" in text and "memory [GiB]" in text and "the run file's layout 1f1b D4 x DP1 x TP1" in text
    assert "\nexposed optimizer time [%] (step over the same layout's first-order step, - 1): #1 " in text
    assert (
        load_config(out).pipeline.stages
        * load_config(out).pipeline.data_parallel
        * load_config(out).pipeline.tensor_parallel
        == 4
    )


def test_the_64_gpu_search_packs_a_bounded_number():
    context, batch = _context(ROOT / "schedules" / "bert-large-chimera-8x8.yaml", "bert-large")
    space = SearchSpace(64, batch, context.source.micro_batch_sizes)
    result = search(space, context, "kfac", 16 * GiB, top=2, shown=2)
    assert result.enumerated < 5000 and result.packed <= 2 and result.dominated > 0
    assert all(p.layout.gpus == 64 for p in result.ranked)
