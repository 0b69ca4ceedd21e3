"""The run's K-FAC plan: what `pipefisher run --optimizer kfac` logs about it."""

from builders import layered_profile
from pipefisher.config import config_from_dict
from pipefisher.runtime.training.assembly import build_schedule
from pipefisher.runtime.training.pipefisher_run import make_plan, stage_layer_names


def run_config(schedule):
    return config_from_dict(
        {
            "model": {"layers": 2, "hidden": 8, "heads": 2, "ffn": 16, "seq_len": 4, "input_dim": 4, "output_dim": 2},
            "pipeline": {"stages": 2, "micro_batches": 4, "schedule": schedule},
            "optimizer": {"name": "kfac", "lr": 0.1},
        }
    )


def profile_of(config, inverse):
    """Forward 1 ms, backward 2 ms per stage; every layer's inverses take `inverse` ms."""
    names = [stage_layer_names(config, stage, 2) for stage in range(2)]
    return layered_profile(2, names=names, spread=False, curvature=0.01, inverse=inverse, precondition=0.001)


def test_work_that_fits_the_bubbles_is_logged_with_its_small_overhead():
    config = run_config("1f1b")
    summary = make_plan(config, build_schedule(config), profile_of(config, 0.01)).summary
    assert "K-FAC packed: refresh every" in summary and "fit no bubble" not in summary
    assert "(+" in summary and " %)" in summary


def test_work_that_fits_no_bubble_is_amortised_and_the_log_says_why():
    config = run_config("1f1b")
    summary = make_plan(config, build_schedule(config), profile_of(config, 50.0)).summary
    assert "fit no bubble; k grew from" in summary
    capped = config.with_overrides(kfac={"max_refresh_steps": 3})
    summary = make_plan(capped, build_schedule(capped), profile_of(config, 50.0)).summary
    assert "refresh every 3 steps" in summary and "up to max_refresh_steps" in summary
    pinned = config.with_overrides(kfac={"refresh_steps": 8})
    summary = make_plan(pinned, build_schedule(pinned), profile_of(config, 50.0)).summary
    assert "refresh every 8 steps" in summary and "fit no bubble" not in summary
