"""Tensor parallelism as the planning code sees it: which Linear layers are split, how, and the
shapes of their shards. Pure Python: no torch.

Megatron's split of a transformer block over T tensor-parallel ranks: the attention's query, key
and value and the MLP's first projection are split by output features (`Split.COLUMN`: shard t
holds rows t·out/T .. (t+1)·out/T of the weight and the same slice of the bias, so attention heads
are dealt out whole); the attention's and the MLP's output projections by input features
(`Split.ROW`: shard t holds columns t·in/T .. (t+1)·in/T of the weight; the bias, added once after
the sum over shards, lives on shard 0). Everything else (embeddings, LayerNorms, heads) is
replicated: every tensor-parallel rank holds it whole.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from enum import Enum


class Split(str, Enum):
    """How a Linear layer (weight of shape (outputs, inputs)) is cut over the tensor-parallel ranks."""

    COLUMN = "column"
    ROW = "row"


#: a model's tensor-parallel plan: module-name globs -> how those Linear layers are split
TensorParallelPlan = Mapping[str, Split]

#: the split of each Linear layer of a transformer block, by the names of
#: `pipefisher.planning.transformer_profile.BLOCK_LAYERS`
BLOCK_SPLITS: dict[str, Split] = {
    "attention.query": Split.COLUMN,
    "attention.key": Split.COLUMN,
    "attention.value": Split.COLUMN,
    "attention.output": Split.ROW,
    "intermediate": Split.COLUMN,
    "output": Split.ROW,
}


def split_of(name: str, plan: TensorParallelPlan) -> Split | None:
    """How the module called `name` is split under `plan` (its first glob that matches it dot-part
    by dot-part, as `parallelize_module` matches), None when replicated."""
    return next((split for pattern, split in plan.items() if module_matches(name, pattern)), None)


def module_matches(name: str, pattern: str) -> bool:
    """Whether the module called `name` matches the glob `pattern` dot-part by dot-part ("blocks.*"
    matches "blocks.2", not "blocks.2.norm1")."""
    parts, globs = name.split("."), pattern.split(".")
    return len(globs) == len(parts) and all(fnmatch.fnmatchcase(part, glob) for part, glob in zip(parts, globs))


def split_dim(split: Split) -> int:
    """The dimension of a Linear weight (outputs, inputs) that `split` cuts."""
    return 0 if split is Split.COLUMN else 1


def shard_range(size: int, degree: int, index: int) -> tuple[int, int]:
    """[start, stop) of shard `index` of `degree` equal shards of `size` features; ValueError
    unless `degree` divides `size`."""
    if size % degree:
        raise ValueError(f"{size} features cannot be split into {degree} equal tensor-parallel shards")
    width = size // degree
    return index * width, (index + 1) * width


def shard_features(inputs: int, outputs: int, split: Split | None, degree: int) -> tuple[int, int]:
    """(inputs, outputs) of one shard of a Linear layer of `inputs` -> `outputs` features."""
    if split is Split.COLUMN:
        return inputs, shard_range(outputs, degree, 0)[1]
    if split is Split.ROW:
        return shard_range(inputs, degree, 0)[1], outputs
    return inputs, outputs


def holds_bias(split: Split | None, index: int) -> bool:
    """Whether tensor-parallel rank `index` holds the layer's bias (a row-split layer's is on shard 0)."""
    return split is not Split.ROW or index == 0
