"""Shampoo's root ops and memory: the roots equal those of the textbook symmetrisation bit for
bit, and `ShampooLayer.refresh_work_bytes` counts what a real engine's root op allocates while it
runs (live tensor bytes, `LiveTensorBytes`), beside the pending roots its state counts."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from pipefisher.methods.blocks import FACTORS
from pipefisher.methods.shampoo.engine import ShampooEngine
from pipefisher.methods.shampoo.memory import ShampooLayer
from pipefisher.methods.shampoo.method import ShampooConfig
from pipefisher.methods.symmetric import symmetric_or_identity
from pipefisher.runtime.training import LiveTensorBytes


def textbook_symmetric(stats: Tensor) -> Tensor:
    finite = torch.isfinite(stats).all(dim=(-2, -1))
    return torch.where(finite[:, None, None], (stats + stats.mT) / 2, torch.eye(stats.shape[-1], dtype=stats.dtype))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_the_symmetrised_statistics_are_the_textbook_ones_bit_for_bit(dtype):
    g = torch.randn(3, 24, 5, dtype=dtype, generator=torch.Generator().manual_seed(0))
    stats = g @ g.mT + 1e-3 * torch.randn(3, 24, 24, dtype=dtype, generator=torch.Generator().manual_seed(1))
    stats[1, 4, 2] = float("inf")
    sym, finite = symmetric_or_identity(stats)
    assert torch.equal(sym, textbook_symmetric(stats)) and finite.tolist() == [True, False, True]


def engine_mid_cycle(rows: int, cols: int, statistics_dtype: str, root: str) -> ShampooEngine:
    """A one-matrix engine with committed roots and a second cycle's statistics, its roots due."""
    model = nn.Linear(cols, rows, bias=False)
    settings = ShampooConfig(statistics_dtype=statistics_dtype, epsilon=1e-3, root=root)  # type: ignore[arg-type]
    engine = ShampooEngine(model, settings, matrices_only=True)
    for seed in range(2):
        model.weight.grad = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))
        engine.capture("weight")
        for factor in FACTORS:
            engine.update_statistics("weight", factor)
        engine.release("weight")
        if seed == 0:
            for factor in FACTORS:
                engine.compute_root("weight", factor)
            engine.commit()
    return engine


@pytest.mark.parametrize(
    "statistics_dtype, element, root",
    [("float64", 8, "eigen"), ("float32", 4, "eigen"), ("float64", 8, "newton"), ("float32", 4, "newton")],
)
def test_a_root_op_allocates_what_the_memory_model_counts(statistics_dtype, element, root):
    rows, cols = 160, 40  # A's one block is the larger group
    engine = engine_mid_cycle(rows, cols, statistics_dtype, root)
    layer = ShampooLayer("weight", rows, cols, statistics_bytes=element, newton_root=root == "newton")
    probe = LiveTensorBytes()
    with probe:
        engine.compute_root("weight", "A")
    work = probe.peak - 4 * rows * rows  # the pending roots (float32), which `state_bytes` counts
    if root == "eigen":
        assert work == pytest.approx(layer.refresh_work_bytes(), rel=0.05)
    else:  # the model stays above: float32 statistics' selection of the root is in float32
        assert 0.99 * work <= layer.refresh_work_bytes() <= 1.15 * work
