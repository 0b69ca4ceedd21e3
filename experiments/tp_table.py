"""Preconditioner work and curvature state per tensor-parallel rank of BERT-Large's 24 encoder
blocks at T = 1, 2, 4 (Megatron's 1-D split, `pipefisher.core.tensor_parallel.BLOCK_SPLITS`), for
K-FAC and Shampoo, as ratios to T = 1 beside the 3D-Shampoo thesis' 1/T³ (work) and 1/T² (memory).
Computed from the planning models, no measurement; prints Markdown (docs/tensor_parallel_model.md
quotes it). Under a second.

    python experiments/tp_table.py
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from pipefisher.methods.blocks import FACTORS, MatrixInfo
from pipefisher.methods.kfac.memory import KfacLayer
from pipefisher.methods.kfac.method import KFAC
from pipefisher.core.topology import Topology
from pipefisher.planning.memory.state import optimizer_state, rank_memory
from pipefisher.planning.transformer_profile import (
    BERT_SIZES,
    block_layer_shapes,
    read_block_times,
    transformer_profile,
)
from pipefisher.planning.memory.transformer_state import TransformerSizes, transformer_stage_states
from pipefisher.schedules import get_schedule

from pathlib import Path

REFERENCE = Path(__file__).resolve().parent.parent / "profiles" / "reference" / "bert-large_time_memory_p100.csv"
DEGREES = (1, 2, 4)
#: the reference profile's micro-batch size used in the README's packing example (32 x 128 tokens)
MICRO_BATCH = 32
#: flops of one n x n eigendecomposition with vectors (symmetric QR, about 9n³: Golub & Van Loan)
#: plus the product V diag(·) Vᵀ (2n³): how both K-FAC's ("eigen") inverse and Shampoo's root are taken
EIGEN_FLOPS_PER_CUBE = 11
SHAMPOO_BLOCK = 1024  # ShampooConfig.block_size's default
#: bytes per element: Shampoo's statistics (statistics_dtype float64, its default) and roots (fp32)
SHAMPOO_STATISTICS_BYTES, SHAMPOO_ROOT_BYTES = 8, 4
MiB, GFLOP = 2**20, 1e9
#: the heads' Linear layers, left out: replicated, they do not change with T
HEADS = ("pooler.*", "cls.*")


@dataclass(frozen=True)
class KfacRow:
    """One tensor-parallel rank's K-FAC work per refresh (inverse) and per step (precondition), in
    flops, the modelled P100 time of both (ms) and the curvature state (bytes)."""

    degree: int
    inverse_flops: float
    precondition_flops: float
    modelled_ms: float
    state_bytes: int


@dataclass(frozen=True)
class ShampooRow:
    """One tensor-parallel rank's Shampoo root work per refresh (flops) and statistics + roots (bytes)."""

    degree: int
    block_size: int
    root_flops: float
    state_bytes: int


def kfac_row(degree: int) -> KfacRow:
    """K-FAC over the 24 blocks' shard Linears of rank 0 (the one holding the row-split biases)."""
    blocks, hidden, ffn = BERT_SIZES["bert-large"]
    sizes = TransformerSizes(blocks, hidden, ffn, vocab=30522)
    (stage,) = transformer_stage_states(
        sizes,
        1,
        lambda name, din, dout, bias: KfacLayer(name, din + bias, dout),
        tensor_parallel=degree,
        first_order=("*decoder", *HEADS),
    )
    layers = stage.curvature_layers
    inverse = sum(EIGEN_FLOPS_PER_CUBE * (layer.a_size**3 + layer.b_size**3) for layer in layers)
    precondition = sum(2 * layer.a_size * layer.b_size * (layer.a_size + layer.b_size) for layer in layers)
    (rank,) = rank_memory(
        Topology(get_schedule("1f1b", 1, 1), 1), [stage], optimizer_state("kfac", 0.9, memory=KFAC.memory)
    )
    profile = transformer_profile(
        read_block_times(REFERENCE, MICRO_BATCH),
        blocks,
        1,
        hidden,
        ffn,
        MICRO_BATCH,
        tensor_parallel=degree,
        rules=KFAC.rules,
    )
    modelled = sum(sum(layer.refresh) + layer.precondition for layer in profile.stages[0].layers)
    return KfacRow(degree, inverse, precondition, modelled, rank.curvature_bytes)


def shampoo_row(degree: int, block_size: int = SHAMPOO_BLOCK) -> ShampooRow:
    """Shampoo over the 24 blocks' shard weights (`pipefisher.methods.blocks` cuts each into blocks
    of `block_size`): an inverse 4th root of every block's two statistics, each statistic in
    float64 and its committed root in fp32."""
    blocks, hidden, ffn = BERT_SIZES["bert-large"]
    infos = [
        MatrixInfo.of(name, (dout, din), block_size) for name, din, dout in block_layer_shapes(hidden, ffn, degree)
    ]
    roots = blocks * sum(EIGEN_FLOPS_PER_CUBE * n**3 for info in infos for f in FACTORS for n in info.block_sizes(f))
    state = (
        blocks
        * sum(info.statistic_numel(f) for info in infos for f in FACTORS)
        * (SHAMPOO_STATISTICS_BYTES + SHAMPOO_ROOT_BYTES)
    )
    return ShampooRow(degree, block_size, roots, state)


def _ratio(value: float, base: float) -> str:
    return f"{value / base:.3f}"


def kfac_table() -> list[str]:
    rows = [kfac_row(t) for t in DEGREES]
    base = rows[0]
    lines = [
        "| T | inverse [GFLOP/refresh] | ratio | precondition [GFLOP/step] | ratio | modelled P100 [ms] | ratio | "
        "factors + inverses [MiB] | ratio | thesis: work 1/T³ | thesis: memory 1/T² |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {row.degree} | {row.inverse_flops / GFLOP:.1f} | {_ratio(row.inverse_flops, base.inverse_flops)} | "
            f"{row.precondition_flops / GFLOP:.1f} | {_ratio(row.precondition_flops, base.precondition_flops)} | "
            f"{row.modelled_ms:.1f} | {_ratio(row.modelled_ms, base.modelled_ms)} | "
            f"{row.state_bytes / MiB:.0f} | {_ratio(row.state_bytes, base.state_bytes)} | "
            f"{1 / row.degree**3:.3f} | {1 / row.degree**2:.3f} |"
        )
    return lines


def shampoo_table() -> list[str]:
    lines = [
        "| T | block size | roots [GFLOP/refresh] | ratio | statistics + roots [MiB] | ratio | thesis: work 1/T³ | thesis: memory 1/T² |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for block_size in (SHAMPOO_BLOCK, max(BERT_SIZES["bert-large"][1:])):
        rows = [shampoo_row(t, block_size) for t in DEGREES]
        base = rows[0]
        for row in rows:
            lines.append(
                f"| {row.degree} | {row.block_size} | {row.root_flops / GFLOP:.1f} | {_ratio(row.root_flops, base.root_flops)} | "
                f"{row.state_bytes / MiB:.0f} | {_ratio(row.state_bytes, base.state_bytes)} | "
                f"{1 / row.degree**3:.3f} | {1 / row.degree**2:.3f} |"
            )
    return lines


def main() -> None:
    argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0]).parse_args()
    print(
        "K-FAC, per tensor-parallel rank (shard 0), 24 blocks x 6 Linear shards, micro-batch 32 x 128 for the modelled time:\n"
    )
    print("\n".join(kfac_table()))
    print(
        "\nShampoo, per tensor-parallel rank, 24 blocks x 6 weight shards (block size 1024: the default; 4096: no blocking here):\n"
    )
    print("\n".join(shampoo_table()))


if __name__ == "__main__":
    main()
