"""K-FAC's inversion and memory: the damped inverses equal the textbook formulas bit for bit, and
`KfacLayer.refresh_work_bytes` counts what a real engine's inversion holds while it runs beyond
the state and the refresh copy before it (live tensor bytes, `LiveTensorBytes`, from a census)."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import Tensor, nn

from pipefisher.methods.kfac import FACTORS, KfacConfig, KFACEngine
from pipefisher.methods.kfac.factors import damped_inverse, factor_damping
from pipefisher.methods.kfac.memory import KfacLayer
from pipefisher.runtime.training import LiveTensorBytes


def textbook_inverse(factor: Tensor, damping: float, method: str) -> Tensor:
    sym, delta = (factor + factor.T) / 2, factor_damping(damping)
    if method == "eigen":
        evals, evecs = torch.linalg.eigh(sym)
        return (evecs / (evals.clamp(min=0.0) + delta)) @ evecs.T
    eye = torch.eye(factor.shape[0], dtype=factor.dtype)
    chol_inv = torch.linalg.solve_triangular(torch.linalg.cholesky_ex(sym + delta * eye)[0], eye, upper=False)
    return chol_inv.T @ chol_inv


@pytest.mark.parametrize("method", ["eigen", "cholesky"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_damped_inverse_is_the_textbook_one_bit_for_bit(method, dtype):
    rows = torch.randn(40, 24, dtype=dtype, generator=torch.Generator().manual_seed(0))
    factor = rows.T @ rows / 40
    factor[3, 5] += 1e-3  # not quite symmetric, as a sum of float products may be
    inverse, ok = damped_inverse(factor, 1e-3, method)
    assert ok and torch.equal(inverse, textbook_inverse(factor, 1e-3, method))


def engine_with_factors_built(inputs: int, outputs: int, inverse: str) -> tuple[KFACEngine, nn.Linear]:
    """A one-layer engine in its second cycle: inverses committed, both factors built again."""
    layer = nn.Linear(inputs, outputs)
    engine = KFACEngine(nn.Sequential(layer), KfacConfig(inverse=inverse))  # type: ignore[arg-type]
    x = torch.randn(64, inputs, generator=torch.Generator().manual_seed(0))
    for cycle in range(2):
        with engine.capture(0):
            loss = layer(x).pow(2).sum()
        loss.backward()
        for factor in FACTORS:
            engine.curvature("0", factor, 0)
        if cycle == 0:
            for factor in FACTORS:
                engine.invert("0", factor)
            engine.commit("0")
    return engine, layer


@pytest.mark.parametrize("inverse", ["eigen", "cholesky"])
@pytest.mark.parametrize("inputs, outputs", [(40, 160), (159, 48)])
def test_an_inversion_holds_what_the_memory_model_counts(inverse, inputs, outputs):
    engine, _ = engine_with_factors_built(inputs, outputs, inverse)
    model = KfacLayer("0", inputs + 1, outputs, inverse=inverse)
    for part, factor in enumerate(FACTORS):
        gc.collect()
        probe = LiveTensorBytes()
        probe.census()
        before = probe.current
        with probe:
            engine.invert("0", factor)
        assert probe.peak - before == pytest.approx(model.refresh_work_bytes(part=part), rel=0.03), factor
        assert probe.current - before < 64  # the pending inverse takes the built factor's place (and a flag)
