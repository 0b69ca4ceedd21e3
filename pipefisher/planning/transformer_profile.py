"""Profiles of Transformer encoders built from per-block measurements (e.g. the PipeFisher CSVs).

A block has six Linear layers: attention query, key, value and output (hidden → hidden), FFN in
(hidden → ffn) and FFN out (ffn → hidden). Block totals are split over the layers' factors in
proportion to n² (curvature) and n³ (inversion) of each factor's size n (A: inputs + 1 for the
bias, B: outputs), preconditioning in proportion to din·dout·(din + dout).

Capture sizes (when the micro-batch size is known) are those of K-FAC's stored tensors for one
micro-batch of `micro_batch_size × seq_len` token rows: A the layer's input (din wide; the
engine stores no bias column), B its output gradient (dout wide), `capture_dtype_bytes` each.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass, replace
from pathlib import Path

from pipefisher.core.profile import LayerProfile, Profile, ProfileError, StageProfile

BLOCK_LAYERS = ("attention.query", "attention.key", "attention.value", "attention.output", "intermediate", "output")


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


def block_layer_shapes(hidden: int, ffn: int) -> list[tuple[str, int, int]]:
    """(name, inputs, outputs) of the six Linear layers of a block."""
    shapes = [(hidden, hidden)] * 4 + [(hidden, ffn), (ffn, hidden)]
    return [(name, din, dout) for name, (din, dout) in zip(BLOCK_LAYERS, shapes)]


def block_layers(times: BlockTimes, hidden: int, ffn: int, capture_rows: int = 0, capture_dtype_bytes: int = 4) -> list[LayerProfile]:
    """The block's K-FAC layers with the block totals split as the module docstring says;
    capture sizes in bytes for `capture_rows` token rows per micro-batch (0: unknown)."""
    shapes = block_layer_shapes(hidden, ffn)
    row_bytes = capture_rows * capture_dtype_bytes
    square = sum((din + 1) ** 2 + dout**2 for _, din, dout in shapes)
    cube = sum((din + 1) ** 3 + dout**3 for _, din, dout in shapes)
    product = sum(din * dout * (din + dout) for _, din, dout in shapes)
    return [
        LayerProfile(
            name=name,
            curvature_a=times.time_kron * (din + 1) ** 2 / square,
            curvature_b=times.time_kron * dout**2 / square,
            inverse_a=times.time_inv * (din + 1) ** 3 / cube,
            inverse_b=times.time_inv * dout**3 / cube,
            precondition=times.time_prec * din * dout * (din + dout) / product,
            capture_a_bytes=row_bytes * din,
            capture_b_bytes=row_bytes * dout,
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
) -> Profile:
    """`num_blocks` blocks cut into `num_stages` stages of equal compute.

    Linear layers are dealt out in order, 6·num_blocks/num_stages per stage (rounded), so a stage
    may end in the middle of a block; forward and backward scale with the blocks per stage.
    Capture sizes: `micro_batch_size × seq_len` rows (tokens; 128 in the PipeFisher paper's BERT
    runs) of `capture_dtype_bytes` (4: fp32) per value; unknown (0) without `micro_batch_size`.
    """
    if num_blocks < 1 or num_stages < 1:
        raise ProfileError("num_blocks and num_stages must be at least 1")
    rows = (micro_batch_size or 0) * seq_len
    per_block = block_layers(times, hidden, ffn, rows, capture_dtype_bytes)
    layers = [replace(layer, name=f"block{block}.{layer.name}") for block in range(num_blocks) for layer in per_block]
    share = num_blocks / num_stages
    stages = []
    for stage in range(num_stages):
        first = round(stage * len(layers) / num_stages)
        last = round((stage + 1) * len(layers) / num_stages)
        stages.append(StageProfile(forward=share * times.time_f, backward=share * times.time_b, layers=tuple(layers[first:last])))
    return Profile(stages=tuple(stages), time_unit=time_unit, device=device, micro_batch_size=micro_batch_size)


#: (blocks, hidden, ffn) of the BERT sizes the reference CSVs describe.
BERT_SIZES = {"bert-base": (12, 768, 3072), "bert-large": (24, 1024, 4096)}
