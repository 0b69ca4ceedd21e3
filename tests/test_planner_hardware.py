"""Hardware descriptions and the memory reserve of the planner (`pipefisher plan --hardware`,
`--reserve-gb`): presets, bad fields, collectives costed on the links they cross."""

from __future__ import annotations

import json
import tomllib
from dataclasses import replace
from fnmatch import fnmatch
from pathlib import Path

import pytest

from pipefisher.cli.main import main
from pipefisher.config import load_config
from pipefisher.planning.planner.candidates import Layout
from pipefisher.planning.planner.hardware import PRESET_FOLDER, HardwareError, hardware_of, load_hardware, presets
from pipefisher.planning.planner.layout_memory import default_reserve_gib
from pipefisher.planning.planner.links import data_parallel_link, hop_links
from pipefisher.planning.planner.model_sizes import model_sizes
from pipefisher.planning.planner.predict import PlanContext, first_order_time, layout_profile
from pipefisher.planning.planner.search import GiB
from pipefisher.planning.planner.sources import ReferenceTimes

ROOT = Path(__file__).resolve().parents[1]
BASE_RUN = ROOT / "schedules" / "bert-base-1f1b-4x4.yaml"
LARGE_RUN = ROOT / "schedules" / "bert-large-chimera-8x8.yaml"
REFERENCE = ROOT / "profiles" / "reference" / "bert-base_time_memory_p100.csv"


def test_every_preset_loads_and_ships_as_package_data():
    assert set(presets()) == {"p100", "v100", "a100-40gb", "a100-80gb", "h100", "h200"}
    for name in presets():
        hardware = hardware_of(name)
        assert hardware.memory_gib > 0 and hardware.gpus_per_node == 8
        assert hardware.intra_node_gbps > hardware.inter_node_gbps > 0
        assert hardware.peak("fp32") and "datasheet" in hardware.source
        assert hardware_of(f"{name}x4").gpus_per_node == 4
    assert hardware_of("h100").peak("bf16") == 989.5 and hardware_of("p100").peak("bf16") is None
    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    shipped = globs["pipefisher.planning.planner"]
    for path in PRESET_FOLDER.glob("*.yaml"):
        assert any(fnmatch(f"{PRESET_FOLDER.name}/{path.name}", pattern) for pattern in shipped)


def _preset_text(**changes: str) -> str:
    lines = (PRESET_FOLDER / "h100.yaml").read_text().splitlines()
    out = []
    for line in lines:
        key = line.split(":", 1)[0]
        if key in changes:
            if changes[key]:
                out.append(f"{key}: {changes[key]}")
        else:
            out.append(line)
    return "\n".join(out) + "\n"


@pytest.mark.parametrize(
    ("changes", "extra", "named"),
    [
        ({"intra_node_gbps": "fast"}, "", "intra_node_gbps"),
        ({"gpus_per_node": "2.5"}, "", "gpus_per_node"),
        ({"memory_gib": ""}, "", "memory_gib missing"),
        ({"peak_tflops": "{fp8: 1979}"}, "", "peak_tflops: unknown dtype 'fp8'"),
        ({}, "nvlink_gbps: 900\n", "unknown field 'nvlink_gbps'"),
    ],
)
def test_a_bad_field_is_one_line_naming_it_and_the_cli_exits_2(tmp_path, capsys, changes, extra, named):
    path = tmp_path / "gpu.yaml"
    path.write_text(_preset_text(**changes) + extra)
    with pytest.raises(HardwareError, match=named) as caught:
        load_hardware(path)
    assert "\n" not in str(caught.value)
    code = main(["plan", str(BASE_RUN), "--gpus", "4", "--hardware", str(path)])
    err = capsys.readouterr().err
    assert code == 2 and named in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_unknown_hardware_no_memory_and_a_reserve_that_leaves_none_are_refused(capsys):
    assert main(["plan", str(BASE_RUN), "--gpus", "4", "--hardware", "b200x8"]) == 2
    assert "neither a preset" in capsys.readouterr().err
    assert main(["plan", str(BASE_RUN), "--gpus", "4"]) == 2
    assert "--memory-gb" in capsys.readouterr().err
    assert main(["plan", str(BASE_RUN), "--gpus", "4", "--memory-gb", "1.5", "--reserve-gb", "1.5"]) == 2
    assert "--reserve-gb 1.5 leaves nothing of 1.5 GiB" in capsys.readouterr().err
    assert main(["plan", str(BASE_RUN), "--gpus", "4", "--memory-gb", "1.5", "--packed", "2"]) == 2
    err = capsys.readouterr().err
    assert "no layout fits" in err and f"less the reserve of {default_reserve_gib(1.5):.2f} GiB" in err


def _context(hardware: str | None) -> PlanContext:
    config = load_config(BASE_RUN)
    sizes = model_sizes(config)
    found = hardware_of(hardware) if hardware else None
    source = replace(ReferenceTimes.open(REFERENCE, sizes), hardware=found)
    return PlanContext(sizes, source, config.kfac.first_order, config.kfac, hardware=found)


def _layout(stages: int, data_parallel: int, tensor_parallel: int, schedule: str = "1f1b") -> Layout:
    return Layout(stages, data_parallel, tensor_parallel, schedule, 1, 8 // data_parallel, 16)


def test_tensor_parallelism_across_two_nodes_costs_more_than_within_one():
    layout = _layout(1, 1, 8)
    within, across = _context("h100x8"), _context("h100x4")
    assert within.source.profile(1, 16, 8).stages[0].forward < across.source.profile(1, 16, 8).stages[0].forward
    assert first_order_time(layout, within)[0] < first_order_time(layout, across)[0]


def test_data_parallel_reductions_and_pipeline_hops_take_the_link_the_placement_gives():
    h100 = hardware_of("h100x4")
    # TP innermost, then stages, then replicas (pipefisher.core.topology): D2 x DP2 x TP2 puts
    # replica 1 of stage 0 on GPU 4, the second node of 4-GPU nodes; its hop 0 -> 1 stays on one node
    layout = _layout(2, 2, 2)
    assert data_parallel_link(layout, h100, 10.0) == h100.inter
    assert data_parallel_link(layout, hardware_of("h100x8"), 10.0) == h100.intra
    assert data_parallel_link(layout, h100, 7.0, bandwidth_set=True).bandwidth_gbps == 7.0
    assert data_parallel_link(layout, None, 10.0).latency_us == 0.0
    assert hop_links(layout, h100) == (h100.intra,)
    assert hop_links(_layout(4, 1, 2), h100) == (h100.intra, h100.inter, h100.intra)
    replicated = _layout(1, 8, 1)
    within, across = _context("h100x8"), _context("h100x4")
    assert first_order_time(replicated, within)[2] < first_order_time(replicated, across)[2]
    hops = [stage.p2p for stage in layout_profile(_layout(4, 1, 2), across, syncs=False).stages]
    assert hops[1] > hops[0] > 0 and hops[3] == 0.0
    assert all(stage.p2p == 0.0 for stage in layout_profile(_layout(4, 1, 2), _context(None)).stages)


def test_modelled_hops_give_the_link_speed_that_costs_help_ops():
    """A hop's message is one micro-batch's activation (fp32 here), so the profile's link speed is
    known where the hardware costs the hops; each layer's weight size is its shard's, in fp32."""
    context = _context("h100x8")
    sizes = context.sizes
    profile = layout_profile(_layout(4, 1, 1), context, syncs=False)
    assert [stage.p2p_bytes for stage in profile.stages] == [16 * sizes.seq_len * sizes.hidden * 4] * 3 + [0]
    assert profile.link_speed == pytest.approx(profile.stages[0].p2p_bytes / profile.stages[0].p2p)
    query = next(layer for layer in profile.stages[0].layers if layer.name.endswith("attention.query"))
    assert query.weight_bytes == sizes.hidden * sizes.hidden * 4
    assert layout_profile(_layout(4, 1, 1), _context(None), syncs=False).link_speed == 0.0


def _plan_json(capsys, *argv: str) -> dict:
    assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_the_default_reserve_keeps_a_tight_layout_from_ranking(capsys):
    """Issue 46: 16 GiB per GPU ranked a layout with 0.1 GiB free first; with the reserve none
    leaves less than it free."""
    argv = (str(LARGE_RUN), "--gpus", "8", "--memory-gb", "16", "--packed", "3", "--top", "3")
    reserve = default_reserve_gib(16)
    planned = _plan_json(capsys, *argv)
    assert planned["reserve_bytes"] == int(reserve * GiB)
    assert planned["ranked"] and all(p["memory_bytes"]["total"] <= (16 - reserve) * GiB for p in planned["ranked"])
    bare = _plan_json(capsys, *argv, "--reserve-gb", "0")
    assert any(p["memory_bytes"]["total"] > (16 - reserve) * GiB for p in bare["ranked"])


def test_plan_with_a_hardware_preset_end_to_end(capsys):
    argv = ["plan", str(BASE_RUN), "--gpus", "16", "--hardware", "h100x8", "--packed", "2", "--top", "2"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "on 16 GPUs of 80 GiB" in out and "hardware: H100 SXM5 80GB, 8 per node on NVLink 4" in out
    assert f"reserve of {default_reserve_gib(80):.2f} GiB" in out
    planned = _plan_json(capsys, *argv[1:], "--memory-gb", "40", "--reserve-gb", "2")
    assert planned["memory_bytes"] == 40 * GiB and planned["reserve_bytes"] == 2 * GiB
    assert planned["hardware"]["gpus_per_node"] == 8
    assert all(p["memory_bytes"]["total"] <= 38 * GiB for p in planned["ranked"])


def test_times_come_from_flops_on_hardware_the_reference_csv_does_not_time(capsys):
    """A measured profile wins; the P100 CSV for a model it times on the P100 or without hardware;
    flops on any other hardware and with `--times flops` (tests/test_flop_times.py for the model)."""
    argv = ["plan", str(BASE_RUN), "--gpus", "2", "--max-tensor-parallel", "1", "--packed", "1", "--top", "1"]
    assert main([*argv, "--hardware", "a100-80gb"]) == 0
    assert (
        "times from flops at calibrated shares of the A100 SXM4 80GB's 19.5 TFLOP/s fp32 peak"
        in capsys.readouterr().out
    )
    assert main([*argv, "--hardware", "p100", "--memory-gb", "40"]) == 0
    assert "times from bert-base_time_memory_p100.csv" in capsys.readouterr().out
    assert main([*argv, "--hardware", "h100", "--times", "flops", "--method", "shampoo"]) == 0
    assert "shampoo (first-order" in capsys.readouterr().out
    assert main([*argv, "--memory-gb", "16", "--times", "flops"]) == 2
    assert (
        capsys.readouterr()
        .err.strip()
        .endswith("--times flops: give --hardware (e.g. a100-80gb or h100x8): the flops need its peak")
    )


def test_a_methods_candidates_are_packed_in_order_of_their_step_with_its_step_end(capsys):
    """SOAP's rotations are in its step end, so the fastest first-order steps are not the fastest
    SOAP steps: packed in order of the step with that work (`step_end_time`), 5 packings give the
    top 3 that 40 allowed give (by first-order steps 5 gave 89.9, 100.8 and 106.3 ms against 88.0,
    89.9 and 92.8 ms), and the search stops early."""
    argv = (str(BASE_RUN), "--gpus", "4", "--hardware", "h100", "--method", "soap", "--top", "3")
    few, many = (_plan_json(capsys, *argv, "--packed", packed) for packed in ("5", "40"))
    assert [p["step_ms"] for p in few["ranked"][:3]] == [p["step_ms"] for p in many["ranked"][:3]]
    assert many["packed"] < 40
