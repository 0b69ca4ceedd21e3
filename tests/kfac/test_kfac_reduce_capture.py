"""K-FAC-reduce holds one row per sequence of each capture (its mean over the positions, in the
factor dtype), not the whole (batch, positions, d) record that expand holds until its curvature."""

import pytest
import torch
from torch import nn

from pipefisher.methods.kfac.engine import KFACEngine
from pipefisher.methods.kfac.method import KfacConfig

SEQUENCES, POSITIONS, D_IN, D_OUT = 3, 16, 8, 5


def captured(approximation: str, dtype: torch.dtype = torch.float32) -> KFACEngine:
    model = nn.Sequential(nn.Linear(D_IN, D_OUT)).to(dtype)
    engine = KFACEngine(model, KfacConfig(approximation=approximation))
    with engine.capture(0):
        model(torch.randn(SEQUENCES, POSITIONS, D_IN, dtype=dtype)).float().square().sum().backward()
    return engine


@pytest.mark.parametrize("approximation, rows", [("expand", SEQUENCES * POSITIONS), ("reduce", SEQUENCES)])
def test_a_capture_holds_the_rows_its_approximation_reads(approximation, rows):
    engine = captured(approximation)
    for factor, width in (("A", D_IN), ("B", D_OUT)):
        assert engine.captured_bytes("0", factor, 0) == rows * width * 4
        (record,) = engine.layer_state("0").captures[factor][0]
        assert record.untyped_storage().nbytes() == rows * width * 4  # what is held, not a view of more


def test_reduce_condenses_a_bf16_capture_in_float32():
    engine = captured("reduce", torch.bfloat16)
    for factor, width in (("A", D_IN), ("B", D_OUT)):
        (record,) = engine.layer_state("0").captures[factor][0]
        assert record.dtype == torch.float32 and record.shape == (SEQUENCES, POSITIONS, width)
