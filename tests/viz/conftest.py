"""Shared fixtures of the visualizer tests: small BERT-like profiles with K-FAC layers."""

import pytest

from pipefisher.planning.transformer_profile import BlockTimes, transformer_profile

# Block times shaped like BERT-Base on a P100 at micro-batch 32 (ms); made up, not reference data.
TIMES = BlockTimes(time_f=9.7, time_b=16.5, time_kron=25.5, time_inv=71.7, time_prec=6.8)


@pytest.fixture
def bert_profile():
    """4 stages of 3 blocks (18 K-FAC layers each)."""
    return transformer_profile(TIMES, 12, 4, 768, 3072, 32)


@pytest.fixture
def bert_profile_path(tmp_path, bert_profile):
    path = tmp_path / "bert4.yaml"
    bert_profile.save(path)
    return path
