"""When a PipeFisher run re-profiles: drift of the measured against the predicted cycle time."""

import pytest

from pipefisher.runtime.training.drift import DriftMonitor


def feed(monitor, ratios, predicted=100.0):
    return [monitor.observe(ratio * predicted, predicted) for ratio in ratios]


def test_a_profile_from_a_file_that_misjudges_the_machine_triggers_after_patience_cycles():
    monitor = DriftMonitor(threshold=0.25, patience=3)
    monitor.new_plan(fresh_profile=False)
    # warm-up cycle not judged; then 3 drifting cycles in a row
    assert feed(monitor, [2.0, 1.5, 1.5, 1.5]) == [False, False, False, True]


def test_a_cycle_back_within_the_threshold_resets_the_count():
    monitor = DriftMonitor(threshold=0.25, patience=2)
    monitor.new_plan(fresh_profile=False)
    assert feed(monitor, [1.0, 1.4, 1.1, 1.4, 1.4]) == [False, False, False, False, True]


def test_a_steady_model_error_after_a_fresh_profile_never_triggers():
    monitor = DriftMonitor(threshold=0.25, patience=2)
    monitor.new_plan(fresh_profile=True)
    assert not any(feed(monitor, [2.5, 1.9, 1.95, 1.85, 2.0, 1.9]))
    assert monitor.expected == pytest.approx(1.9)


def test_drift_from_the_calibrated_ratio_triggers_and_a_new_plan_recalibrates():
    monitor = DriftMonitor(threshold=0.25, patience=2)
    monitor.new_plan(fresh_profile=True)
    assert feed(monitor, [1.0, 1.9, 1.9, 2.6, 2.7]) == [False, False, False, False, True]
    monitor.new_plan(fresh_profile=True)
    assert not any(feed(monitor, [3.0, 1.2, 1.2, 1.3]))
    assert monitor.expected == pytest.approx(1.2)


def test_no_prediction_never_triggers():
    monitor = DriftMonitor(threshold=0.1, patience=1)
    monitor.new_plan(fresh_profile=False)
    assert not any(monitor.observe(50.0, 0.0) for _ in range(4))
