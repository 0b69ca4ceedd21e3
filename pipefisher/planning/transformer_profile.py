"""Profiles of Transformer encoders built from per-block measurements (e.g. the PipeFisher CSVs).

A block has six Linear layers: attention query, key, value and output (hidden → hidden), FFN in
(hidden → ffn) and FFN out (ffn → hidden). Block totals are split over the layers' factors in
proportion to n² (curvature) and n³ (inversion) of each factor's size n (A: inputs + 1 for the
bias, B: outputs), preconditioning in proportion to din·dout·(din + dout).

Capture sizes (when the micro-batch size is known) are those of K-FAC's stored tensors for one
micro-batch of `micro_batch_size × seq_len` token rows: A the layer's input (din wide; the
engine stores no bias column), B its output gradient (dout wide), `capture_dtype_bytes` each.

At tensor-parallel degree T (Megatron's split, `pipefisher.core.tensor_parallel.BLOCK_SPLITS`) a
profile describes ONE tensor-parallel rank: each layer is its shard (`shard_features`; of a
row-split layer shard 0's, which also holds the bias, so the largest), and its task times are the
same shares of the (unsplit) block totals, taken at the shard's sizes. The block's forward and
backward are divided by T, plus the cost of its tensor-parallel all-reduces
(`tensor_parallel_allreduce_ms`, a model).
"""

from __future__ import annotations

import csv
from dataclasses import dataclass, replace
from pathlib import Path

from pipefisher.core.profile import LayerProfile, Profile, ProfileError, StageProfile
from pipefisher.core.stage_split import stage_block_ranges
from pipefisher.core.tensor_parallel import BLOCK_SPLITS, shard_features
from pipefisher.planning.comm.volume import ring_bytes
from pipefisher.planning.vocabulary import TaskRules

BLOCK_LAYERS = ("attention.query", "attention.key", "attention.value", "attention.output", "intermediate", "output")
#: the tensor-parallel all-reduces of one block per micro-batch: after the attention's and the
#: MLP's row-split output projections in the forward, of their column-split inputs' gradients in the backward
ALLREDUCES_FORWARD = 2
ALLREDUCES_BACKWARD = 2
#: all-reduce bus bandwidth (GB/s, nccl-tests' busbw: 2(T-1)/T x bytes / time) assumed for the
#: tensor-parallel all-reduces: a round figure between an NVLink-connected P100's and an H100's
DEFAULT_TP_BANDWIDTH_GBPS = 100.0
_MS_PER_UNIT = {"s": 1e-3, "ms": 1.0, "us": 1e3}
#: bytes of a weight element: parameters are kept in fp32 (a low-precision run's master weights)
WEIGHT_ELEMENT_BYTES = 4


@dataclass(frozen=True)
class BlockTimes:
    """Times of one Transformer block for one micro-batch (time_inv per refresh, time_prec per step)."""

    time_f: float
    time_b: float
    time_kron: float
    time_inv: float
    time_prec: float


def read_block_times(path: str | Path, micro_batch_size: int) -> BlockTimes:
    """The row of a per-block CSV (columns bs, time_f, time_b, time_kron, time_inv, time_prec)."""
    with open(path, newline="") as handle:
        rows = list(csv.DictReader(handle))
    for row in rows:
        if int(row["bs"]) == micro_batch_size:
            return BlockTimes(*(float(row[key]) for key in ("time_f", "time_b", "time_kron", "time_inv", "time_prec")))
    sizes = ", ".join(row["bs"] for row in rows)
    raise ProfileError(f"{path}: no row for micro-batch size {micro_batch_size}; available: {sizes}")


def block_layer_shapes(hidden: int, ffn: int, tensor_parallel: int = 1) -> list[tuple[str, int, int]]:
    """(name, inputs, outputs) of the six Linear layers of a block; at `tensor_parallel` T > 1 of
    their shards on one rank (`BLOCK_SPLITS`); ValueError unless T divides the split sizes."""
    shapes = [(hidden, hidden)] * 4 + [(hidden, ffn), (ffn, hidden)]
    return [
        (name, *shard_features(din, dout, BLOCK_SPLITS[name], tensor_parallel))
        for name, (din, dout) in zip(BLOCK_LAYERS, shapes)
    ]


def block_layers(
    times: BlockTimes,
    hidden: int,
    ffn: int,
    capture_rows: int = 0,
    capture_dtype_bytes: int = 4,
    tensor_parallel: int = 1,
    rules: TaskRules | None = None,
) -> list[LayerProfile]:
    """The block's K-FAC layers with the block totals split as the module docstring says;
    capture sizes in bytes for `capture_rows` token rows per micro-batch (0: unknown); at
    `tensor_parallel` T one rank's shards, each task the share of the block total its shard's
    sizes give against the whole block's; a factor the rank's shards share (`rules`, those of the
    times' method: `TaskRules.shared_when_split`; None: none shared) is built by each from 1/T of
    the rows. A layer's `weight_bytes`: its shard's weight in fp32 (`WEIGHT_ELEMENT_BYTES`)."""
    whole = block_layer_shapes(hidden, ffn)
    shapes = block_layer_shapes(hidden, ffn, tensor_parallel)
    row_bytes = capture_rows * capture_dtype_bytes
    square = sum((din + 1) ** 2 + dout**2 for _, din, dout in whole)
    cube = sum((din + 1) ** 3 + dout**3 for _, din, dout in whole)
    product = sum(din * dout * (din + dout) for _, din, dout in whole)

    def rows(name: str, part: int) -> float:
        """The share of the rows this rank's shard builds part `part` of layer `name` from."""
        shared = tensor_parallel > 1 and rules is not None and rules.shared_part(BLOCK_SPLITS[name].value) == part
        return 1 / tensor_parallel if shared else 1.0

    return [
        LayerProfile(
            name=name,
            curvature=(
                times.time_kron * (din + 1) ** 2 / square * rows(name, 0),
                times.time_kron * dout**2 / square * rows(name, 1),
            ),
            refresh=(times.time_inv * (din + 1) ** 3 / cube, times.time_inv * dout**3 / cube),
            precondition=times.time_prec * din * dout * (din + dout) / product,
            capture_bytes=(row_bytes * din, row_bytes * dout),
            weight_bytes=din * dout * WEIGHT_ELEMENT_BYTES,
        )
        for name, din, dout in shapes
    ]


def transformer_profile(
    times: BlockTimes,
    num_blocks: int,
    num_stages: int,
    hidden: int,
    ffn: int,
    micro_batch_size: int | None = None,
    device: str = "",
    time_unit: str = "ms",
    *,
    seq_len: int = 128,
    capture_dtype_bytes: int = 4,
    tensor_parallel: int = 1,
    tp_bandwidth_gbps: float | None = DEFAULT_TP_BANDWIDTH_GBPS,
    tp_latency_us: float = 0.0,
    method: str = "",
    rules: TaskRules | None = None,
    stage_blocks: tuple[int, ...] = (),
    capture_positions: int | None = None,
) -> Profile:
    """`num_blocks` blocks cut into `num_stages` stages of equal compute, or of `stage_blocks`
    blocks each where given (`pipeline.stage_blocks`: one count per stage, summing to num_blocks).

    Without `stage_blocks`, Linear layers are dealt out in order, 6·num_blocks/num_stages per stage
    (rounded), so a stage may end in the middle of a block; forward and backward scale with the
    blocks per stage.
    Capture sizes: `micro_batch_size × seq_len` rows (tokens; 128 in the PipeFisher paper's BERT
    runs) of `capture_dtype_bytes` (4: fp32) per value; unknown (0) without `micro_batch_size`;
    `capture_positions` rows per sequence where the method holds fewer than its tokens (1: one
    per sequence, K-FAC-reduce's, `RefreshConfig.captures_per_sequence`).
    `tensor_parallel` T: the profile of one of T tensor-parallel ranks (module docstring), its
    forward and backward the block's divided by T plus `tensor_parallel_allreduce_ms` at
    `tp_bandwidth_gbps` (None: communication not counted) with `tp_latency_us` per ring step;
    the weight-gradient part of the
    backward is then half its computation (the all-reduces belong to the input gradient).
    `method`: the name of the method whose task times `times` are (K-FAC's for the PipeFisher
    CSVs), `rules` its task rules (which factors tensor-parallel shards share).
    """
    if num_blocks < 1 or num_stages < 1:
        raise ProfileError("num_blocks and num_stages must be at least 1")
    if isinstance(tensor_parallel, bool) or not isinstance(tensor_parallel, int) or tensor_parallel < 1:
        raise ProfileError(f"tensor_parallel: {tensor_parallel!r} must be a positive integer")
    if tensor_parallel > 1 and rules is None:
        raise ProfileError("rules: the times' method's task rules are needed at tensor_parallel > 1 (shared factors)")
    rows = (micro_batch_size or 0) * (seq_len if capture_positions is None else capture_positions)
    try:
        per_block = block_layers(times, hidden, ffn, rows, capture_dtype_bytes, tensor_parallel, rules)
    except ValueError as exc:
        raise ProfileError(f"tensor_parallel: {exc}; use a degree that divides hidden {hidden} and ffn {ffn}") from None
    layers = [replace(layer, name=f"block{block}.{layer.name}") for block in range(num_blocks) for layer in per_block]
    if stage_blocks:
        try:
            held = stage_block_ranges(num_blocks, num_stages, stage_blocks)
        except ValueError as exc:
            raise ProfileError(str(exc)) from None
        cuts = [(len(per_block) * r.start, len(per_block) * r.stop) for r in held]
    else:
        cuts = [
            (round(stage * len(layers) / num_stages), round((stage + 1) * len(layers) / num_stages))
            for stage in range(num_stages)
        ]
    allreduce = 0.0
    if tensor_parallel > 1 and tp_bandwidth_gbps is not None:
        if time_unit not in _MS_PER_UNIT:
            raise ProfileError(
                f"time_unit: {time_unit!r} has no duration to cost all-reduces in; use one of {', '.join(_MS_PER_UNIT)}"
            )
        if micro_batch_size is None:
            raise ProfileError(
                "micro_batch_size: needed to cost the tensor-parallel all-reduces (or leave them out: tp_bandwidth_gbps None)"
            )
        ms = tensor_parallel_allreduce_ms(
            micro_batch_size * seq_len * hidden * capture_dtype_bytes, tensor_parallel, tp_bandwidth_gbps, tp_latency_us
        )
        allreduce = ms * _MS_PER_UNIT[time_unit]
    stages = []
    for first, last in cuts:
        share = (last - first) / len(per_block) if stage_blocks else num_blocks / num_stages
        stages.append(
            StageProfile(
                forward=share * (times.time_f / tensor_parallel + ALLREDUCES_FORWARD * allreduce),
                backward=share * (times.time_b / tensor_parallel + ALLREDUCES_BACKWARD * allreduce),
                weight=share * times.time_b / tensor_parallel / 2 if allreduce else 0.0,
                layers=tuple(layers[first:last]),
            )
        )
    return Profile(
        stages=tuple(stages),
        time_unit=time_unit,
        device=device,
        micro_batch_size=micro_batch_size,
        method=method,
        tensor_parallel=tensor_parallel,
    )


def tensor_parallel_allreduce_ms(
    activation_bytes: int, tensor_parallel: int, bandwidth_gbps: float, latency_us: float = 0.0
) -> float:
    """Modelled time (ms) of one ring all-reduce of `activation_bytes` (one micro-batch's
    micro_batch × seq_len × hidden activations) over `tensor_parallel` ranks: the bytes each rank
    sends (2(T-1)/T of them, `ring_bytes`) at `bandwidth_gbps` (10^9 bytes/s), plus `latency_us`
    per ring step (2(T-1) steps). A model, not a measurement: no overlap with computation, every
    link at the same speed."""
    if not bandwidth_gbps > 0:
        raise ProfileError(f"tp_bandwidth_gbps: {bandwidth_gbps!r} must be a positive number of GB/s")
    latency_ms = 2 * (tensor_parallel - 1) * latency_us * 1e-3
    return ring_bytes("all_reduce", activation_bytes, tensor_parallel) / (bandwidth_gbps * 1e9) * 1e3 + latency_ms


#: (blocks, hidden, ffn) of the BERT sizes the reference CSVs describe.
BERT_SIZES = {"bert-base": (12, 768, 3072), "bert-large": (24, 1024, 4096)}
