"""The fit behind `flop_times.EFFICIENCY`: efficiencies recomputed from the PipeFisher paper's P100
block times (`profiles/reference/bert-{base,large}_time_memory_p100.csv`: BERT-Base 12 blocks of
hidden 768 and FFN 3072, BERT-Large 24 of 1024 and 4096, 128 tokens, fp32, micro-batch sizes
1-64). Pure Python: no torch.

Per CSV row and column, the op's flops F (forward: `block_flops` x bs; backward 2F; curvature:
K-FAC's factor products of the block's six Linears, 2·t·(d_in² + d_out²) with t = bs x 128
tokens; refresh: K-FAC's Cholesky inverse (the CSVs' own: an eigen count, 11n³, would put
BERT-Large's inverses at 121 % of the peak) of its 12 factors; precondition: its 6 products) and
the measured time y. `time = F / (peak x share) + overhead`: forward, backward and curvature by
least squares on the relative error over the 14 rows (`_fit`); refresh and precondition take one
time per model (bs does not change them), so their two points give the line exactly. The overheads
of the per-factor and per-layer kinds are the block's divided by its 12 factors or 6 layers.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

from pipefisher.methods.flops import CHOLESKY, TRIANGULAR_SOLVE
from pipefisher.planning.recompute import block_flops
from pipefisher.planning.transformer_profile import BERT_SIZES, block_layer_shapes

REFERENCE_FOLDER = Path(__file__).resolve().parents[3] / "profiles" / "reference"
#: TFLOP/s of the P100 SXM2 in fp32 (hardware_presets/p100.yaml)
P100_FP32_TFLOPS = 10.6
SEQ_LEN = 128


@dataclass(frozen=True)
class Fit:
    """One op kind's fitted `share` of the peak and `overhead_ms` per execution, and the largest
    relative error (0.1 = 10 %) of the fitted line over the CSV rows (`worst`)."""

    share: float
    overhead_ms: float
    worst: float


def _rows(name: str, folder: Path) -> list[dict[str, float]]:
    with open(folder / f"{name}_time_memory_p100.csv", newline="") as handle:
        return [{key: float(value) for key, value in row.items()} for row in csv.DictReader(handle)]


def _points(folder: Path) -> dict[str, list[tuple[float, float]]]:
    """Op kind -> (flops, seconds) per CSV row (module docstring)."""
    points: dict[str, list[tuple[float, float]]] = {kind: [] for kind in ("forward", "backward", "curvature")}
    points.update(refresh=[], precondition=[])
    for name, (_, hidden, ffn) in BERT_SIZES.items():
        linear, core = block_flops(hidden, ffn, SEQ_LEN)
        shapes = [(din, dout) for _, din, dout in block_layer_shapes(hidden, ffn)]
        curvature = sum(2.0 * SEQ_LEN * (din * din + dout * dout) for din, dout in shapes)
        per_factor = 2.0 + CHOLESKY + TRIANGULAR_SOLVE  # the product L⁻ᵀ L⁻¹ 2n³ beside the decomposition
        refresh = sum(per_factor * n**3 for din, dout in shapes for n in (din + 1, dout))
        precondition = sum(2.0 * dout * dout * (din + 1) + 2.0 * dout * (din + 1) ** 2 for din, dout in shapes)
        rows = _rows(name, folder)
        for row in rows:
            bs = row["bs"]
            points["forward"].append(((linear + core) * bs, row["time_f"] / 1e3))
            points["backward"].append((2 * (linear + core) * bs, row["time_b"] / 1e3))
            points["curvature"].append((curvature * bs, row["time_kron"] / 1e3))
        for kind, flops, column in (("refresh", refresh, "time_inv"), ("precondition", precondition, "time_prec")):
            points[kind].append((flops, sum(row[column] for row in rows) / len(rows) / 1e3))
    return points


def _fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(seconds per flop, seconds) of the line through `points` with the least squared relative error."""
    weights = [1 / (y * y) for _, y in points]
    sw = sum(weights)
    sx = sum(w * x for w, (x, _) in zip(weights, points))
    sy = sum(w * y for w, (_, y) in zip(weights, points))
    sxx = sum(w * x * x for w, (x, _) in zip(weights, points))
    sxy = sum(w * x * y for w, (x, y) in zip(weights, points))
    det = sw * sxx - sx * sx
    return (sw * sxy - sx * sy) / det, (sxx * sy - sx * sxy) / det


#: executions per block of each kind: the overhead fitted per block is divided by these
PER_BLOCK = {"forward": 1, "backward": 1, "curvature": 12, "refresh": 12, "precondition": 6}


def fit_p100(folder: Path = REFERENCE_FOLDER) -> dict[str, Fit]:
    """Op kind -> its fit to the P100 CSVs in `folder` (module docstring)."""
    fits = {}
    for kind, points in _points(folder).items():
        slope, intercept = _fit(points)
        worst = max(abs((slope * x + intercept) / y - 1) for x, y in points)
        fits[kind] = Fit(1 / (slope * P100_FP32_TFLOPS * 1e12), intercept * 1e3 / PER_BLOCK[kind], worst)
    return fits
