"""Where a run stands in its shard data, saved with each checkpoint and checked on resume: the
samples consumed, the SHA-256 of the folder's train/tokens.bin (from its manifest: nothing is
hashed again) and the data seed. Sample indices are global (`pipefisher.data.shards.order`), so a
run resumed on another layout reads on from the same sample. Pure Python and numpy."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pipefisher.data.shards.format import TOKENS, Manifest


@dataclass(frozen=True)
class DataPosition:
    """`samples`: samples consumed (steps × micro-batches per step × micro-batch size);
    `tokens_sha256`: the manifest's digest of train/tokens.bin; `seed`: the data seed."""

    samples: int
    tokens_sha256: str
    seed: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def data_position(folder: str | Path, seed: int, samples: int) -> DataPosition:
    """The position after `samples` samples of the train split of the prepared `folder` (ShardError
    if it is not one)."""
    info = Manifest.read(folder).splits.get("train")
    return DataPosition(samples, info.sha256.get(TOKENS, "") if info is not None else "", seed)


def position_problem(saved: dict[str, Any] | None, current: DataPosition, folder: str | Path) -> str:
    """Why a run at `current` cannot continue from the checkpoint's `saved` position (its
    `DataPosition.to_dict`, None when it saved none), in one line; "" when it can."""
    if saved is None:
        return "the checkpoint records no shard position (it was not written by a run reading shards)"
    if saved.get("tokens_sha256") != current.tokens_sha256:
        return (
            f"the shards in {folder} changed since the checkpoint was written (train/{TOKENS} SHA-256 "
            f"{str(saved.get('tokens_sha256'))[:12]}… there, {current.tokens_sha256[:12]}… here); "
            "give data.shards the folder the run was trained on"
        )
    if saved.get("seed") != current.seed or saved.get("samples") != current.samples:
        return (
            f"the checkpoint read {saved.get('samples')} samples at data seed {saved.get('seed')}; this run would "
            f"continue after {current.samples} at seed {current.seed}: keep data.seed, data.micro_batch_size and the "
            "micro-batches per step"
        )
    return ""
