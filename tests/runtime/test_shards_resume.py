"""A run reading shards, stopped and resumed on another layout (2 stages of 1F1B -> 2 replicas of
one stage, the same 2 micro-batches a step), reads after the resumption the samples the
uninterrupted run read; the checkpoint records the data position, and a resumption over shards
that changed since is refused naming data.shards."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from pipefisher.config import config_from_dict
from pipefisher.data.corpus import embedded_corpus
from pipefisher.data.shards.format import MANIFEST
from pipefisher.data.tokenizer import train_byte_level_bpe
from pipefisher.runtime.training.checkpoint import CheckpointError, read_manifest, step_folder
from pipefisher.runtime.training.launch import run_group
from pipefisher.runtime.training.resumption import resumable_step, resumption
from pipefisher.runtime.training.trainer import build_executor, train_pipelined
from shard_folders import sentence_corpus, write_shards

pytestmark = pytest.mark.dist

STOP, STEPS, BATCH = 2, 4, 2


def reading(rank: int, world: int, config, resume: bool) -> tuple[list[float], dict]:
    """Train (from the newest checkpoint with `resume`); (losses, {(step, global micro-batch):
    input_ids} of the micro-batches this rank built)."""
    start = resumable_step(config.checkpoint.dir, config)[0] if resume else None
    executor, _ = build_executor(config, rank, torch.device("cpu"))
    seen, build = {}, executor.micro_batch

    def recorded(step: int, micro_batch: int):
        batch = build(step, micro_batch)
        seen[(step, micro_batch)] = batch["input_ids"].clone()
        return batch

    executor.micro_batch = recorded
    result = train_pipelined(config, rank, torch.device("cpu"), executor=executor, resume_from=start)
    return result.losses, seen


def run_file(folder, checkpoints, stages: int, data_parallel: int) -> dict:
    return {
        "model": {"kind": "hf", "hf_config": "gpt2-tiny", "seq_len": 16, "dropout": 0.0},
        "data": {"kind": "shards", "shards": str(folder), "micro_batch_size": BATCH, "seed": 3},
        "pipeline": {"stages": stages, "micro_batches": 2 // data_parallel, "data_parallel": data_parallel},
        "optimizer": {"name": "adamw", "lr": 0.01},
        "checkpoint": {"dir": str(checkpoints), "every": STOP, "keep": 3},
        "run": {"steps": STEPS, "timeout": 30, "master_port": 0, "in_order": True},
    }


def test_a_run_resumed_on_another_layout_reads_the_samples_it_would_have(tmp_path):
    pytest.importorskip("transformers")
    documents = embedded_corpus()[:60]
    tokenizer = train_byte_level_bpe(documents, 300, tmp_path / "cache")
    folder, checkpoints = tmp_path / "shards", tmp_path / "checkpoints"
    write_shards(folder, {"train": sentence_corpus(documents, tokenizer)}, tokenizer)

    whole = config_from_dict(run_file(folder, checkpoints, stages=2, data_parallel=1))
    straight = run_group(reading, 2, args=(whole, False), timeout=30, deadline=240)
    assert read_manifest(step_folder(checkpoints, STOP))["data"]["samples"] == STOP * 2 * BATCH
    shutil.rmtree(step_folder(checkpoints, STEPS))
    other = config_from_dict(run_file(folder, checkpoints, stages=1, data_parallel=2))
    resumed = run_group(reading, 2, args=(other, True), timeout=30, deadline=240)

    expected = {key: ids for _, seen in straight for key, ids in seen.items() if STOP <= key[0] < STEPS}
    read = {key: ids for _, seen in resumed for key, ids in seen.items() if key[0] < STEPS}
    assert read.keys() == expected.keys() == {(step, mb) for step in range(STOP, STEPS) for mb in range(2)}
    assert all(torch.equal(read[key], expected[key]) for key in expected)
    torch.testing.assert_close(torch.tensor(resumed[0][0]), torch.tensor(straight[0][0][STOP:]), rtol=1e-4, atol=0)

    changed = tmp_path / "changed"
    shutil.copytree(folder, changed)
    manifest = json.loads((changed / MANIFEST).read_text())
    manifest["splits"]["train"]["sha256"]["tokens.bin"] = "0" * 64
    (changed / MANIFEST).write_text(json.dumps(manifest))
    moved = config_from_dict(run_file(changed, checkpoints, stages=1, data_parallel=2))
    with pytest.raises(CheckpointError, match=r"data\.shards: the shards in .*changed since the checkpoint"):
        resumption(checkpoints, STOP, moved)
    assert resumption(checkpoints, STOP, config_from_dict(run_file(folder, checkpoints, 1, 2))).step == STOP
