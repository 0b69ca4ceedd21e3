"""The memory model of SOAP, Shampoo and Muon runs against the live tensor bytes of real packed
runs (`experiments/memory_check.py`: the tiny BERT on 2 stages, 1F1B, each from a profile measured
first, over its second refresh cycle): the matrices named by their parameters, SOAP's pending
bases and its refresh's temporaries, and its run-file settings (`fold: bubbles`, float32
statistics, helpers) all counted. Before these were, SOAP's peak was 18-26 % above the model's.

The model must not fall more than 10 % below the live peak (what it leaves out would be an
out-of-memory on a GPU); above it, it may go 25 %: the model takes the plan's peak, and under
load (two busy processes beside the test) one Shampoo run in four held 10 MiB less than its plan
puts at rank 0's peak (a root op's temporaries beside the most activations), 55.4 MiB against
the model's 67.5 and the 64.7-65.4 the other runs held."""

from __future__ import annotations

from pathlib import Path

import pytest

from experiments.memory_check import Layout, check, layout_config

SETTINGS = (("fold", "bubbles"), ("statistics_dtype", "float32"), ("helpers", True))


@pytest.mark.slow
@pytest.mark.parametrize(
    "optimizer, settings",
    [("soap", ()), ("soap", SETTINGS), ("shampoo", ()), ("muon", ())],
    ids=["soap", "soap-settings", "shampoo", "muon"],
)
def test_predicted_peak_per_rank_is_at_most_ten_percent_below_live_tensor_bytes(tmp_path: Path, optimizer, settings):
    config = layout_config(Layout("tiny-cpu.yaml", "1f1b", optimizer=optimizer, settings=settings), tmp_path)
    for peak, live in check(config):
        assert 0.90 * live <= peak.total_bytes <= 1.25 * live, (optimizer, peak.rank, peak.total_bytes, live)
        if optimizer == "soap":
            assert peak.refresh_bytes > 0  # the pending bases (and a refresh's temporaries at its op)
