"""The BERT harness: pipelined BERT equals the unsplit model; checkpoints resume bit for bit."""

import json
import subprocess
from pathlib import Path

import pytest
import torch

from _workers import bert_one_step, checkpointing, dies_while_saving
from pipefisher.config import config_from_dict
from pipefisher.runtime.training.assembly import data_source, staged_model
from pipefisher.runtime.training.launch import GroupFailure, run_group

pytestmark = pytest.mark.dist
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("bert-cache"))


def bert_config(cache, schedule="1f1b", **sections):
    data = {
        "model": {"kind": "bert", "preset": "bert-4x128", "seq_len": 16, "dropout": 0.0},
        "data": {"kind": "bert", "vocab_size": 300, "micro_batch_size": 2, "cache_dir": cache},
        "pipeline": {"schedule": schedule, "stages": 2, "micro_batches": 4},
        "optimizer": {"name": "sgd", "lr": 1.0},
        "run": {"steps": 1, "timeout": 60, "master_port": 0, "in_order": True},
    }
    for name, values in sections.items():
        data.setdefault(name, {}).update(values)
    return config_from_dict(data)


def unsplit_after_one_step(config):
    """Loss and parameters after one SGD step (lr 1: parameters minus gradients) of the unsplit
    BERT, started from the split stages' initial weights."""
    model = staged_model(config)
    stages = [model.build_stage(i, config.model_chunks, config.run.seed) for i in range(config.model_chunks)]
    whole = model.build_stage(0, 1, config.run.seed)
    state = {}
    for stage in stages:
        state.update(stage.state_dict())
    whole.load_state_dict(state, strict=True)
    micro_batch = data_source(config)
    total = config.pipeline.micro_batches
    step_loss = 0.0
    for index in range(total):
        batch = micro_batch(0, index)
        loss = model.loss(whole(None, batch), batch)[0] / total
        loss.backward()
        step_loss += float(loss.detach())
    with torch.no_grad():
        for parameter in whole.parameters():
            parameter -= parameter.grad
    return step_loss, dict(whole.named_parameters(remove_duplicate=False))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved", "chimera"])
def test_pipelined_bert_equals_the_unsplit_model(schedule, cache):
    config = bert_config(cache, schedule)
    loss, expected = unsplit_after_one_step(config)
    results = run_group(bert_one_step, 2, args=(config,), timeout=60, deadline=240)
    seen = set()
    for result in results:
        assert result.losses[0] == pytest.approx(loss, rel=1e-5)
        for key, value in result.parameters.items():
            name = key.split(".", 2)[2] if key.startswith("p1.") else key.split(".", 1)[1]
            torch.testing.assert_close(value, expected[name].detach(), rtol=1e-4, atol=1e-5)
            seen.add(name)
    assert "cls.predictions.decoder.weight" in seen and "embeddings.word_embeddings.weight" in seen
    assert {name for name in expected} <= seen


def test_a_run_with_dropout_repeats_exactly(cache):
    """Each rank's random stream (dropout) starts from (run.seed, rank)."""
    config = bert_config(cache, model={"dropout": 0.1})

    def losses():
        return [result.losses for result in run_group(bert_one_step, 2, args=(config,), timeout=60, deadline=240)]

    assert losses() == losses()


@pytest.mark.parametrize("optimizer", ["lamb", "kfac"])
def test_resume_continues_bit_for_bit(optimizer, cache, tmp_path):
    sections = {
        "optimizer": {
            "name": optimizer,
            "lr": 0.01,
            "momentum": 0.9 if optimizer == "kfac" else 0.0,
            "warmup_steps": 2,
            "decay": "linear",
            "decay_steps": 6,
            "clip_norm": 1.0,
        },
        "kfac": {"refresh_steps": 2, "damping": 0.03},
        "checkpoint": {"dir": str(tmp_path / "ck"), "every": 3},
        "run": {"steps": 6},
    }
    straight = run_group(
        checkpointing,
        2,
        args=(bert_config(cache, "1f1b", **{**sections, "checkpoint": {"dir": str(tmp_path / "straight")}}), False),
        timeout=60,
        deadline=240,
    )
    config = bert_config(cache, "1f1b", **sections)
    first = run_group(checkpointing, 2, args=(config.with_overrides(run={"steps": 3}), False), timeout=60, deadline=240)
    second = run_group(checkpointing, 2, args=(config, True), timeout=60, deadline=240)
    assert first[0].losses + second[0].losses == straight[0].losses  # exactly equal
    for resumed, whole in zip(second, straight):
        for key, value in resumed.parameters.items():
            assert torch.equal(value, whole.parameters[key])


def test_a_run_killed_while_writing_a_checkpoint_leaves_the_previous_one_usable(cache, tmp_path):
    folder = tmp_path / "ck"
    config = bert_config(
        cache,
        "gpipe",
        optimizer={"name": "lamb", "lr": 0.01},
        checkpoint={"dir": str(folder), "every": 3},
        run={"steps": 6},
    )
    with pytest.raises(GroupFailure):
        run_group(dies_while_saving, 2, args=(config, 6), timeout=10, deadline=120)
    assert json.loads((folder / "latest").read_text())["step"] == 3
    resumed = run_group(checkpointing, 2, args=(config, True), timeout=60, deadline=240)
    straight = run_group(
        checkpointing,
        2,
        args=(config.with_overrides(checkpoint={"dir": str(tmp_path / "other")}), False),
        timeout=60,
        deadline=240,
    )
    assert resumed[0].losses == straight[0].losses[3:]


def run_tiny(*args, timeout=600):
    return subprocess.run(
        ["pipefisher", "run", str(ROOT / "schedules" / "tiny-cpu.yaml"), "--master-port", "0", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_the_demo_learns_on_the_embedded_corpus():
    result = run_tiny("--steps", "25", "--json")
    assert result.returncode == 0, result.stderr[-2000:]
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    first, last = sum(line["mlm"] for line in lines[:5]) / 5, sum(line["mlm"] for line in lines[-5:]) / 5
    assert last < first - 0.8, f"MLM loss fell only from {first:.3f} to {last:.3f}"
    assert all(line["tokens_per_s"] > 0 and "lr" in line for line in lines)


@pytest.mark.slow
def test_the_demo_learns_with_kfac_and_its_shipped_settings():
    """The run file's kfac section (lr, momentum, damping tuned by experiments/convergence.py)."""
    result = run_tiny("--optimizer", "kfac", "--steps", "20", "--json")
    assert result.returncode == 0, result.stderr[-2000:]
    mlm = [json.loads(line)["mlm"] for line in result.stdout.splitlines()]
    assert mlm[-1] < mlm[0] - 1.0, f"MLM loss fell only from {mlm[0]:.3f} to {mlm[-1]:.3f}"


def test_resume_from_another_configuration_is_refused(cache, tmp_path):
    folder = tmp_path / "ck"
    config = bert_config(cache, "1f1b", checkpoint={"dir": str(folder)}, run={"steps": 1})
    run_group(checkpointing, 2, args=(config, False), timeout=60, deadline=240)
    other = tmp_path / "other.yaml"
    other.write_text((ROOT / "schedules" / "tiny-cpu.yaml").read_text())
    result = subprocess.run(
        ["pipefisher", "run", str(other), "--checkpoint-dir", str(folder), "--resume", "--steps", "3"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "is from another configuration" in result.stderr and result.stderr.count("\n") <= 2


@pytest.mark.parametrize(
    "content, message",
    [
        (
            "model:\n  kind: bert\n  preset: bert-tiny\ndata:\n  kind: bert\npipeline:\n  stages: 4\n  micro_batches: 4\n",
            "2 BERT layers cannot be split into 4 equal stages",
        ),
        ("model:\n  kind: bert\n  preset: bert-huge\ndata:\n  kind: bert\n", "preset: 'bert-huge' is not one of"),
        ("model:\n  kind: bert\ndata:\n  kind: synthetic\n", "data.kind: 'synthetic' does not fit model.kind 'bert'"),
        ("model:\n  kind: bert\ndata:\n  kind: bert\n  mask_prob: 2\n", "data.mask_prob: 2"),
        ("model:\n  kind: bert\n  seq_len: many\ndata:\n  kind: bert\n", "model.seq_len: expected an integer"),
    ],
)
def test_bad_bert_run_files_exit_2_naming_the_key(tmp_path, content, message):
    path = tmp_path / "bad.yaml"
    path.write_text(content)
    result = subprocess.run(["pipefisher", "run", str(path)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and result.stderr.count("\n") == 1, result.stderr
