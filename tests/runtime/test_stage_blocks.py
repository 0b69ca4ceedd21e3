"""Uneven stage splits (`pipeline.stage_blocks`): a stage's blocks counted per stage instead of
dealt evenly, e.g. to lighten the stage that holds a model's head. The pipelined run equals the
single-process reference (a Hugging Face GPT-2 against its unsplit model; the regression
transformer with K-FAC packed into the bubbles); a checkpoint of an even split resumes on an
uneven one; bad counts are refused by name; the memory model counts each stage's own blocks."""

import copy
from pathlib import Path

import pytest

from pipefisher.config import ConfigError, config_from_dict
from pipefisher.core.stage_split import stage_block_ranges
from pipefisher.planning.memory.activations import ModelShape, micro_batch_bytes
from pipefisher.planning.memory.peak import stage_activation_bytes
from pipefisher.runtime.training.assembly import staged_model
from pipefisher.testing.harness import assert_equal_to_reference

ROOT = Path(__file__).resolve().parents[2]


def test_ranges_follow_the_counts_or_deal_the_blocks_evenly():
    assert stage_block_ranges(4, 2) == [range(0, 2), range(2, 4)]
    assert stage_block_ranges(4, 2, (3, 1)) == [range(0, 3), range(3, 4)]
    assert stage_block_ranges(6, 3, (1, 4, 1)) == [range(0, 1), range(1, 5), range(5, 6)]
    with pytest.raises(ValueError, match=r"stage_blocks: \[3, 2\] is not 2 counts of at least 1 block summing to 4"):
        stage_block_ranges(4, 2, (3, 2))
    with pytest.raises(ValueError, match="num_stages: 3 does not divide the 4 blocks"):
        stage_block_ranges(4, 3)


def transformer(stage_blocks=(3, 1), **sections) -> dict:
    base = {
        "model": {"kind": "transformer", "layers": 4, "hidden": 16, "heads": 2, "ffn": 32, "seq_len": 8},
        "data": {"micro_batch_size": 2},
        "pipeline": {"schedule": "1f1b", "stages": 2, "micro_batches": 4, "stage_blocks": list(stage_blocks)},
        "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
        "run": {"steps": 3, "timeout": 60, "master_port": 0, "in_order": True},
    }
    for section, values in sections.items():
        base[section] = {**base.get(section, {}), **values}
    return base


def test_bad_counts_are_refused_by_name(tmp_path):
    with pytest.raises(
        ConfigError, match=r"^pipeline\.stage_blocks: 3 counts for 2 model stages \(pipeline\.stages 2\)"
    ):
        config_from_dict(transformer((1, 2, 1)))
    with pytest.raises(ConfigError, match=r"^pipeline\.stage_blocks: \[3, 2\] sums to 5, but the model has 4 blocks"):
        config_from_dict(transformer((3, 2)))
    with pytest.raises(ConfigError, match=r"^pipeline\.stage_blocks\[1\]: 0 must be >= 1"):
        config_from_dict(transformer((4, 0)))
    gpt2 = {
        "model": {"kind": "hf", "hf_config": "gpt2-tiny", "seq_len": 16},
        "data": {"kind": "causal", "vocab_size": 300, "cache_dir": str(tmp_path)},
        "pipeline": {"stages": 2, "stage_blocks": [4, 1]},
    }
    with pytest.raises(ConfigError, match=r"^pipeline\.stage_blocks: \[4, 1\] sums to 5, but the model has 4 blocks"):
        staged_model(config_from_dict(gpt2))


def test_each_stage_holds_its_counted_blocks(tmp_path):
    config = config_from_dict(
        {
            "model": {"kind": "hf", "hf_config": "gpt2-tiny", "seq_len": 16},
            "data": {"kind": "causal", "vocab_size": 300, "cache_dir": str(tmp_path)},
            "pipeline": {"stages": 2, "stage_blocks": [3, 1]},
        }
    )
    model = staged_model(config)
    blocks = [
        sorted({name.split(".")[2] for name, _ in model.build_stage(index, 2, 0).named_parameters() if ".h." in name})
        for index in range(2)
    ]
    assert blocks == [["0", "1", "2"], ["3"]]
    assert model.stage_ends(2) == ["transformer.h.2"], "the reference rounds activations where the split cuts"


def test_the_memory_model_counts_each_stages_own_blocks():
    even = ModelShape("gpt2", 4, 64, 4, 256, 300, 16)
    uneven = ModelShape("gpt2", 4, 64, 4, 256, 300, 16, stage_blocks=(3, 1))
    kept_even, _, _ = stage_activation_bytes(even, 2, 2)
    kept, _, _ = stage_activation_bytes(uneven, 2, 2)
    assert kept[0] == micro_batch_bytes(uneven, 3, True, False, 2, "fp32", "none", 1, False)
    assert kept[1] == micro_batch_bytes(uneven, 1, False, True, 2, "fp32", "none", 1, False)
    assert kept[0] > kept_even[0] and kept[1] < kept_even[1]


@pytest.mark.dist
def test_an_uneven_gpt2_equals_the_unsplit_model(tmp_path):
    from test_hf_runs import assert_equals_the_unsplit_model, hf_run

    assert_equals_the_unsplit_model(hf_run(str(tmp_path), pipeline={"stage_blocks": [3, 1]}))


@pytest.mark.dist
def test_kfac_packed_on_uneven_stages_equals_the_reference():
    kfac = {"lr": 0.05, "damping": 0.01, "refresh_steps": 2, "placement": "packed", "first_order": "sgd"}
    assert_equal_to_reference(config_from_dict(transformer((1, 3), optimizer={"name": "kfac"}, kfac=kfac)))


@pytest.mark.dist
@pytest.mark.parametrize("schedule", ["interleaved", "dualpipev"])
def test_model_chunks_on_uneven_pieces_equal_the_reference(schedule):
    """6 blocks on 2 ranks x 2 chunks (pieces that `plan` proposes where they do not divide the
    blocks): the interleaved rank holds pieces 0 and 2, the V-shaped one pieces 0 and 3."""
    config = transformer(
        (1, 2, 2, 1),
        model={"layers": 6},
        pipeline={"schedule": schedule, "chunks": 2} if schedule == "interleaved" else {"schedule": schedule},
    )
    assert_equal_to_reference(config_from_dict(config))


@pytest.mark.dist
def test_an_even_checkpoint_resumes_on_an_uneven_split(tmp_path):
    from test_relayout import assert_continues, run_file

    before = run_file("adamw")
    after = copy.deepcopy(before)
    after["pipeline"]["stage_blocks"] = [3, 1]
    assert_continues(before, after, tmp_path)


def test_a_profile_of_the_even_split_is_cut_to_the_runs_split():
    """What `pipefisher plan` proposes runs with the profile it predicted from: a K-FAC run on
    [3, 1] takes the shipped even-split profile cut by block (the planner's cut), and a profile
    of other layers is still refused by name."""
    from dataclasses import replace

    from pipefisher.config import load_config
    from pipefisher.core.profile import ProfileError, load_profile
    from pipefisher.planning.planner.model_sizes import model_sizes
    from pipefisher.planning.planner.sources import resplit
    from pipefisher.runtime.training.run_profile import run_profile, stage_layer_names

    config = load_config(ROOT / "schedules" / "tiny-cpu.yaml").with_overrides(
        optimizer={"name": "kfac"}, pipeline={"stage_blocks": [3, 1]}
    )
    even = load_profile(ROOT / "profiles" / "tiny-cpu-1f1b.yaml")
    cut = run_profile(even, config, 2)
    assert [[layer.name for layer in stage.layers] for stage in cut.stages] == [
        stage_layer_names(config, stage, 2) for stage in range(2)
    ]
    assert cut == resplit(even, 2, model_sizes(config), (3, 1))
    assert run_profile(cut, config, 2) is cut  # measured at the run's own split: taken as it is
    fewer = replace(even, stages=(even.stages[0], replace(even.stages[1], layers=even.stages[1].layers[1:])))
    with pytest.raises(ProfileError, match=r"stages\[0\]\.layers do not match the model"):
        run_profile(fewer, config, 2)


@pytest.mark.dist
def test_a_kfac_run_on_a_proposed_split_packs_from_the_even_profile():
    from pipefisher.cli.main import main

    argv = ["run", str(ROOT / "schedules" / "tiny-cpu.yaml"), "--optimizer", "kfac", "--steps", "2"]
    argv += ["--master-port", "0", "--pipeline.stage_blocks", "[3, 1]"]
    argv += ["--profile", str(ROOT / "profiles" / "tiny-cpu-1f1b.yaml")]
    assert main(argv) == 0


def test_the_split_is_part_of_the_layout_not_of_the_run():
    from pipefisher.runtime.training.resumption import manifest_fields

    fields = manifest_fields(config_from_dict(transformer()), None)
    assert fields["layout"]["pipeline.stage_blocks"] == [3, 1]
    assert "pipeline.stage_blocks" not in fields["config"]


@pytest.mark.slow
@pytest.mark.dist
def test_the_split_plan_proposes_runs_from_the_profile_it_planned_with(tmp_path, capsys):
    """The user's path on GPT-2 tiny (a 4,000-word head on its last stage): profile the run file
    with K-FAC on its even split; `plan` on that profile proposes 1F1B on two stages split 3/1
    beside the even split; the run file the planner writes for it trains with the same profile.
    The profile's stage times are set in proportion to their flops (a quiet machine's), so the
    split does not depend on this machine's load; the ranking, which would, is not asserted."""
    import json
    from dataclasses import replace

    import yaml

    from pipefisher.cli.main import main
    from pipefisher.config import load_config
    from pipefisher.core.profile import load_profile
    from pipefisher.planning.planner.candidates import Layout
    from pipefisher.planning.planner.model_sizes import model_sizes
    from pipefisher.planning.planner.sources import part_flops
    from pipefisher.planning.planner.table import run_file_of

    profile, chosen = tmp_path / "profile.yaml", tmp_path / "chosen.yaml"
    run_file = ROOT / "schedules" / "gpt2-tiny-cpu.yaml"
    assert main(["profile", str(run_file), "--optimizer", "kfac", "--repeats", "2", "-o", str(profile)]) == 0
    measured = load_profile(profile)
    block, head = part_flops(model_sizes(load_config(run_file)))
    work = (2 * block, 2 * block + head)  # forward flops per sequence of each stage
    stages = tuple(
        replace(stage, forward=flops * 1e-7, backward=2 * flops * 1e-7, samples={})
        for stage, flops in zip(measured.stages, work)
    )
    replace(measured, stages=stages).save(profile)
    plan = ["plan", str(run_file), "--gpus", "2", "--memory-gb", "16", "--profile", str(profile), "--jobs", "1"]
    capsys.readouterr()
    assert (
        main([*plan, "--method", "kfac", "--max-tensor-parallel", "1", "--top", "64", "--packed", "64", "--json"]) == 0
    )
    ranked = [row["layout"] for row in json.loads(capsys.readouterr().out)["ranked"]]
    pipelines = [row for row in ranked if row["schedule"] == "1f1b" and row["stages"] == 2]
    assert {tuple(row["stage_blocks"]) for row in pipelines} >= {(3, 1), ()}
    proposed = next(row for row in pipelines if row["stage_blocks"])
    layout = Layout(**{**proposed, "stage_blocks": tuple(proposed["stage_blocks"])})
    chosen.write_text(run_file_of(yaml.safe_load(run_file.read_text()), layout))
    assert main(["run", str(chosen), "--steps", "2", "--master-port", "0", "--profile", str(profile)]) == 0
