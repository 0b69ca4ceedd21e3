"""Times from flops (`pipefisher.planning.planner.flop_times`): the calibration against the P100
CSVs it comes from, the H100 measurement of docs/gpu_h100.md, and what more flops, another dtype
and other methods do."""

from __future__ import annotations

import csv
import json
from dataclasses import replace

import pytest

from pipefisher.config import load_config
from pipefisher.methods.registry import method
from pipefisher.planning.planner.flop_calibration import REFERENCE_FOLDER, fit_p100
from pipefisher.core.profile_flops import STEP_END_FLOPS
from pipefisher.methods.flops import MatrixShape
from pipefisher.planning.planner.flop_times import EFFICIENCY, FlopTimes, op_ms
from pipefisher.planning.planner.candidates import Layout
from pipefisher.planning.planner.hardware import hardware_of
from pipefisher.planning.planner.model_sizes import PlanError, model_sizes
from pipefisher.planning.transformer_profile import ALLREDUCES_FORWARD, block_layer_shapes, tensor_parallel_allreduce_ms
from tests.test_planner_hardware import BASE_RUN, LARGE_RUN

#: the largest relative error of each fitted line over the CSV rows it was fitted to (0.11 = 11 %):
#: the per-block model (flops at a share of the peak plus a fixed cost) leaves these
FIT_TOLERANCE = {"forward": 0.12, "backward": 0.05, "curvature": 0.21, "refresh": 0.001, "precondition": 0.001}


def _sizes(run):
    return model_sizes(load_config(run))


def _times(run, hardware="p100", precision="fp32", name="kfac", **changes):
    config = load_config(run)
    section = config.section(name) if name in ("kfac", "shampoo", "soap", "muon") else None
    return FlopTimes.check(_sizes(run), replace(hardware_of(hardware), **changes), precision, name, section)


def test_the_efficiency_table_is_the_fit_to_the_p100_csvs():
    fits = fit_p100()
    assert set(fits) == set(EFFICIENCY)
    for kind, fit in fits.items():
        assert EFFICIENCY[kind].share == pytest.approx(fit.share, abs=5e-4), kind
        assert EFFICIENCY[kind].overhead_ms == pytest.approx(fit.overhead_ms, abs=5e-4), kind
        assert fit.worst <= FIT_TOLERANCE[kind], kind


@pytest.mark.parametrize("run", [BASE_RUN, LARGE_RUN])
def test_the_p100_prediction_of_a_block_is_within_the_fits_tolerance_at_every_micro_batch_size(run):
    sizes = _sizes(run)
    with open(REFERENCE_FOLDER / f"{sizes.name}_time_memory_p100.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    times = _times(run)
    for row in rows:
        # one block per stage: stage 0 holds block 0 and no heads
        stage = times.profile(sizes.blocks, int(row["bs"]), 1).stages[0]
        kron = sum(sum(layer.curvature) for layer in stage.layers)
        inverse = sum(sum(layer.refresh) for layer in stage.layers)
        precondition = sum(layer.precondition for layer in stage.layers)
        for kind, predicted, measured in (
            ("forward", stage.forward, row["time_f"]),
            ("backward", stage.backward, row["time_b"]),
            ("curvature", kron, row["time_kron"]),
            ("refresh", inverse, row["time_inv"]),
            ("precondition", precondition, row["time_prec"]),
        ):
            # refresh and precondition: the CSV's rows differ by < 1 % from their mean, the fit's point
            tolerance = FIT_TOLERANCE[kind] + (0.01 if kind in ("refresh", "precondition") else 0.001)
            assert predicted == pytest.approx(float(measured), rel=tolerance), (kind, row["bs"])


def test_the_h100_prediction_stays_under_the_host_bound_measurement():
    """docs/gpu_h100.md, section 4: `pipefisher profile` of BERT-Base, one stage, bf16, micro-batches
    of 32 x 128 on an H100 measured forward 19.256 ms and backward 22.266 ms, with the device idle
    85 % of a traced step (section "Third session"). The model has no host: it must come out below,
    and its fixed costs (fitted on the P100) explain about half of the measurement."""
    stage = _times(BASE_RUN, "h100", "bf16").profile(1, 32, 1).stages[0]
    ratio = (stage.forward + stage.backward) / (19.256 + 22.266)
    assert 0.35 <= ratio <= 1.0, ratio


def test_more_flops_take_more_time_and_bf16_is_faster_than_fp32_on_an_h100():
    small, large = _times(BASE_RUN, "h100", "bf16"), _times(LARGE_RUN, "h100", "bf16")
    one = small.profile(1, 8, 1).stages[0]
    assert small.profile(1, 16, 1).stages[0].forward > one.forward
    assert large.profile(1, 8, 1).stages[0].forward > one.forward
    # at 64 x 128 tokens the flops outweigh the fixed costs: 67 vs 989.5 TFLOP/s shows
    bf16, fp32 = (_times(BASE_RUN, "h100", dtype).profile(1, 64, 1).stages[0] for dtype in ("bf16", "fp32"))
    assert fp32.forward > 3 * bf16.forward and fp32.backward > 3 * bf16.backward
    # the task dtypes stay fp32: K-FAC's inverses are the same in both runs
    assert fp32.layers[0].refresh == bf16.layers[0].refresh


def test_the_last_stage_carries_the_heads_and_the_step_end_the_optimizers_bytes():
    times = _times(LARGE_RUN, "a100-80gb", "bf16")
    first, last = times.profile(4, 8, 1).stages[0], times.profile(4, 8, 1).stages[-1]
    assert last.forward > first.forward and last.backward > first.backward
    slower = _times(LARGE_RUN, "a100-80gb", "bf16", memory_bandwidth_gbps=1000.0).profile(4, 8, 1).stages[0]
    assert first.step_end > 0 and slower.step_end == pytest.approx(first.step_end * 2039 / 1000)


def test_tensor_parallelism_splits_the_flops_keeps_the_fixed_costs_and_adds_all_reduces():
    times = _times(LARGE_RUN, "a100-80gb", "bf16")
    whole, split = times.profile(1, 8, 1).stages[0], times.profile(1, 8, 8).stages[0]
    fixed = 24 * EFFICIENCY["forward"].overhead_ms
    link = hardware_of("a100-80gb").tensor_parallel_link(8)
    allreduce = tensor_parallel_allreduce_ms(8 * 128 * 1024 * 2, 8, link.bandwidth_gbps, link.latency_us)
    expected = (whole.forward - fixed) / 8 + fixed + 24 * ALLREDUCES_FORWARD * allreduce
    assert split.forward == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize("name", ["shampoo", "soap", "muon"])
def test_methods_other_than_kfac_are_timed_from_their_own_flop_counts(name):
    config = load_config(LARGE_RUN)
    times = FlopTimes.check(_sizes(LARGE_RUN), hardware_of("h100"), "bf16", name, config.section(name))
    layer = times.profile(1, 8, 1).stages[0].layers[0]
    keys = set(method(name).task_flops(config.section(name), _shape(), 1024)) - {STEP_END_FLOPS}
    timed = {key for key in keys if layer.time(*_work(key)) > 0}
    assert timed == {key for key in keys if key.split(".")[0] in EFFICIENCY} and timed


def test_soaps_fold_in_the_bubbles_is_each_layers_fold_time_at_the_preconditions_efficiency():
    section = replace(load_config(LARGE_RUN).section("soap"), fold="bubbles")
    times = FlopTimes.check(_sizes(LARGE_RUN), hardware_of("h100"), "bf16", "soap", section)
    sizes, peak = _sizes(LARGE_RUN), hardware_of("h100").peak("fp32")  # float64 statistics: the fp32 peak
    shapes = {suffix: (din, dout) for suffix, din, dout in block_layer_shapes(sizes.hidden, sizes.ffn, 1)}
    for layer in times.profile(4, 8, 1).stages[0].layers:
        din, dout = shapes[layer.name.split(".", 1)[1]]
        fold = method("soap").task_flops(section, MatrixShape(dout, din, has_bias=True), 8 * sizes.seq_len)["fold"]
        assert layer.fold == pytest.approx(op_ms(fold.total, peak, EFFICIENCY["precondition"]))
        assert layer.precondition == 0.0


@pytest.mark.parametrize("name", ["kfac", "shampoo", "soap", "muon"])
def test_a_methods_optimizer_step_work_is_in_the_step_end_and_out_of_the_first_order_step(name):
    """Shampoo's and SOAP's preconditioning runs in the optimizer step: each stage's step end
    holds it (its layers' ``step_end`` flops at the precondition's share of the peak) as its
    `method_step_end`; K-FAC and Muon precondition in P ops and add none."""
    config = load_config(LARGE_RUN)
    section = config.section(name)
    times = FlopTimes.check(_sizes(LARGE_RUN), hardware_of("h100"), "bf16", name, section)
    plain = _times(LARGE_RUN, "h100", "bf16", name="adamw").profile(4, 8, 1)
    sizes, peak = _sizes(LARGE_RUN), hardware_of("h100").peak("fp32")
    per_block = 0.0
    for _, din, dout in block_layer_shapes(sizes.hidden, sizes.ffn, 1):
        found = method(name).task_flops(section, MatrixShape(dout, din, has_bias=True), 8 * sizes.seq_len)
        if STEP_END_FLOPS in found:
            per_block += op_ms(found[STEP_END_FLOPS].total, peak, EFFICIENCY["precondition"])
    for stage, first_order in zip(times.profile(4, 8, 1).stages, plain.stages):
        assert stage.method_step_end == pytest.approx(per_block * 24 / 4)
        assert stage.step_end - stage.method_step_end == pytest.approx(first_order.step_end)
    assert (per_block > 0) == (name in ("shampoo", "soap"))


def _shape():
    return MatrixShape(1024, 1024, has_bias=True)


def _work(key: str) -> tuple[str, int | None]:
    work, _, part = key.partition(".")
    return work, int(part) if part else None


def test_a_hardware_without_the_runs_precision_is_refused_in_one_line():
    with pytest.raises(PlanError, match=r"no bf16 peak .* set run.precision"):
        _times(BASE_RUN, "p100", "bf16")


def test_plan_predicts_soaps_optimizer_step_and_keeps_it_out_of_the_first_order_step(capsys):
    """On the flop model, SOAP's preconditioning in the optimizer step is exposed optimizer time
    (before it was counted nowhere: 0 %), and the first-order step it is over is AdamW's."""
    from pipefisher.cli.main import main

    found = {}
    for name in ("adamw", "soap"):
        argv = ["plan", str(BASE_RUN), "--gpus", "4", "--hardware", "h100", "--method", name, "--json"]
        assert main([*argv, "--max-tensor-parallel", "1", "--packed", "2", "--top", "1"]) == 0
        found[name] = json.loads(capsys.readouterr().out)["run_file_layout"]
    assert found["soap"]["first_order_ms"] == pytest.approx(found["adamw"]["first_order_ms"])
    step_end = _times(BASE_RUN, "h100", "bf16", name="soap").profile(4, 32, 1).stages[0].method_step_end
    assert found["soap"]["step_ms"] - found["soap"]["first_order_ms"] >= step_end > 0


def test_tf32_puts_float32_products_on_the_tf32_peak_and_leaves_the_rest():
    """`run.tf32` (FlopTimes.tf32): K-FAC's float32 tasks and an fp32 run's blocks on the H100's
    tf32 peak, a bf16 run's blocks on the bf16 peak as before, SOAP's float64 bases on the fp32
    peak as before; a GPU without a tf32 peak (P100) changes nothing."""

    def compute_ms(before: float, name: str, speedup: float, executions: int = 1) -> float:
        """`before` with its flops' part `speedup` x faster and its fixed costs kept."""
        fixed = EFFICIENCY[name].overhead_ms * executions
        return (before - fixed) / speedup + fixed

    h100 = hardware_of("h100")
    speedup = h100.peak("tf32") / h100.peak("fp32")
    for precision in ("fp32", "bf16"):
        plain = _times(LARGE_RUN, "h100", precision).profile(4, 8, 1).stages[0]
        tf32 = replace(_times(LARGE_RUN, "h100", precision), tf32=True).profile(4, 8, 1).stages[0]
        blocks = speedup if precision == "fp32" else 1.0
        assert tf32.forward == pytest.approx(compute_ms(plain.forward, "forward", blocks, executions=24 // 4))
        layer, fast = plain.layers[0], tf32.layers[0]
        assert fast.precondition == pytest.approx(compute_ms(layer.precondition, "precondition", speedup))
        assert fast.refresh[0] == pytest.approx(compute_ms(layer.refresh[0], "refresh", speedup))
    soap = _times(LARGE_RUN, "h100", "bf16", name="soap")
    bases = [times.profile(4, 8, 1).stages[0].layers[0].refresh for times in (soap, replace(soap, tf32=True))]
    assert bases[0] == bases[1]
    p100 = _times(LARGE_RUN, "p100", "fp32")
    assert replace(p100, tf32=True).profile(4, 8, 1) == p100.profile(4, 8, 1)


@pytest.mark.parametrize(
    ("schedule", "data_parallel", "zero", "replicas"),
    [("1f1b", 4, 1, 4), ("chimera", 2, 1, 4), ("1f1b", 4, 0, 1), ("1f1b", 1, 1, 1), ("1f1b", 4, 2, 1)],
)
def test_zero1_owners_share_the_methods_optimizer_step(schedule, data_parallel, zero, replicas):
    """Under ZeRO-1 each of a stage's R replicas (data-parallel copies, twice over under Chimera)
    preconditions only the matrices it owns: 1/R of the stage's method step end; ZeRO-2/3 and
    unreplicated stages keep it whole."""
    from pipefisher.planning.planner.predict import PlanContext, layout_profile

    config = load_config(BASE_RUN)
    source = _times(BASE_RUN, "h100", "bf16", name="soap")
    context = PlanContext(_sizes(BASE_RUN), source, "adamw", config.section("soap"), precision="bf16")
    layout = Layout(2, data_parallel, 1, schedule, 1, 4, 8, zero=zero, method="soap")
    whole = source.profile(2, 8, 1)
    for stage, full in zip(layout_profile(layout, context).stages, whole.stages):
        assert stage.method_step_end == pytest.approx(full.method_step_end / replicas) and full.method_step_end > 0
        assert stage.step_end - stage.method_step_end == pytest.approx(full.step_end - full.method_step_end)


def test_kfac_reduce_captures_and_curvature_read_one_row_per_sequence():
    """K-FAC-reduce (`approximation: reduce`): each layer's captures hold 1/seq_len of expand's bytes,
    its curvature is faster (its flops: tests/test_task_flops.py); refresh and preconditioning are unchanged."""
    section = load_config(LARGE_RUN).section("kfac")
    sizes = _sizes(LARGE_RUN)
    found = {}
    for approximation in ("expand", "reduce"):
        times = FlopTimes.check(
            sizes, hardware_of("h100"), "fp32", "kfac", replace(section, approximation=approximation)
        )
        found[approximation] = times.profile(4, 8, 1).stages[0].layers
    for expand, reduce in zip(found["expand"], found["reduce"]):
        assert [b * sizes.seq_len for b in reduce.capture_bytes] == list(expand.capture_bytes) != [0, 0]
        assert all(0 < r < e for r, e in zip(reduce.curvature, expand.curvature))
        assert (reduce.refresh, reduce.precondition) == (expand.refresh, expand.precondition)
