"""Checkpoint manifests, verification, fallback and pruning (one process, two fake ranks)."""

import pytest
import torch

from pipefisher.config import config_from_dict
from pipefisher.runtime.training.checkpoint import MANIFEST, CheckpointError, StateReader, commit, save_rank, step_folder
from pipefisher.runtime.training.resumption import manifest_fields, resumable_step

CONFIG = config_from_dict({"pipeline": {"stages": 2}})


def save(directory, step, keep=2, ranks=2):
    records = [save_rank(directory, step, rank, {f"local/{rank}/rng/host": torch.arange(100.0) + rank, f"model/w{rank}": torch.ones(3)})
               for rank in range(ranks)]
    commit(directory, step, manifest_fields(CONFIG, None), records, keep)


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
