"""Run-file semantics that are not just parsing: K-FAC's own optimizer settings, split hints."""

import re

import pytest

from pipefisher.config import ConfigError, config_from_dict, split_hint


def test_kfac_lr_and_momentum_apply_to_kfac_runs_only():
    data = {"optimizer": {"name": "lamb", "lr": 0.03}, "kfac": {"lr": 0.1, "momentum": 0.9}}
    lamb = config_from_dict(data)
    assert (lamb.optimizer_settings.lr, lamb.optimizer_settings.momentum) == (0.03, 0.0)
    kfac = lamb.with_overrides(optimizer={"name": "kfac"})
    assert (kfac.optimizer_settings.lr, kfac.optimizer_settings.momentum) == (0.1, 0.9)
    unset = config_from_dict({"optimizer": {"name": "kfac", "lr": 0.2, "momentum": 0.5}})
    assert (unset.optimizer_settings.lr, unset.optimizer_settings.momentum) == (0.2, 0.5), "0 means the optimizer's"


@pytest.mark.parametrize("kfac, message", [
    ({"lr": -1.0}, "kfac.lr must be >= 0"),
    ({"momentum": 1.0}, "kfac.momentum in [0, 1)"),
    ({"percentile": 0}, "kfac.percentile: 0 must be in (0, 100]"),
    ({"max_capture_mb": -1}, "kfac.max_refresh_steps and kfac.max_capture_mb must be >= 0"),
])
def test_bad_kfac_optimizer_settings_are_refused(kfac, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        config_from_dict({"kfac": kfac})


def test_split_hint_lists_the_divisors():
    assert split_hint(4, "pipeline.stages") == "make pipeline.stages a divisor of 4: 1, 2 or 4"
    assert split_hint(1, "pipeline.stages") == "make pipeline.stages a divisor of 1: 1"
    assert split_hint(12, "x").endswith("1, 2, 3, 4, 6 or 12")


def test_packer_settings_reach_the_packer():
    from pipefisher.runtime.pipefisher_run import pack_options

    config = config_from_dict({"kfac": {"percentile": 75, "max_refresh_steps": 6, "max_capture_mb": 512, "margin": 0.1}})
    options = pack_options(config)
    assert (options.percentile, options.max_refresh_steps, options.max_capture_mb, options.margin) == (75, 6, 512, 0.1)
    assert pack_options(config_from_dict({})).max_capture_mb is None
