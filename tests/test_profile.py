import json
from dataclasses import replace
import random
import statistics

import numpy as np
import pytest
import yaml
from pathlib import Path

from pipefisher.core.percentile import percentile
from pipefisher.core.profile import LayerProfile, Profile, ProfileError, StageProfile, load_profile, profile_from_dict

GOOD = {
    "schema": "pipefisher.profile/v2",
    "device": "P100",
    "time_unit": "ms",
    "micro_batch_size": 32,
    "method": "kfac",
    "stages": [
        {
            "forward": 29.2,
            "backward": 49.4,
            "p2p": 0.5,
            "step_end": 3.5,
            "grad_reduce": 1.25,
            "layers": [
                {
                    "name": "block0.attention.query",
                    "curvature": [0.61, 0.61],
                    "refresh": [1.4, 1.4],
                    "precondition": 0.1,
                },
            ],
        },
        {"forward": 29.2, "backward": 49.4},
    ],
}
#: the same profile as written by format v1 (no method: K-FAC's by v1's rule)
GOOD_V1 = {
    "schema": "pipefisher.profile/v1",
    "device": "P100",
    "time_unit": "ms",
    "micro_batch_size": 32,
    "stages": [
        {
            **GOOD["stages"][0],
            "layers": [
                {
                    "name": "block0.attention.query",
                    "curvature_a": 0.61,
                    "curvature_b": 0.61,
                    "inverse_a": 1.4,
                    "inverse_b": 1.4,
                    "precondition": 0.1,
                },
            ],
        },
        GOOD["stages"][1],
    ],
}


def test_yaml_and_json_round_trip(tmp_path):
    profile = profile_from_dict(GOOD)
    assert profile.stages[0].layers[0] == LayerProfile(
        "block0.attention.query", curvature=(0.61, 0.61), refresh=(1.4, 1.4), precondition=0.1
    )
    for name in ("p.yaml", "p.json"):
        path = tmp_path / name
        profile.save(path)
        assert load_profile(path) == profile
        assert path.read_text().count("step_end") == 1  # written only where non-zero: older readers load the rest
        assert path.read_text().count("grad_reduce") == 1


def test_a_version_1_profile_reads_as_the_same_profile(tmp_path):
    """v1 names its two parts by letter (A = part 0, B = part 1; inverse_x is the refresh work),
    and a v1 file without `method` holds K-FAC's times; saving writes v2."""
    assert profile_from_dict(GOOD_V1) == profile_from_dict(GOOD)
    sampled = json.loads(json.dumps(GOOD_V1))
    sampled["stages"][0]["layers"][0].update(
        sync_b=0.25, capture_a_bytes=1024, capture_b_bytes=2048, samples={"inverse_b": [1.4], "curvature_a": [0.61]}
    )
    layer = profile_from_dict(sampled).stages[0].layers[0]
    assert (layer.sync, layer.capture_bytes) == ((0.0, 0.25), (1024, 2048))
    assert layer.samples == {"refresh.1": (1.4,), "curvature.0": (0.61,)}
    assert profile_from_dict({**GOOD_V1, "method": "shampoo"}).method == "shampoo"
    with pytest.raises(ProfileError, match=r"stages\[0\]\.layers\[0\]\.inverse_a: missing"):
        bad = json.loads(json.dumps(GOOD_V1))
        del bad["stages"][0]["layers"][0]["inverse_a"]
        profile_from_dict(bad)
    path = tmp_path / "p.yaml"
    profile_from_dict(sampled).save(path)
    assert yaml.safe_load(path.read_text())["schema"] == "pipefisher.profile/v2"
    assert load_profile(path) == profile_from_dict(sampled)


def test_example_from_the_design_document_loads(tmp_path):
    path = tmp_path / "design.yaml"
    path.write_text(yaml.safe_dump(GOOD))
    profile = load_profile(path)
    assert profile.num_stages == 2 and profile.micro_batch_size == 32 and profile.stages[1].layers == ()
    assert profile.stages[0].step_end == 3.5 and profile.stages[1].step_end == 0.0  # optional field
    assert profile.stages[0].grad_reduce == 1.25 and profile.stages[1].grad_reduce == 0.0  # optional field
    assert profile.stages[0].curvature_time == pytest.approx(1.22)
    assert profile.stages[0].refresh_time == pytest.approx(2.8)


def mutate(path_keys, value):
    data = json.loads(json.dumps(GOOD))
    target = data
    for key in path_keys[:-1]:
        target = target[key]
    if value is KeyError:
        del target[path_keys[-1]]
    else:
        target[path_keys[-1]] = value
    return data


@pytest.mark.parametrize(
    "keys, value, message",
    [
        (["stages", 1, "forward"], KeyError, r"stages\[1\]\.forward: missing"),
        (["stages", 0, "backward"], -1.0, r"stages\[0\]\.backward: -1.0 is negative"),
        (["stages", 0, "layers", 0, "refresh"], 1.4, r"stages\[0\]\.layers\[0\]\.refresh: expected a list by part"),
        (["stages", 0, "layers", 0, "sync"], [0.5, -2], r"stages\[0\]\.layers\[0\]\.sync\[1\]: -2 is negative"),
        (["stages", 0, "layers", 0, "inverse_a"], 1.4, r"stages\[0\]\.layers\[0\]: unknown field 'inverse_a'"),
        (["stages", 0, "step_end"], -0.5, r"stages\[0\]\.step_end: -0.5 is negative"),
        (["stages", 0, "forward"], "fast", r"stages\[0\]\.forward: 'fast' is not a finite number"),
        (["stages", 0, "forwad"], 1.0, r"stages\[0\]: unknown field 'forwad'"),
        (["time_unit"], "minutes", "time_unit: 'minutes' is not one of"),
        (["schema"], "other/v9", "schema: 'other/v9' is not supported"),
        (["method"], "no such", "method: 'no such' must be the name of a curvature method"),
        (["stages"], [], "stages: missing"),
        (["micro_batch_size"], 0, "micro_batch_size: 0 must be a positive integer"),
        (
            ["stages", 0, "samples"],
            {"fwd": [1.0]},
            r"stages\[0\]\.samples\.fwd: unknown time field",
        ),
        (
            ["stages", 0, "samples"],
            {"forward": []},
            r"stages\[0\]\.samples\.forward: expected a non-empty list of times",
        ),
        (["stages", 0, "samples"], {"p2p": [0.5, -1.0]}, r"stages\[0\]\.samples\.p2p\[1\]: -1.0 is negative"),
        (
            ["stages", 0, "layers", 0, "samples"],
            {"refresh.0": [1.0, float("inf")]},
            r"stages\[0\]\.layers\[0\]\.samples\.refresh\.0\[1\]: inf is not a finite number",
        ),
        (
            ["stages", 0, "layers", 0, "samples"],
            {"forward": [1.0]},
            r"stages\[0\]\.layers\[0\]\.samples\.forward: unknown time field",
        ),
        (
            ["stages", 0, "layers", 0, "samples"],
            {"refresh.a": [1.0]},
            r"stages\[0\]\.layers\[0\]\.samples\.refresh\.a: unknown time field",
        ),
        (
            ["stages", 0, "layers", 0, "capture_bytes"],
            [-1],
            r"stages\[0\]\.layers\[0\]\.capture_bytes\[0\]: -1 is not a non-negative integer",
        ),
        (
            ["stages", 0, "layers", 0, "capture_bytes"],
            [0, 1.5],
            r"stages\[0\]\.layers\[0\]\.capture_bytes\[1\]: 1.5 is not a non-negative integer",
        ),
        (
            ["stages", 0, "layers", 0, "flops"],
            {"inverse.0": 1.0},
            r"stages\[0\]\.layers\[0\]\.flops\.inverse\.0: unknown time field",
        ),
        (
            ["stages", 0, "layers", 0, "flops"],
            {"refresh.0": -2.0},
            r"stages\[0\]\.layers\[0\]\.flops\.refresh\.0: -2.0 is not a finite number >= 0",
        ),
        (["flop_rates"], {"peaks": {"float32": "fast"}}, r"flop_rates\.peaks\.float32: 'fast' is not a finite"),
        (["flop_rates"], {"measured": "yes"}, r"flop_rates\.measured: 'yes' must be true or false"),
        (["flop_rates"], {"dtypes": {"refresh": 64}}, r"flop_rates\.dtypes\.refresh: 64 must name a dtype"),
        (["flop_rates"], {"peak": {}}, r"flop_rates: unknown field 'peak'"),
        (["stages", 0, "method_step_end"], 99.0, r"stages\[0\]\.method_step_end: 99.0 exceeds step_end"),
    ],
)
def test_bad_fields_are_named(keys, value, message):
    with pytest.raises(ProfileError, match=message):
        profile_from_dict(mutate(keys, value))


def test_duplicate_layer_names_are_rejected():
    data = mutate(["stages", 0, "layers"], GOOD["stages"][0]["layers"] * 2)
    with pytest.raises(ProfileError, match="appears twice"):
        profile_from_dict(data)


def test_wrong_stage_count_names_both_counts():
    profile = Profile(stages=(StageProfile(1, 2),) * 3)
    with pytest.raises(ProfileError, match="profile has 3 stages but the schedule needs 4"):
        profile.require_stages(4)


def test_unreadable_and_malformed_files_are_profile_errors(tmp_path):
    with pytest.raises(ProfileError, match="cannot read profile"):
        load_profile(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ProfileError, match="not valid JSON"):
        load_profile(bad)


SAMPLED = mutate(["stages", 0, "samples"], {"forward": [29.0, 29.2, 31.5], "step_end": [3.5, 4.0]})
SAMPLED["stages"][0]["layers"][0].update(capture_bytes=[1024, 2048], samples={"refresh.1": [1.4, 1.1, 2.0, 1.3]})


def test_files_without_the_additions_are_written_with_the_given_fields_only():
    profile = profile_from_dict(GOOD)
    layer = profile.stages[0].layers[0]
    assert (layer.capture_bytes, layer.sync, layer.samples, profile.stages[0].samples) == ((), (), {}, {})
    expected = json.loads(json.dumps(GOOD))
    expected["stages"][1] = {"forward": 29.2, "backward": 49.4, "p2p": 0.0, "layers": []}
    assert json.dumps(profile.to_dict()) == json.dumps(expected)  # same keys in the same order


def test_a_part_past_a_lists_end_takes_zero():
    layer = LayerProfile("fc", curvature=(0.5, 0.0), refresh=(0.0, 2.0), sync=(0.0, 0.0))
    assert (layer.curvature, layer.refresh, layer.sync) == ((0.5,), (0.0, 2.0), ())
    assert (layer.time("curvature", 1), layer.time("refresh", 1), layer.captured(3)) == (0.0, 2.0, 0)


def test_samples_and_capture_sizes_round_trip(tmp_path):
    profile = profile_from_dict(SAMPLED)
    layer = profile.stages[0].layers[0]
    assert layer.capture_bytes == (1024, 2048)
    assert layer.samples == {"refresh.1": (1.4, 1.1, 2.0, 1.3)} and profile.stages[1].samples == {}
    assert {profile: "hashable"}[profile_from_dict(SAMPLED)] == "hashable"
    for name in ("p.yaml", "p.json"):
        path = tmp_path / name
        profile.save(path)
        assert load_profile(path) == profile
        assert path.read_text().count("samples") == 2 and path.read_text().count("capture_bytes") == 1


def test_at_percentile_matches_numpy():
    rng = random.Random(0)
    draws = {n: [rng.uniform(0.5, 3.0) for _ in range(n)] for n in (1, 2, 5, 8)}
    layer = LayerProfile(
        "fc",
        curvature=(1.0, 1.0),
        refresh=(9.0, 9.0),
        precondition=0.1,
        samples={"curvature.0": draws[8], "refresh.0": draws[1]},
    )
    stage = StageProfile(7.0, 8.0, p2p=0.25, layers=(layer,), samples={"forward": draws[2], "backward": draws[5]})
    profile = Profile(stages=(stage,))
    for q in (0, 12.5, 50, 90, 99, 100):
        at = profile.at_percentile(q)
        assert at.stages[0].forward == pytest.approx(np.percentile(draws[2], q), rel=1e-12)
        assert at.stages[0].backward == pytest.approx(np.percentile(draws[5], q), rel=1e-12)
        assert at.stages[0].layers[0].curvature[0] == pytest.approx(np.percentile(draws[8], q), rel=1e-12)
        assert at.stages[0].layers[0].refresh[0] == draws[1][0]
        assert (at.stages[0].p2p, at.stages[0].layers[0].refresh[1]) == (0.25, 9.0)  # no samples: kept
        assert at.stages[0].samples == stage.samples and at.stages[0].layers[0].samples == layer.samples
    assert profile.at_percentile(50).stages[0].backward == pytest.approx(statistics.median(draws[5]), rel=1e-12)
    for q in (-1, 100.5, float("nan")):
        with pytest.raises(ValueError, match="not in \\[0, 100\\]"):
            profile.at_percentile(q)
    with pytest.raises(ValueError):
        percentile([], 50)


def test_what_a_profile_was_measured_at_is_written_read_and_checked(tmp_path):
    measured = {**GOOD, "seq_len": 128, "precision": "bf16", "model": "bert bert-base", "tf32": False}
    path = tmp_path / "p.yaml"
    profile_from_dict(measured).save(path)
    loaded = load_profile(path)
    assert (loaded.micro_batch_size, loaded.seq_len, loaded.precision, loaded.model, loaded.tf32) == (
        32,
        128,
        "bf16",
        "bert bert-base",
        False,
    )
    assert profile_from_dict(GOOD).seq_len is None and profile_from_dict(GOOD).model == "", "absent: unknown"
    assert profile_from_dict(GOOD).tf32 is None and "tf32" not in profile_from_dict(GOOD).to_dict()
    for field, value, message in [
        ("seq_len", 0, "seq_len: 0 must be a positive integer"),
        ("precision", "fp8", "precision: 'fp8' is not one of fp32, bf16, fp16"),
        ("tf32", "yes", "tf32: 'yes' must be true or false"),
    ]:
        with pytest.raises(ProfileError, match=message):
            profile_from_dict({**GOOD, field: value})


def test_a_profile_measured_at_another_shape_is_refused_naming_what_differs():
    from dataclasses import replace
    from pathlib import Path

    from pipefisher.config import load_config
    from pipefisher.runtime.training.run_profile import check_profile_matches, stage_layer_names

    config = load_config(Path(__file__).resolve().parents[1] / "schedules" / "tiny-cpu.yaml").with_overrides(
        optimizer={"name": "kfac"}
    )
    stages = tuple(
        StageProfile(1.0, 2.0, layers=tuple(LayerProfile(name) for name in stage_layer_names(config, stage, 2)))
        for stage in range(2)
    )
    profile = Profile(stages, micro_batch_size=8, seq_len=64, precision="fp32", model="bert bert-4x128")
    check_profile_matches(profile, config, 2)
    check_profile_matches(Profile(stages), config, 2)  # a profile that records nothing of its run is not checked
    for field, value, line in [
        (
            "micro_batch_size",
            32,
            "micro_batch_size: the profile was measured at data.micro_batch_size 32, this run has 8; ",
        ),
        ("seq_len", 128, "seq_len: the profile was measured at model.seq_len 128, this run has 64; "),
        ("precision", "bf16", "precision: the profile was measured at run.precision bf16, this run has fp32; "),
        (
            "model",
            "bert bert-base",
            "model: the profile was measured at model bert bert-base, this run has bert bert-4x128; ",
        ),
        ("recompute", "blocks", "recompute: the profile was measured at model.recompute blocks, this run has none; "),
        ("tf32", True, "tf32: the profile was measured at run.tf32 true, this run has false; "),
    ]:
        with pytest.raises(ProfileError) as error:
            check_profile_matches(replace(profile, **{field: value}), config, 2)
        assert (
            str(error.value)
            == line + "its times do not hold here: measure a profile of this run with `pipefisher profile`"
        )


def test_the_shipped_version_1_profile_loads_and_saves_as_v2(tmp_path):
    shipped = Path(__file__).resolve().parents[1] / "profiles" / "tiny-cpu-1f1b.yaml"
    assert yaml.safe_load(shipped.read_text())["schema"] == "pipefisher.profile/v1"
    profile = load_profile(shipped)
    assert profile.method == "kfac" and all(len(layer.refresh) == 2 for s in profile.stages for layer in s.layers)
    profile.save(tmp_path / "p.yaml")
    assert load_profile(tmp_path / "p.yaml") == profile


#: GOOD with its tasks' flops and the device's rates: 1.4 ms refreshes of 2.8 GFLOP (2 TFLOP/s)
COUNTED = mutate(["flop_rates"], {"dtypes": {"refresh": "float64", "curvature": "float32"}, "peaks": {"float64": 4e12}})
COUNTED["stages"][0]["layers"][0]["flops"] = {"refresh.0": 2.8e9, "refresh.1": 1.4e9, "curvature.0": 6.1e8}


def test_flops_and_flop_rates_round_trip_and_give_each_task_kinds_rate(tmp_path):
    from pipefisher.core.profile_flops import task_rates

    profile = profile_from_dict(COUNTED)
    for name in ("p.yaml", "p.json"):
        profile.save(tmp_path / name)
        assert load_profile(tmp_path / name) == profile
    assert {profile: "hashable"}[profile_from_dict(COUNTED)] == "hashable"
    rates = {(rate.work, rate.part): rate for rate in task_rates(profile)}
    assert list(rates) == [("curvature", 0), ("refresh", 0), ("refresh", 1)]
    assert rates[("refresh", 0)].rate == pytest.approx(2e12) and rates[("refresh", 0)].share == pytest.approx(0.5)
    assert rates[("refresh", 1)].rate == pytest.approx(1e12) and rates[("refresh", 1)].dtype == "float64"
    assert rates[("curvature", 0)].rate == pytest.approx(1e12) and rates[("curvature", 0)].share is None
    assert task_rates(profile_from_dict(GOOD)) == [], "no counts: no rates"
    assert task_rates(replace(profile, time_unit="units")) == [], "abstract units: no rate"


def test_the_flop_report_names_each_task_kind_its_rate_and_share_of_the_peak():
    from pipefisher.methods.flop_report import flop_report

    lines = flop_report(profile_from_dict(COUNTED))
    assert lines[0].startswith("K-FAC task FLOP/s") and "the device's dense peak" in lines[0]
    assert lines[1:] == [
        "  A factor curvature: 610 MFLOP per micro-batch in 0.610 ms, 1 TFLOP/s, no peak known for float32",
        "  A factor inverse: 2.8 GFLOP per inverse in 1.400 ms, 2 TFLOP/s, 50.0 % of the float64 peak (4 TFLOP/s)",
        "  B factor inverse: 1.4 GFLOP per inverse in 1.400 ms, 1 TFLOP/s, 25.0 % of the float64 peak (4 TFLOP/s)",
    ]
    measured = mutate(["flop_rates"], {**COUNTED["flop_rates"], "measured": True})
    measured["stages"] = COUNTED["stages"]
    assert "50.0 % of the measured float64 matmul (4 TFLOP/s)" in flop_report(profile_from_dict(measured))[2]
    assert flop_report(profile_from_dict(GOOD)) == []
    shampoo = mutate(["method"], "shampoo")
    shampoo["stages"] = COUNTED["stages"]
    assert [line.split(":")[0] for line in flop_report(profile_from_dict(shampoo))[2:]] == [
        "  left root",
        "  right root",
    ]
    muon = mutate(["method"], "muon")
    muon["stages"][0]["layers"][0]["flops"] = {"precondition": 5e8}
    assert flop_report(profile_from_dict(muon))[1].startswith("  orthogonalisation: 500 MFLOP per step in 0.100 ms")


def test_the_end_of_step_work_has_its_rate_over_its_stages_method_step_end(tmp_path):
    """A layer's ``step_end`` flops (its share of Shampoo's or SOAP's optimizer step) are timed by
    its stage's `method_step_end`: every layer's of a stage over that stage's time, summed."""
    from pipefisher.core.profile_flops import task_rates
    from pipefisher.methods.flop_report import flop_report

    soap = mutate(["method"], "soap")
    stage = soap["stages"][0]
    stage["step_end"], stage["method_step_end"] = 3.0, 2.0
    stage["layers"][0]["flops"] = {"step_end": 3e9}
    stage["layers"].append({**stage["layers"][0], "name": "other", "flops": {"step_end": 1e9}})
    profile = profile_from_dict(soap)
    profile.save(tmp_path / "p.yaml")
    assert load_profile(tmp_path / "p.yaml") == profile
    (rate,) = [rate for rate in task_rates(profile) if rate.work == "step_end"]
    assert (rate.part, rate.flops, rate.seconds) == (None, 4e9, pytest.approx(2e-3))
    assert "  its work in the end of step: 4 GFLOP per step in 2.000 ms, 2 TFLOP/s" in "\n".join(flop_report(profile))
    stage["method_step_end"] = 0.0
    assert not [rate for rate in task_rates(profile_from_dict(soap)) if rate.work == "step_end"], "untimed: no rate"
