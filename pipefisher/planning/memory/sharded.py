"""One stage copy's parameter and gradient bytes and FSDP traffic per rank under ZeRO-2/3
(`optimizer.zero` 2 or 3: PyTorch FSDP2 over the stage's R data-parallel replicas,
`pipefisher.runtime.training.fsdp_wrap`). Pure Python: no torch.

What is modelled (docs/zero_memory.md, "What the memory model counts"):

- shards: FSDP2 splits every parameter on its first dimension into R chunks of ceil(rows / R)
  rows and keeps each rank's chunk padded to that size (without its shape: ceil(numel / R)
  elements); the rank with the most holds that many (`shard_elements`);
- parameters: the shards at rest. ZeRO-2 (`reshard_after_forward=False`, resharded only after the
  step's last backward) also holds the whole stage gathered from the step's first forward to its
  last backward, for the whole step's peak (`gathered_bytes`, held: it adds over the rank's
  stages). ZeRO-3 (`reshard_after_forward=True`) gathers one FSDP unit at a time: the units are
  the stage's repeated blocks (`StageState.blocks`) and the rest (embeddings, heads, final norms:
  the root unit, gathered for the whole of each forward and backward of the stage, since the
  blocks run inside it). At the peak, in a backward, it holds the rest, the block running and the
  block FSDP2 prefetches by default (its ``backward_prefetch`` of one unit): rest + the two
  largest blocks (`gathered_bytes`, per op: a rank runs one op at a time, so over its stages
  the largest counts, not the sum). Without blocks the whole stage is one unit: gathered whole;
- gradients: FSDP's gradient sync is off but in the stage's last backward of the step, so each
  replica accumulates its whole unreduced gradient over the micro-batches (`unreduced_bytes`,
  the in-step peak) and reduce-scatters it once; after that, at the optimizer step, it holds the
  shards (`gradient_bytes`);
- traffic (bytes sent per step, ring model): one reduce-scatter of the gradient, and the
  all-gathers of the parameters: once per step (ZeRO-2), before every forward and every backward
  of each of the stage's micro-batches (ZeRO-3).

Not counted: a unit's fresh gradient before it is added to the accumulated one, the
reduce-scatter's and all-gather's staging buffers, FSDP2's implicit forward prefetch on GPUs
(the CPU issuing the next block's all-gather while one computes: at most the backward's two
blocks again).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pipefisher.planning.comm.volume import ring_bytes

#: the FSDP units FSDP2 gathers at once in a backward besides the root: the one running and the
#: one it prefetches
BACKWARD_UNITS = 2


def shard_elements(numel: int, shape: tuple[int, ...], replicas: int) -> int:
    """Elements of the largest of `replicas` FSDP2 shards of a parameter of `numel` elements and
    `shape` (() when unknown: the flat tensor): ceil(rows / R) rows of the rest each."""
    if replicas < 1:
        raise ValueError(f"replicas: {replicas}; a stage has at least one")
    if not shape:
        return -(-numel // replicas)
    rows = shape[0]
    return -(-rows // replicas) * (numel // rows if rows else 0)


@dataclass(frozen=True)
class ShardedBytes:
    """A rank's bytes of one sharded stage copy: `shards` (elements per parameter, in order),
    `parameter_bytes` and `gradient_bytes` at the optimizer step (its shards),
    `gathered_bytes` whole parameters gathered beside the shards at the peak (`per_op`: only
    while one of the stage's ops runs, ZeRO-3), `unreduced_bytes` its whole gradient accumulated
    before the reduce-scatter, `traffic` bytes sent per step."""

    shards: tuple[int, ...]
    parameter_bytes: int
    gradient_bytes: int
    gathered_bytes: int
    per_op: bool
    unreduced_bytes: int
    traffic: int


def sharded_stage(
    parameters: Sequence[int],
    shapes: Sequence[tuple[int, ...]],
    blocks: Sequence[int],
    replicas: int,
    zero: int,
    micro_batches: int,
    parameter_width: int = 4,
    gradient_width: int = 4,
) -> ShardedBytes:
    """The bytes of one stage copy of `parameters` (element counts; `shapes` in the same order or
    empty; `blocks` element counts of its repeated blocks, the FSDP units) on one of `replicas`
    ranks under ZeRO `zero` (2 or 3), the stage running `micro_batches` forwards per step."""
    if zero not in (2, 3):
        raise ValueError(f"zero: {zero} is not sharded by FSDP2; use 2 or 3")
    numel = sum(parameters)
    if sum(blocks) > numel:
        raise ValueError(f"blocks: {sum(blocks)} elements, more than the stage's {numel}")
    shards = tuple(
        shard_elements(count, tuple(shapes[index]) if shapes else (), replicas)
        for index, count in enumerate(parameters)
    )
    if zero == 2:
        gathered = numel
    elif blocks:
        gathered = numel - sum(blocks) + sum(sorted(blocks, reverse=True)[:BACKWARD_UNITS])
    else:
        gathered = numel
    gathers = 1 if zero == 2 else 2 * micro_batches
    traffic = ring_bytes("reduce", numel * gradient_width, replicas) + gathers * ring_bytes(
        "broadcast", numel * parameter_width, replicas
    )
    return ShardedBytes(
        shards,
        sum(shards) * parameter_width,
        sum(shards) * gradient_width,
        gathered * parameter_width,
        zero == 3,
        numel * gradient_width,
        traffic,
    )
