"""The public test harness of pipefisher: hold a curvature method, built in or your own, to its
single-process reference on every registered schedule, with replicas, under NCCL's order, and
check that it changes the updates (`pipefisher.testing.harness`; `docs/writing-a-method.md`)."""

from pipefisher.testing.harness import (
    ADAMW_EPS,
    PARAMETER_ATOL,
    RTOL,
    TINY_MODEL,
    assert_equal_on_every_schedule,
    assert_equal_to_reference,
    assert_not_vacuous,
    builds,
    method_inputs,
    method_run,
    micro_batches_for,
    pipeline,
    pipelined,
    schedules,
    tiny_model,
)

__all__ = [
    "ADAMW_EPS",
    "PARAMETER_ATOL",
    "RTOL",
    "TINY_MODEL",
    "assert_equal_on_every_schedule",
    "assert_equal_to_reference",
    "assert_not_vacuous",
    "builds",
    "method_inputs",
    "method_run",
    "micro_batches_for",
    "pipeline",
    "pipelined",
    "schedules",
    "tiny_model",
]
