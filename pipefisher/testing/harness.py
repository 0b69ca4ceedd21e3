"""Hold a curvature method to its single-process reference: the checks the built-in methods pass,
for a method of your own (`docs/writing-a-method.md`).

A method's pipelined run (every rank in its own process, gloo on 127.0.0.1, in-order mode: each
rank issues its collectives in the order NCCL requires) must equal `pipefisher run --reference`
(the whole model in one process, the method's `ReferenceCurvature`) on every registered schedule
and with replicas; and its updates must differ from plain SGD's (`assert_not_vacuous`), or the
equality proves nothing. Use from pytest::

    import pytest
    from pipefisher import testing

    @pytest.mark.parametrize("schedule", testing.schedules())
    def test_my_method_equals_its_reference(schedule):
        testing.assert_equal_to_reference(testing.method_run("mine", schedule, refresh_steps=2))

    def test_my_method_is_not_vacuous():
        testing.assert_not_vacuous(testing.method_run("mine", "1f1b", refresh_steps=2, first_order="sgd"))

The spawned ranks import the run's method by name (its module must be importable in a fresh
process: on ``sys.path``, or an installed ``pipefisher.methods`` entry point).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pipefisher.core.ir import ScheduleError
from pipefisher.schedules import SCHEDULES, get_schedule

if TYPE_CHECKING:
    from pipefisher.config import RunConfig
    from pipefisher.methods.inputs import MethodInputs
    from pipefisher.runtime.training.trainer import TrainResult

#: the tiny Transformer of the distributed tests (schedules/tiny-regression.yaml's model): 4
#: blocks of width 16, 2 heads, feed-forward 32, sequences of 4 inputs of 8 numbers, 3 outputs
TINY_MODEL: dict[str, int] = {
    "layers": 4,
    "hidden": 16,
    "heads": 2,
    "ffn": 32,
    "seq_len": 4,
    "input_dim": 8,
    "output_dim": 3,
}
#: losses and parameters of a pipelined run match the reference's to this relative tolerance
RTOL = 1e-5
#: parameters of a pipelined run match the reference's to this absolute tolerance (by default)
PARAMETER_ATOL = 1e-5
#: AdamW's epsilon for what a method does not precondition in `method_run`: large enough that a
#: gradient that is zero in exact arithmetic (rounding noise, summed in another order by the
#: pipeline than by the reference) takes no full-size step
ADAMW_EPS = 1e-3


def tiny_model(**changes: Any) -> dict[str, Any]:
    """A fresh copy of `TINY_MODEL` (a run config's `model` section), with `changes`."""
    return {**TINY_MODEL, **changes}


def schedules() -> list[str]:
    """The names of every registered schedule (what a method must hold on)."""
    return list(SCHEDULES)


def builds(name: str, stages: int, micro_batches: int) -> bool:
    """Whether schedule `name` (with its own chunks per rank) exists on `stages` ranks and
    `micro_batches` micro-batches."""
    try:
        get_schedule(name, stages, micro_batches)
    except ScheduleError:
        return False
    return True


def micro_batches_for(name: str, stages: int = 2, at_least: int = 4) -> int:
    """The fewest micro-batches, `at_least` or more, schedule `name` runs on `stages` ranks."""
    for micro_batches in range(at_least, at_least + 8 * stages + 1):
        if builds(name, stages, micro_batches):
            return micro_batches
    raise AssertionError(
        f"schedule {name!r} builds on {stages} stages with none of {at_least}..{at_least + 8 * stages} micro-batches"
    )


def pipeline(name: str, stages: int = 2, at_least: int = 4, **more: Any) -> dict[str, Any]:
    """The `pipeline` section of a run of schedule `name`: `stages` ranks and the fewest
    micro-batches from `at_least` on that it builds with (4 for every schedule registered today)."""
    return {"schedule": name, "stages": stages, "micro_batches": micro_batches_for(name, stages, at_least), **more}


def method_run(
    method: str,
    schedule: str,
    data_parallel: int = 1,
    *,
    optimizer: str | None = None,
    steps: int = 6,
    lr: float = 0.01,
    stages: int = 2,
    **section: Any,
) -> RunConfig:
    """A run of curvature `method` small enough for a test: `TINY_MODEL` on `stages` ranks of
    `schedule` (the fewest micro-batches of 2 from 4 on that it builds with), `data_parallel`
    replicas of each stage, `steps` steps, in-order mode (NCCL's rule on gloo); SGD at `lr`
    without momentum after the method's preconditioning, AdamW at `lr` (epsilon `ADAMW_EPS`) for
    what it does not precondition; the method's section has its defaults but for `section` (pin
    `refresh_steps`: the reference has no packer). `optimizer` (e.g. "sgd") replaces the method
    as `optimizer.name`, its section staying."""
    from pipefisher.config import config_from_dict

    return config_from_dict(
        {
            "model": tiny_model(),
            "data": {"micro_batch_size": 2},
            "pipeline": pipeline(schedule, stages=stages, data_parallel=data_parallel),
            "optimizer": {"name": optimizer or method, "lr": lr, "eps": ADAMW_EPS},
            method: dict(section),
            "run": {"steps": steps, "timeout": 30, "master_port": 0, "in_order": True},
        }
    )


def method_inputs(config: RunConfig) -> MethodInputs[Any]:
    """What `config`'s method's runtime, timer and reference are given (`MethodInputs`), as the
    run builds it: for a test that builds one of them itself."""
    from pipefisher.runtime.training.method_context import method_inputs as build

    return build(config)


def pipelined(rank: int, world: int, config: RunConfig) -> TrainResult:
    """One rank's pipelined training of `config` on the CPU (what `run_group` starts per rank)."""
    import torch

    from pipefisher.runtime.training.trainer import train_pipelined

    return train_pipelined(config, rank, torch.device("cpu"))


def assert_equal_to_reference(
    config: RunConfig,
    parameter_atol: float = PARAMETER_ATOL,
    rtol: float = RTOL,
    worker: Callable[[int, int, RunConfig], TrainResult] | None = None,
) -> TrainResult:
    """Train `config` pipelined (one process per rank, each running `worker`: `pipelined` unless
    given, e.g. one that first imports a model kind's or method's registering module) and in one
    process (the reference): every rank's losses equal the reference's to `rtol`, its parameters
    (pipe 1's named as pipe 0's) to `rtol` and `parameter_atol`. Returns the reference's result;
    AssertionError otherwise."""
    import torch

    from pipefisher.runtime.training.launch import run_group
    from pipefisher.models.registry import preload_of
    from pipefisher.runtime.training.reference import train_reference

    reference = train_reference(config)
    results = run_group(
        worker or pipelined,
        config.world_size,
        args=(config,),
        timeout=30,
        deadline=240,
        preload=preload_of(config.model),
    )
    for result in results:
        torch.testing.assert_close(torch.tensor(result.losses), torch.tensor(reference.losses), rtol=rtol, atol=0)
        for key, value in result.parameters.items():
            name = key.split(".", 1)[1] if key.startswith("p1.") else key
            torch.testing.assert_close(value, reference.parameters[name], rtol=rtol, atol=parameter_atol)
    return reference


def assert_equal_on_every_schedule(
    method: str, data_parallel: int = 1, parameter_atol: float = PARAMETER_ATOL, **section: Any
) -> None:
    """`assert_equal_to_reference` of `method_run(method, schedule, data_parallel, **section)` on
    every registered schedule in turn (one test; parametrize over `schedules()` for one each)."""
    for schedule in schedules():
        assert_equal_to_reference(method_run(method, schedule, data_parallel, **section), parameter_atol)


def assert_not_vacuous(
    config: RunConfig, unchanged: int | None = None, rel: float = 1e-4
) -> tuple[list[float], list[float]]:
    """The method of `config` changes the updates: the reference's losses differ from those of the
    same run with plain SGD (`optimizer.name` sgd, the rest alike) from loss `unchanged` on (to
    `rel`), and equal them before (to 1e-6). `unchanged` defaults to 3 for a method with refresh
    work (steps 0-1 of a 2-step cycle are first-order; the results of step 0 take over at step 2,
    whose effect the loss of step 3 shows) and 1 for one without. Set the method's
    `first_order="sgd"` for a run whose other parameters should also step as plain SGD. Returns
    (the method's losses, plain SGD's)."""
    import pytest

    from pipefisher.methods.registry import method_of
    from pipefisher.runtime.training.reference import train_reference

    if unchanged is None:
        unchanged = 3 if method_of(config).rules.parts else 1
    curvature = train_reference(config).losses
    first_order = train_reference(config.with_overrides(optimizer={"name": "sgd"})).losses
    assert curvature[:unchanged] == pytest.approx(first_order[:unchanged], rel=1e-6), (
        "the first steps should be plain SGD's"
    )
    assert curvature[unchanged:] != pytest.approx(first_order[unchanged:], rel=rel), (
        "the method does not change the updates"
    )
    return curvature, first_order
