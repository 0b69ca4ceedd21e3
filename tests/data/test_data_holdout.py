"""Held-out documents: an even, seed-independent split by document that training never sees, and
the reference trainer's evaluation on them between steps."""

from pathlib import Path

import numpy as np
import pytest

from pipefisher.config import ConfigError, load_config
from pipefisher.data.holdout import held_out_indices, split_documents
from pipefisher.runtime.training.assembly import data_source, held_out_batches, text_data
from pipefisher.runtime.training.reference import Evaluation, train_reference

ROOT = Path(__file__).resolve().parents[2]


def test_the_held_out_share_is_spread_evenly_and_the_same_every_time():
    assert held_out_indices(10, 0.0) == []
    assert held_out_indices(10, 0.2) == [4, 9]
    assert held_out_indices(7, 0.5) == held_out_indices(7, 0.5) and len(held_out_indices(7, 0.5)) == 4
    with pytest.raises(ValueError, match="holdout"):
        held_out_indices(10, 1.0)


def test_split_documents_partitions_the_corpus_in_order():
    documents = [[f"Sentence {i} a.", f"Sentence {i} b."] for i in range(20)]
    train, held = split_documents(documents, 0.25)
    assert len(held) == 5 and len(train) == 15
    assert sorted(train + held) == sorted(documents) and not {tuple(d) for d in train} & {tuple(d) for d in held}
    assert split_documents(documents, 0.0) == (documents, [])
    with pytest.raises(ValueError, match="holdout"):
        split_documents(documents[:1], 0.4)


def _gpt2(tmp_path, **data):
    return load_config(ROOT / "schedules" / "gpt2-tiny-cpu.yaml").with_overrides(
        model={"seq_len": 16},
        data={"vocab_size": 600, "micro_batch_size": 2, "cache_dir": str(tmp_path), **data},
        pipeline={"micro_batches": 2},
        run={"steps": 3},
    )


def test_training_never_sees_a_held_out_sequence_and_evaluation_batches_ignore_the_seed(tmp_path):
    config = _gpt2(tmp_path, holdout=0.1)
    trained = {tuple(row) for row in text_data(config).sequences.tolist()}
    batches = held_out_batches(config, 3)
    held = [tuple(row) for batch in batches for row in batch["input_ids"].tolist()]
    assert len(held) == 6 and not trained & set(held)
    other_seed = held_out_batches(config.with_overrides(data={"seed": 5}), 3)
    for a, b in zip(batches, other_seed):
        np.testing.assert_array_equal(a["input_ids"], b["input_ids"])
    assert len(text_data(_gpt2(tmp_path)).sequences) > len(text_data(config).sequences), (
        "holdout 0 trains on the whole corpus"
    )
    with pytest.raises(ConfigError, match="data.holdout"):
        held_out_batches(_gpt2(tmp_path), 3)


def test_evaluation_between_steps_sees_the_training_forward_and_changes_nothing(tmp_path):
    config = _gpt2(tmp_path, holdout=0.1)
    first_step = [data_source(config)(0, index) for index in range(config.pipeline.micro_batches)]
    reports: list[tuple[int, dict]] = []
    evaluated = train_reference(
        config, evaluation=Evaluation(2, first_step, lambda step, parts: reports.append((step, parts)))
    )
    plain = train_reference(config)
    assert evaluated.losses == plain.losses
    assert [step for step, _ in reports] == [0, 2, 3]
    assert reports[0][1]["loss"] == pytest.approx(plain.losses[0], rel=1e-6), (
        "step 1's loss is the untrained model's on those batches"
    )
    assert reports[-1][1]["loss"] < reports[0][1]["loss"]
