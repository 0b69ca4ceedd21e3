"""Where a layout's per-stage times come from. Pure Python: no torch.

- `ReferenceTimes`: a per-block CSV (the paper's P100 block times, `profiles/reference/`) gives a
  profile at any split, micro-batch size (its `bs` rows) and tensor-parallel degree
  (`transformer_profile`). It times K-FAC's tasks only (`DEFAULT_METHOD`).
- `MeasuredTimes`: profiles of `pipefisher profile` (pipefisher.profile/v2). A profile of the
  layout's split, micro-batch size and degree is taken as it is. Another split is made from a
  profile of the same micro-batch size and degree: every layer is given to the new stage that
  holds its block (layers are named by global module names; the block is the first number in the
  name, e.g. ``encoder.layer.7.attention.self.query``; layers of no block stay at the first or
  last stage, wherever they were), and each stage's forward, backward, weight and gradient
  reduction are the old stages' shares in proportion to the forward flops it takes of each: a
  block's (`pipefisher.planning.recompute.block_flops`), the heads' (the vocabulary projection,
  BERT's transform) with the last stage, the embeddings' lookups none (an approximation: time
  split like flops; on the BERT demo the heads are 2/3 of the last stage's flops, and giving
  them their own share instead of spreading them over the blocks moved the interleaved
  prediction from 19 % under the measured step to 4 % under). Its step end is the largest of the old stages'
  it takes blocks from: mostly fixed costs (the tied weights' all-reduce, the step's reductions,
  starting the optimizer) that a merged stage pays once, not a sum (measured on this CPU: one
  stage of the BERT demo 13.5 ms, each of its two stages 17.5 ms); of it the method's own work
  (`method_step_end`: Shampoo's and SOAP's preconditioning of its blocks) is each old stage's share
  of the blocks it takes, at most the new step end. p2p is the largest of the old stages'.
  A schedule that splits its backward takes a profile measured under a split schedule where one is
  given (its `weight` times the weight gradient apart; the split's own cost), the others a fused one.

`measured_bandwidth_gbps`: the transfer rate a measured profile's p2p times show, for the
data-parallel traffic of a search over measured profiles.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path
from typing import ClassVar

from pipefisher.core.profile import LayerProfile, Profile, ProfileError, StageProfile
from pipefisher.core.stage_split import even_counts, stage_block_ranges
from pipefisher.methods.registry import DEFAULT_METHOD
from pipefisher.planning.planner.model_sizes import ModelSizes, PlanError
from pipefisher.planning.recompute import block_flops
from pipefisher.planning.planner.hardware import Hardware
from pipefisher.planning.transformer_profile import DEFAULT_TP_BANDWIDTH_GBPS, read_block_times, transformer_profile
from pipefisher.methods.registry import REFERENCE_METHOD, task_rules

_BLOCK = re.compile(r"(?:^|\.)(\d+)(?:\.|$)")
#: ms per profile time unit
MS_PER_UNIT = {"s": 1e3, "ms": 1.0, "us": 1e-3, "units": 1.0}


def block_of(name: str) -> int | None:
    """The block a layer belongs to: the first number among its dotted name's parts (None: none)."""
    found = _BLOCK.search(name)
    return int(found.group(1)) if found else None


@dataclass(frozen=True)
class ReferenceTimes:
    """A per-block CSV (columns bs, time_f, time_b, time_kron, time_inv, time_prec, mem_act, ...)."""

    #: its step end was measured in its own run's layout (ZeRO-1 owners' and gradient workers'
    #: shares of the method's work in it); else a layout's profile divides that work among them
    #: (`layout_profile`)
    measured_step_end: ClassVar[bool] = False
    path: Path
    sizes: ModelSizes
    micro_batch_sizes: tuple[int, ...] = ()
    method: str = DEFAULT_METHOD
    tensor_parallel: tuple[int, ...] | None = None  # any degree the model allows
    #: where set, tensor-parallel all-reduces on its link (`Hardware.tensor_parallel_link`); None:
    #: `transformer_profile`'s default bandwidth, no latency
    hardware: Hardware | None = None

    @classmethod
    def open(cls, path: str | Path, sizes: ModelSizes) -> ReferenceTimes:
        import csv

        try:
            with open(path, newline="") as handle:
                rows = [int(row["bs"]) for row in csv.DictReader(handle)]
        except (OSError, KeyError, ValueError) as exc:
            raise PlanError(
                f"--reference-csv: cannot read {path} as per-block times with a bs column ({exc})"
            ) from None
        return cls(Path(path), sizes, tuple(sorted(rows)))

    def profile(
        self,
        pieces: int,
        micro_batch_size: int,
        tensor_parallel: int,
        split_backward: bool = False,
        stage_blocks: tuple[int, ...] = (),
    ) -> Profile:
        """The modelled profile of `pieces` stages (times in ms), of `stage_blocks` blocks each where
        given (else even); a split backward (`split_backward`) takes the block's backward time in two halves."""
        if self.hardware is None:
            return _reference_profile(
                self.path, self.sizes, pieces, micro_batch_size, tensor_parallel, stage_blocks=stage_blocks
            )
        link = self.hardware.tensor_parallel_link(tensor_parallel)
        return _reference_profile(
            self.path,
            self.sizes,
            pieces,
            micro_batch_size,
            tensor_parallel,
            link.bandwidth_gbps,
            link.latency_us,
            stage_blocks,
        )


@lru_cache(maxsize=1024)
def _reference_profile(
    path: Path,
    sizes: ModelSizes,
    pieces: int,
    micro_batch_size: int,
    tensor_parallel: int,
    tp_bandwidth_gbps: float = DEFAULT_TP_BANDWIDTH_GBPS,
    tp_latency_us: float = 0.0,
    stage_blocks: tuple[int, ...] = (),
) -> Profile:
    times = read_block_times(path, micro_batch_size)
    return transformer_profile(
        times,
        sizes.blocks,
        pieces,
        sizes.hidden,
        sizes.ffn,
        micro_batch_size,
        device=f"{path.name} (modelled)",
        seq_len=sizes.seq_len,
        tensor_parallel=tensor_parallel,
        tp_bandwidth_gbps=tp_bandwidth_gbps,
        tp_latency_us=tp_latency_us,
        method=REFERENCE_METHOD,
        rules=task_rules(REFERENCE_METHOD),
        stage_blocks=stage_blocks,
    )


@dataclass(frozen=True)
class MeasuredTimes:
    """Measured profiles, each with the file it came from (see the module docstring)."""

    #: its step end was measured in its own run's layout (ZeRO-1 owners' and gradient workers'
    #: shares of the method's work in it); else a layout's profile divides that work among them
    #: (`layout_profile`)
    measured_step_end: ClassVar[bool] = True
    profiles: tuple[tuple[str, Profile], ...]
    sizes: ModelSizes
    _cache: dict = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def check(cls, profiles: Sequence[tuple[str, Profile]], sizes: ModelSizes, method: str | None) -> MeasuredTimes:
        """The source, or PlanError for a profile of another model, method or without a micro-batch size."""
        for path, profile in profiles:
            if profile.micro_batch_size is None:
                raise PlanError(
                    f"{path}: micro_batch_size missing; the planner needs the micro-batch size the profile was measured at"
                )
            if method is not None and profile.method != method:
                raise PlanError(
                    f"{path}: the profile times {profile.method} tasks, the run's method is {method}; "
                    f"measure one with `pipefisher profile --optimizer {method}`"
                )
            blocks = sorted(
                {b for stage in profile.stages for layer in stage.layers if (b := block_of(layer.name)) is not None}
            )
            if blocks != list(range(sizes.blocks)):
                held = f"blocks {blocks[0]}..{blocks[-1]}" if blocks else "no numbered blocks"
                raise PlanError(
                    f"{path}: its layers cover {held}, the run's model ({sizes.name}) has {sizes.blocks} blocks; "
                    "profile this run's model"
                )
        return cls(tuple(profiles), sizes)

    @property
    def micro_batch_sizes(self) -> tuple[int, ...]:
        # (`check` refuses a profile without one)
        return tuple(sorted({size for _, profile in self.profiles if (size := profile.micro_batch_size) is not None}))

    @property
    def tensor_parallel(self) -> tuple[int, ...]:
        return tuple(sorted({profile.tensor_parallel for _, profile in self.profiles}))

    @property
    def method(self) -> str:
        return self.profiles[0][1].method

    def profile(
        self,
        pieces: int,
        micro_batch_size: int,
        tensor_parallel: int,
        split_backward: bool = False,
        stage_blocks: tuple[int, ...] = (),
    ) -> Profile:
        """The profile of `pieces` stages (of `stage_blocks` blocks each where given, else even) at
        this micro-batch size and degree, for a schedule that splits its backward (`split_backward`)
        or not: of the profiles at this size and degree, those measured the same way come first
        (`measured_split`: a split backward costs more than the fused one where PyTorch's split runs
        autograd twice), then those of this split (taken as they are; any other is `resplit`)."""
        wanted = stage_blocks or even_counts(self.sizes.blocks, pieces)
        key = (pieces, micro_batch_size, tensor_parallel, split_backward, wanted)
        if key not in self._cache:
            same = [
                p
                for _, p in self.profiles
                if (p.micro_batch_size, p.tensor_parallel) == (micro_batch_size, tensor_parallel)
            ]
            if not same:
                raise ProfileError(
                    f"no profile at micro-batch size {micro_batch_size} and tensor_parallel {tensor_parallel}"
                )
            best = min(same, key=lambda p: (measured_split(p) != split_backward, _counts(p) != wanted))
            self._cache[key] = best if _counts(best) == wanted else resplit(best, pieces, self.sizes, stage_blocks)
        return self._cache[key]


def measured_split(profile: Profile) -> bool:
    """Whether `profile` was measured under a schedule that splits its backward (its stages time
    the weight gradient apart: `StageProfile.weight`)."""
    return any(stage.weight for stage in profile.stages)


def measured_bandwidth_gbps(profile: Profile, sizes: ModelSizes, element_bytes: int) -> float | None:
    """GB/s of the profile's first stage-boundary transfer: one micro-batch's activation
    (micro-batch x seq_len x hidden values of `element_bytes`) over its measured p2p time,
    latency included; None for a profile of one stage or without p2p times."""
    if profile.num_stages < 2 or not profile.stages[0].p2p or profile.micro_batch_size is None:
        return None
    seconds = profile.stages[0].p2p * MS_PER_UNIT[profile.time_unit] / 1e3
    return profile.micro_batch_size * sizes.seq_len * sizes.hidden * element_bytes / seconds / 1e9


def _stage_blocks(stage: StageProfile) -> set[int]:
    return {b for layer in stage.layers if (b := block_of(layer.name)) is not None}


def _counts(profile: Profile) -> tuple[int, ...]:
    """Blocks of each of the profile's stages."""
    return tuple(len(_stage_blocks(stage)) for stage in profile.stages)


def resplit(profile: Profile, pieces: int, sizes: ModelSizes, stage_blocks: tuple[int, ...] = ()) -> Profile:
    """`profile` cut into `pieces` stages of `stage_blocks` blocks each, else blocks/pieces each
    (module docstring)."""
    held_by = stage_block_ranges(sizes.blocks, pieces, stage_blocks)
    old = [_stage_blocks(stage) for stage in profile.stages]
    block, head = part_flops(sizes)
    scaled = ("forward", "backward", "weight", "grad_reduce")
    stages = []
    for new in range(pieces):
        mine = set(held_by[new])
        share = []
        for index, held in enumerate(old):
            edge = head if index == len(old) - 1 else 0.0
            total = len(held) * block + edge
            taken = len(mine & held) * block + (edge if _edge(index, new, len(old), pieces) else 0.0)
            share.append(taken / total if total else float(_edge(index, new, len(old), pieces)))
        times = {name: sum(s * getattr(stage, name) for s, stage in zip(share, profile.stages)) for name in scaled}
        times["step_end"] = max(stage.step_end for s, stage in zip(share, profile.stages) if s)
        method_end = sum(  # the method's end of step preconditions blocks: it moves with them
            len(mine & held) / len(held) * stage.method_step_end for held, stage in zip(old, profile.stages) if held
        )
        times["method_step_end"] = min(method_end, times["step_end"])
        layers: list[LayerProfile] = []
        for index, stage in enumerate(profile.stages):
            for layer in stage.layers:
                block_index = block_of(layer.name)
                if block_index in mine or (block_index is None and _edge(index, new, len(old), pieces)):
                    layers.append(layer)
        stages.append(StageProfile(p2p=max(stage.p2p for stage in profile.stages), layers=tuple(layers), **times))
    return replace(profile, stages=tuple(stages))


def part_flops(sizes: ModelSizes) -> tuple[float, float]:
    """Forward flops per sequence of one block and of the heads (the vocabulary projection, BERT's
    transform before it) on the positions they run on (`ModelShape.head_rows`: BERT's masked
    positions, else every position); the embeddings' lookups count as none."""
    linear, core = block_flops(sizes.hidden, sizes.ffn, sizes.seq_len)
    rows = sizes.shape.head_rows
    transform = 2.0 * rows * sizes.hidden * sizes.hidden if sizes.head_transform else 0.0
    return linear + core, 2.0 * rows * sizes.hidden * sizes.vocab + transform


def _edge(old_index: int, new_index: int, old_count: int, new_count: int) -> bool:
    """Whether what old stage `old_index` holds outside blocks goes to new stage `new_index`: the
    first stage's to the first, any other's to the last."""
    return new_index == 0 if old_index == 0 else new_index == new_count - 1
