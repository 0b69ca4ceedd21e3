"""SOAP's refresh and memory: the refresh's bases equal the textbook computation bit for bit while
holding fewer copies of the statistics, and the memory model (`SoapLayer.refresh_copy_bytes`,
`refresh_work_bytes`) counts what a real engine's refresh holds and allocates (live tensor bytes,
`LiveTensorBytes`)."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from pipefisher.methods.blocks import FACTORS
from pipefisher.methods.soap import SoapConfig, SoapEngine
from pipefisher.methods.soap.basis import TIE_BREAK, eigenbasis, power_basis
from pipefisher.methods.soap.memory import SoapLayer
from pipefisher.runtime.training.checkpoint import tensor_bytes
from pipefisher.runtime.training.memory_probe import LiveTensorBytes


def textbook_tilted(stats: Tensor) -> Tensor:
    """``S̃`` as the module doc writes it, with every intermediate its own tensor."""
    finite = torch.isfinite(stats).all(dim=(-2, -1))
    n = stats.shape[-1]
    eye = torch.eye(n, dtype=stats.dtype)
    sym = torch.where(finite[:, None, None], (stats + stats.mT) / 2, eye)
    ramp = torch.arange(1, n + 1, dtype=stats.dtype) * (TIE_BREAK / n)
    scale = torch.linalg.matrix_norm(sym)[:, None, None]
    return sym + scale * torch.diag_embed(ramp).expand_as(sym)


def textbook_power_basis(stats: Tensor, basis: Tensor) -> tuple[Tensor, Tensor]:
    tilted = textbook_tilted(stats)
    current = basis.to(stats.dtype)
    product = tilted @ current
    order = torch.argsort((current * product).sum(dim=-2), dim=-1, descending=True, stable=True)
    return torch.linalg.qr(product.gather(-1, order[:, None, :].expand_as(product))).Q, order


def statistics(batch: int, n: int, rank: int, dtype: torch.dtype, seed: int) -> Tensor:
    g = torch.randn(batch, n, rank, dtype=dtype, generator=torch.Generator().manual_seed(seed))
    return g @ g.mT


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("batch, n, rank", [(3, 16, 4), (2, 48, 48)])
def test_the_refresh_equals_the_textbook_computation_bit_for_bit(dtype, batch, n, rank):
    stats = statistics(batch, n, rank, dtype, seed=n)
    stats[0, 1, 2] = float("nan")  # a non-finite statistic: the identity, its basis not ok
    basis = torch.linalg.qr(torch.randn(batch, n, n, generator=torch.Generator().manual_seed(1))).Q
    fresh, order, ok = power_basis(stats, basis)
    want, want_order = textbook_power_basis(stats, basis)
    assert torch.equal(order, want_order)
    assert torch.equal(fresh[1:], want[1:]) and not ok[0] and ok[1:].all()
    vectors, decomposed = eigenbasis(stats[1:])
    assert torch.equal(vectors, torch.linalg.eigh(textbook_tilted(stats[1:])).eigenvectors.flip(-1))
    assert decomposed.all()


def engine_mid_cycle(rows: int, cols: int, statistics_dtype: str) -> SoapEngine:
    """A one-matrix engine after two cycles and a step: its statistics snapshot due for a refresh."""
    model = nn.Linear(cols, rows, bias=False)
    engine = SoapEngine(model, SoapConfig(statistics_dtype=statistics_dtype))  # type: ignore[arg-type]
    for seed in range(3):
        model.weight.grad = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))
        engine.precondition_all()
        if seed < 2:
            for factor in FACTORS:
                engine.refresh("weight", factor)
            engine.commit()
            engine.snapshot()
    return engine


@pytest.mark.parametrize("statistics_dtype, element", [("float64", 8), ("float32", 4)])
def test_a_refresh_holds_and_allocates_what_the_memory_model_counts(statistics_dtype, element):
    rows, cols = 192, 48  # A's one block is the larger group
    engine = engine_mid_cycle(rows, cols, statistics_dtype)
    layer = SoapLayer("weight", rows, cols, statistics_bytes=element)
    committed = tensor_bytes(engine.state_dict())
    peaks = []
    for factor in FACTORS:
        probe = LiveTensorBytes()
        with probe:
            engine.refresh("weight", factor)
        peaks.append(probe.peak)
    assert tensor_bytes(engine.state_dict()) - committed == layer.refresh_copy_bytes()
    pending_a = 4 * (rows * rows + rows)  # allocated inside A's refresh and kept to the commit
    assert peaks[0] - pending_a == pytest.approx(layer.refresh_work_bytes(), rel=0.05)
    assert peaks[1] < peaks[0] / 10  # B's group (48 x 48) is not the one the model takes
