"""Checkpoint manifests, verification, fallback and pruning (one process, two fake ranks)."""

import pytest
import torch

from pipefisher.config import config_from_dict
from pipefisher.runtime.training.checkpoint import (
    MANIFEST,
    CheckpointError,
    StateReader,
    commit,
    save_rank,
    step_folder,
)
from pipefisher.runtime.training.resumption import manifest_fields, resumable_step

CONFIG = config_from_dict({"pipeline": {"stages": 2}})


def save(directory, step, keep=2, ranks=2, config=CONFIG):
    """Save `step` as `ranks` processes of `config` would; the lines the commit says."""
    records = [
        save_rank(
            directory,
            step,
            rank,
            {f"local/{rank}/rng/host": torch.arange(100.0) + rank, f"model/w{rank}": torch.ones(3)},
        )
        for rank in range(ranks)
    ]
    return commit(directory, step, manifest_fields(config, None), records, keep)


def steps(directory):
    return sorted(int(p.name[5:]) for p in directory.glob("step-*"))


def test_a_saved_step_round_trips_and_verifies(tmp_path):
    save(tmp_path, 3)
    assert resumable_step(tmp_path, CONFIG) == (3, [])
    reader = StateReader(tmp_path, 3)
    assert torch.equal(reader.get("local/1/rng/host"), torch.arange(100.0) + 1) and reader.get("model/w9") is None
    assert (tmp_path / "latest").read_text().strip() == '{"step": 3}'


def test_a_step_without_its_manifest_is_skipped_and_said(tmp_path):
    save(tmp_path, 2)
    save_rank(tmp_path, 4, 0, {"partial": True})  # the run died before rank 1 saved and rank 0 committed
    step, skipped = resumable_step(tmp_path, CONFIG)
    assert step == 2 and skipped == [f"step 4: incomplete (no {MANIFEST}: stopped while saving)"]


def test_keep_counts_complete_steps_and_never_drops_the_new_one(tmp_path):
    for step in (1, 2, 3):
        save(tmp_path, step, keep=1)
    assert steps(tmp_path) == [3]
    save(tmp_path, 4, keep=2)
    assert steps(tmp_path) == [3, 4]


def test_committing_an_earlier_step_drops_the_abandoned_later_history(tmp_path):
    """After resuming from step 2 (step 4 was corrupt), saving step 3 removes step 4: it belongs to
    a history the run left, and must not count as one of the kept checkpoints."""
    save(tmp_path, 2, keep=1)
    save(tmp_path, 4, keep=2)
    save(tmp_path, 3, keep=1)
    assert steps(tmp_path) == [3]


def test_a_manifest_of_another_configuration_is_refused(tmp_path):
    save(tmp_path, 2)
    other = CONFIG.with_overrides(optimizer={"lr": 0.5})
    with pytest.raises(CheckpointError, match="optimizer.lr is 0.05 there and 0.5 here"):
        resumable_step(tmp_path, other)


def test_a_rank_file_missing_from_the_disk_is_named(tmp_path):
    save(tmp_path, 1)
    save(tmp_path, 2)
    (step_folder(tmp_path, 2) / "rank-1.pt").unlink()
    step, skipped = resumable_step(tmp_path, CONFIG)
    assert step == 1 and skipped == [f"step 2: {step_folder(tmp_path, 2) / 'rank-1.pt'}: missing"]


def test_retention_never_counts_a_step_that_no_longer_verifies(tmp_path):
    """Step 2 rots on disk (same size, other bytes): saving step 3 with keep 2 keeps 3 and 1, and
    moves 2 aside with one line; a resume never chooses it."""
    save(tmp_path, 1)
    save(tmp_path, 2)
    rank_file = step_folder(tmp_path, 2) / "rank-1.pt"
    rank_file.write_bytes(rank_file.read_bytes()[:-1] + b"x")
    moved = tmp_path / "corrupt-step-000002"
    assert save(tmp_path, 3) == [
        f"step 2 does not verify ({rank_file}: its SHA-256 differs from the manifest's (corrupt)): moved to {moved}"
    ]
    assert steps(tmp_path) == [1, 3] and (moved / "rank-1.pt").exists()
    save(tmp_path, 4)
    assert steps(tmp_path) == [3, 4]


def test_a_writer_sets_aside_the_steps_a_resume_skips_past_and_a_reader_does_not(tmp_path):
    save(tmp_path, 1)
    save(tmp_path, 2)
    (step_folder(tmp_path, 2) / "rank-0.pt").write_bytes(b"")
    assert resumable_step(tmp_path, CONFIG)[0] == 1 and steps(tmp_path) == [1, 2]
    step, skipped = resumable_step(tmp_path, CONFIG, writer=True)
    size = (tmp_path / "corrupt-step-000002" / "rank-1.pt").stat().st_size  # rank 0's was written alike
    assert step == 1 and steps(tmp_path) == [1]
    assert skipped == [
        f"step 2 does not verify ({step_folder(tmp_path, 2) / 'rank-0.pt'}: 0 bytes, the manifest says {size} "
        f"(truncated or overwritten)): moved to {tmp_path / 'corrupt-step-000002'}"
    ]
    (step_folder(tmp_path, 1) / "rank-1.pt").write_bytes(b"")
    with pytest.raises(CheckpointError, match="no checkpoint in .* to resume from"):
        resumable_step(tmp_path, CONFIG, writer=True)
    assert steps(tmp_path) == [1]  # no step to continue from: nothing is moved


def test_a_checkpoint_of_another_model_is_said_as_a_whole(tmp_path):
    """A GPT-2 checkpoint resumed with a BERT run file: not a key to set, another model."""
    save(
        tmp_path,
        2,
        config=config_from_dict({"model": {"kind": "hf", "hf_config": "gpt2-tiny"}, "data": {"kind": "causal"}}),
    )
    bert = config_from_dict({"model": {"kind": "bert", "preset": "bert-tiny"}, "data": {"kind": "bert"}})
    with pytest.raises(CheckpointError) as refused:
        resumable_step(tmp_path, bert)
    assert str(refused.value) == (
        f"the checkpoint in {tmp_path} is of another model (hf gpt2-tiny, causal data there; bert bert-tiny, "
        "bert data here); resume it with its own run file or give another --checkpoint-dir"
    )
