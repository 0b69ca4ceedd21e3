"""No host synchronisation inside a step: per step, a rank reads tensors into Python a fixed number
of times (the step's numbers; at the end of a K-FAC cycle, the health check and the re-profiling
decision), however many layers the model has; Shampoo's roots and preconditioning included."""

import pytest

from _workers import host_reads_per_step
from pipefisher.methods.registry import methods
from pipefisher.runtime.training.launch import run_group

pytestmark = pytest.mark.dist


def reads(config):
    counts = run_group(host_reads_per_step, config.world_size, args=(config,), timeout=30, deadline=180)
    return [[sum(step.values()) for step in rank] for rank in counts], counts


@pytest.mark.parametrize("optimizer", ["sgd", *methods()])
def test_host_reads_per_step_do_not_grow_with_the_layers(optimizer, tiny_config):
    totals = {}
    for layers in (2, 8):
        config = tiny_config(schedule="1f1b").with_overrides(
            model={"layers": layers},
            optimizer={"name": optimizer, "clip_norm": 1.0},
            kfac={"refresh_steps": 2},
            shampoo={"refresh_steps": 2},
            muon={"refresh_steps": 2},
            soap={"refresh_steps": 2},
            run={"steps": 4, "precision": "fp16"},
        )
        totals[layers], counts = reads(config)
    assert totals[2] == totals[8], counts
    for rank in totals[2]:
        # one read of the step's reduced numbers; at the end of a K-FAC or Shampoo cycle, one
        # health check (per stage) and rank 0's re-profiling decision (Muon: no refresh results to
        # check); at the end of the first cycle after step 1 (steps 3-4), once per run, the
        # exposed-time meter's op times (`exposed_meter`)
        if optimizer == "sgd":
            expected = [1, 1, 1, 1]
        else:
            expected = [1, 3, 1, 4] if methods()[optimizer].rules.parts else [1, 2, 1, 3]
        assert rank == expected, counts
