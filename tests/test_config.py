"""Run-file semantics that are not just parsing: K-FAC's own optimizer settings, split hints."""

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


@pytest.mark.parametrize("kfac, message", [({"lr": -1.0}, "kfac.lr must be >= 0"), ({"momentum": 1.0}, "kfac.momentum in [0, 1)")])
def test_bad_kfac_optimizer_settings_are_refused(kfac, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace(")", r"\)")):
        config_from_dict({"kfac": kfac})


def test_split_hint_lists_the_divisors():
    assert split_hint(4, "pipeline.stages") == "make pipeline.stages a divisor of 4: 1, 2 or 4"
    assert split_hint(1, "pipeline.stages") == "make pipeline.stages a divisor of 1: 1"
    assert split_hint(12, "x").endswith("1, 2, 3, 4, 6 or 12")
