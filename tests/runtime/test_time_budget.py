"""A run on a time budget (`run.time_budget_s`, `pipefisher run --time-budget`): every rank ends
after the same step, the first during which any rank's training clock passed the budget (the
flag rides on the step's world reduction), evaluated and checkpointed as a last step; the
reference ends alike; the summary says so."""

import time

import pytest
import torch
from _workers import checkpointing, pipelined_with_budgets
from test_pipeline_eval import gpt2_run

from pipefisher.cli.step_report import StepReporter
from pipefisher.config import ConfigError, config_from_dict
from pipefisher.runtime.pipeline.executor import StepResult
from pipefisher.runtime.signals import StopRequest
from pipefisher.runtime.training.checkpoint import steps as checkpoint_steps
from pipefisher.runtime.training.evaluation import TrainingClock
from pipefisher.runtime.training.launch import run_group
from pipefisher.runtime.training.reference import train_reference

PAST = 1e-9  # a budget spent by the end of any first step


def test_the_clock_and_the_stop_request_tell_when_a_budget_is_spent():
    clock = TrainingClock()
    assert clock.deadline(0) is None and not clock.spent(0), "0: no budget"
    assert not clock.spent(60) and clock.spent(PAST)
    with clock.paused():
        time.sleep(0.05)
    deadline = clock.deadline(60)
    assert deadline is not None and deadline - time.perf_counter() > 59.9, "paused time is not training"
    request = StopRequest()
    assert not request.out_of_time(), "no deadline: never out of time"
    request.deadline = time.perf_counter() + 60
    assert not request.out_of_time()
    request.deadline = time.perf_counter() - 1e-3
    assert request.out_of_time()


def test_a_negative_budget_is_refused_by_name():
    with pytest.raises(ConfigError, match=r"^run\.time_budget_s: -1"):
        config_from_dict({"run": {"time_budget_s": -1}})
    assert config_from_dict({}).run.time_budget_s == 0, "no budget unless asked for"


@pytest.mark.dist
def test_one_rank_past_the_budget_ends_every_rank_after_that_step(tmp_path):
    """Rank 0 is past its budget in step 1, rank 1 has none: both end after step 1 of 6, with the
    held-out evaluation of a last step (eval_every 5 would not give one) and its checkpoint; the
    reference on the same budget ends there too, with the same loss and evaluation. Resumed
    without a budget, the run goes on to step 6 as the reference does."""
    config = gpt2_run(str(tmp_path / "cache"), steps=6, eval_every=5, eval_batches=2).with_overrides(
        checkpoint={"dir": str(tmp_path / "checkpoints"), "every": 0}
    )
    outcomes = run_group(pipelined_with_budgets, 2, args=(config, [PAST, 0.0]), timeout=60, deadline=300)
    reference_records: list[StepResult] = []
    reference = train_reference(config.with_overrides(run={"time_budget_s": PAST}), on_step=reference_records.append)
    assert len(reference.losses) == 1 and reference_records[0].extra["out_of_time"]
    for result, records in outcomes:
        assert [record.get("out_of_time") for record in records] == [True]
        torch.testing.assert_close(torch.tensor(result.losses), torch.tensor(reference.losses), rtol=1e-5, atol=0)
        torch.testing.assert_close(
            torch.tensor(records[0]["eval_loss"]),
            torch.tensor(reference_records[0].extra["eval_loss"]),
            rtol=1e-5,
            atol=0,
        )
    assert [step for step, _ in checkpoint_steps(tmp_path / "checkpoints")] == [1]
    resumed = run_group(checkpointing, 2, args=(config, True), timeout=60, deadline=300)
    whole = train_reference(config)
    for result in resumed:  # another budget (none) resumes the run: it is not part of its identity
        torch.testing.assert_close(torch.tensor(result.losses), torch.tensor(whole.losses[1:]), rtol=1e-5, atol=0)


@pytest.mark.dist
def test_a_budget_that_is_not_spent_changes_nothing(tmp_path):
    config = gpt2_run(str(tmp_path), steps=2)
    outcomes = run_group(pipelined_with_budgets, 2, args=(config, [3600.0, 3600.0]), timeout=60, deadline=300)
    reference = train_reference(config)
    for result, records in outcomes:
        assert len(records) == 2 and not any("out_of_time" in record for record in records)
        torch.testing.assert_close(torch.tensor(result.losses), torch.tensor(reference.losses), rtol=1e-5, atol=0)


def test_the_summary_says_the_budget_ended_the_run(capsys):
    config = config_from_dict({"run": {"steps": 10, "time_budget_s": 5}})
    reporter = StepReporter(config, as_json=False, progress=False)
    reporter(StepResult(1, 2.5, 2.6, {"lr": 0.1, "train_s": 2.6}))
    reporter(StepResult(2, 2.25, 2.6, {"lr": 0.1, "train_s": 5.2, "out_of_time": True}))
    reporter.close()
    summary = capsys.readouterr().err.splitlines()[-1]
    assert summary.startswith("pipefisher: 2 steps, final loss 2.250000")
    assert summary.endswith("; ended at step 2 of 10: the time budget of 5 s ran out after 5.2 s of training")
