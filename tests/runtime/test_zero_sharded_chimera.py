"""Every registered curvature method under ZeRO-3 on Chimera (2 stages x 2 pipes x 2 replicas, in
the in-order mode): FSDP2 shards a stage over each pipe's replicas and the shards are summed over
the pipes (``grad_pipes``) before any method reads them whole (a preconditioning op waits for the
sum; Shampoo's and SOAP's step-end work comes after it), so each equals the single-process
reference."""

import pytest
from _workers import unit_profile
from _zero_runs import zero_config

from pipefisher.methods.registry import methods
from pipefisher.runtime.training.assembly import build_schedule
from pipefisher.testing.harness import assert_equal_to_reference

pytestmark = [pytest.mark.dist, pytest.mark.slow]

#: each method's section and optimizer settings, as its own ZeRO-2/3 tests use them
#: (test_zero_sharded_kfac.py, test_zero_sharded_shampoo_soap.py, test_zero_sharded_muon.py)
SETTINGS = {
    "kfac": ({"refresh_steps": 2, "factor_decay": 0.5, "damping": 0.01}, {"lr": 0.05}),
    "shampoo": ({"refresh_steps": 2, "block_size": 12, "epsilon": 1e-4}, {"momentum": 0.9}),
    "soap": ({"refresh_steps": 2, "epsilon": 1e-3}, {"momentum": 0.9}),
    "muon": ({}, {"lr": 0.02, "weight_decay": 0.1}),
}


@pytest.mark.parametrize("method", [name for name, method in methods().items() if method.shards])
def test_every_sharding_method_on_chimera_equals_the_reference(method, tmp_path):
    """5 steps: K-FAC's and Shampoo's second refresh cycle preconditions, SOAP's first bases are
    in use at step 5."""
    section, optimizer = SETTINGS.get(method, ({}, {}))
    profile = tmp_path / "profile.yaml"
    config = zero_config("chimera", 3, method, 2).with_overrides(
        optimizer=optimizer, run={"steps": 5}, **{method: {**section, "profile": str(profile)}}
    )
    unit_profile(config, build_schedule(config).num_stages).save(profile)
    assert_equal_to_reference(config, parameter_atol=2e-4, rtol=2e-4)
