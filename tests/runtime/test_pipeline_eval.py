"""Held-out evaluation during pipelined training (`run.eval_every`): the forward-only pass every
schedule derives from its own op lists completes under NCCL's in-order rule, and its loss equals
the single-process reference's held-out loss at the same parameters (real gloo ranks in
in-order mode); the step record and line carry it."""

import time

import pytest
import torch
from _workers import pipelined_with_records
from sweeps import cases

from pipefisher.cli.step_report import StepReporter
from pipefisher.config import ConfigError, config_from_dict
from pipefisher.core.ir import OpKind
from pipefisher.core.topology import Topology
from pipefisher.planning.comm.actions import ActionKind
from pipefisher.planning.comm.evaluation import evaluation_actions, forward_sweep
from pipefisher.runtime.pipeline.executor import StepResult
from pipefisher.runtime.training.assembly import held_out_batches
from pipefisher.runtime.training.evaluation import TrainingClock, eval_fields
from pipefisher.runtime.training.launch import run_group
from pipefisher.runtime.training.reference import Evaluation, train_reference
from pipefisher.schedules import get_schedule


@pytest.mark.parametrize("name, stages, micro_batches", cases((2, [2, 4]), (4, [4, 8]), first=True))
@pytest.mark.parametrize("replicas, shards", [(1, 1), (2, 1), (1, 2)])
def test_every_schedules_eval_pass_runs_each_micro_batch_once_and_replays(
    name, stages, micro_batches, replicas, shards
):
    """Passes shorter than, equal to and longer than a step (partial last rounds included), on
    data-parallel and tensor-parallel layouts: every stage runs every micro-batch once, in the
    training order of its forwards, and the only communication is activations and the world
    reduction; `evaluation_actions` replays it (raises otherwise)."""
    schedule = get_schedule(name, stages, micro_batches)
    for count in (1, micro_batches - 1, micro_batches, 2 * micro_batches + 1):
        if count < 1:
            continue
        plan = evaluation_actions(Topology(schedule, replicas, shards), count)
        sweep = plan.topology.schedule
        ran = [op for ops in sweep.ranks for op in ops]
        assert {op.kind for op in ran} == {OpKind.FORWARD}
        assert sorted((op.stage, op.micro_batch) for op in ran) == sorted(
            (stage, m) for stage in range(schedule.num_stages) for m in range(count)
        )
        for rank, ops in enumerate(sweep.ranks):  # round 0 is the training forwards, in order
            training = [op for op in schedule.ranks[rank] if op.kind is OpKind.FORWARD]
            assert [op for op in ops if op.micro_batch < micro_batches] == [
                op for op in training if op.micro_batch < count
            ]
        groups = {
            action.group[0] if action.group else action.target.group[0]
            for actions in plan.steps[0]
            for action in actions
            if action.kind in (ActionKind.POST, ActionKind.SEND, ActionKind.LAUNCH)
        }
        assert groups <= {"fwd", "world"}
        launches = [a for actions in plan.steps[0] for a in actions if a.kind is ActionKind.LAUNCH]
        assert len(launches) == plan.topology.world_size, "one world reduction per rank"


def test_a_pass_needs_a_micro_batch():
    with pytest.raises(ValueError, match="at least one micro-batch"):
        forward_sweep(get_schedule("1f1b", 2, 4), 0)


def gpt2_run(cache, schedule="1f1b", steps=2, dropout=0.0, lr=0.1, **run):
    """GPT-2 tiny on 2 stages, 2 micro-batches of 2 sequences of 16 tokens, 10 % of the corpus
    held out; in-order mode."""
    return config_from_dict(
        {
            "model": {"kind": "hf", "hf_config": "gpt2-tiny", "seq_len": 16, "dropout": dropout},
            "data": {"kind": "causal", "vocab_size": 300, "micro_batch_size": 2, "cache_dir": cache, "holdout": 0.1},
            "pipeline": {"schedule": schedule, "stages": 2, "micro_batches": 2},
            "optimizer": {"name": "sgd", "lr": lr},
            "run": {"steps": steps, "timeout": 60, "master_port": 0, "in_order": True, **run},
        }
    )


def reference_evaluations(config) -> dict[int, float]:
    """The reference's held-out loss of `config` by steps done (0: before the first), its
    evaluation every `run.eval_every` steps on `run.eval_batches` micro-batches."""
    reports: dict[int, float] = {}
    batches = held_out_batches(config, config.run.eval_batches)
    train_reference(
        config,
        evaluation=Evaluation(
            config.run.eval_every, batches, lambda step, parts: reports.update({step: parts["loss"]})
        ),
    )
    return reports


def pipelined_evaluations(config) -> list[tuple[list[float], dict[int, float]]]:
    """Each rank's step losses and eval losses by step; every record's training clock moves on."""
    outcomes = run_group(pipelined_with_records, config.world_size, args=(config,), timeout=60, deadline=300)
    for _, records in outcomes:
        assert_clock_moves_on([record["train_s"] for record in records])
    return [
        (result.losses, {step: record["eval_loss"] for step, record in enumerate(records, 1) if "eval_loss" in record})
        for result, records in outcomes
    ]


def test_evaluation_needs_a_held_out_split_and_batches_that_split_over_replicas(tmp_path):
    with pytest.raises(ConfigError, match=r"^run\.eval_every: 2 .*data\.holdout > 0"):
        config_from_dict({"run": {"eval_every": 2}})
    with pytest.raises(ConfigError, match=r"^run\.eval_batches: 5 .*pipeline\.data_parallel 2.*multiple of 2"):
        gpt2_run(str(tmp_path), eval_every=1, eval_batches=5).with_overrides(pipeline={"data_parallel": 2})
    assert gpt2_run(str(tmp_path)).run.eval_every == 0, "no evaluation unless asked for"


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("eval-cache"))


@pytest.mark.dist
@pytest.mark.parametrize("schedule", ["1f1b", "interleaved"])
def test_the_pipelined_eval_loss_equals_the_references(schedule, cache):
    """5 held-out micro-batches (two rounds of a step's 2 and one more): after steps 2 and 3
    (the last), each rank's eval_loss equals the reference's held-out loss at the same
    parameters, and training is the reference's (evaluation changes nothing)."""
    config = gpt2_run(cache, schedule, steps=3, eval_every=2, eval_batches=5)
    records = []
    reference = train_reference(config, on_step=records.append)
    expected = reference_evaluations(config)
    reported = {record.step: record.extra["eval_loss"] for record in records if "eval_loss" in record.extra}
    assert_clock_moves_on([record.extra["train_s"] for record in records])
    assert reported == {2: expected[2], 3: expected[3]}, "the reference reports run.eval_every's evaluations"
    for losses, evaluated in pipelined_evaluations(config):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference.losses), rtol=1e-5, atol=0)
        assert list(evaluated) == [2, 3]
        torch.testing.assert_close(
            torch.tensor(list(evaluated.values())), torch.tensor([expected[2], expected[3]]), rtol=1e-5, atol=0
        )
    assert expected[3] != expected[2], "the evaluations see the parameters of their step"


@pytest.mark.dist
@pytest.mark.slow
def test_evaluation_turns_dropout_off(cache):
    """Dropout 0.5 in training (whose masks differ between the pipeline and the reference) and lr
    1e-12 (the parameters stay the initial ones to float precision): the eval losses equal the
    reference's only because the pass runs the stages in eval mode."""
    config = gpt2_run(cache, "chimera", steps=2, dropout=0.5, lr=1e-12, eval_every=1, eval_batches=4)
    expected = reference_evaluations(config)
    for _, evaluated in pipelined_evaluations(config):
        torch.testing.assert_close(
            torch.tensor(list(evaluated.values())), torch.tensor([expected[1], expected[2]]), rtol=1e-5, atol=0
        )


LAYOUTS = {
    "data-parallel": {"pipeline": {"data_parallel": 2}},
    "tensor-parallel": {"pipeline": {"tensor_parallel": 2}, "model": {"hf_config": "llama-tiny"}},
    "kfac-chimera": {
        "pipeline": {"schedule": "chimera"},
        "optimizer": {"name": "kfac", "lr": 0.003},
        "kfac": {"lr": 0.05, "refresh_steps": 2, "placement": "packed", "damping": 0.01},
    },
}


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_eval_loss_equals_the_references_on_other_layouts(layout, cache):
    """Replicas that share the micro-batches (3 each: a round and a half), shards that run the
    same forwards (Llama: GPT-2's fused attention projection has no split; 4 processes each), and K-FAC's cycle, whose collectives outlive a step: the
    eval losses after steps 1 and 2 equal the reference's, the losses too."""
    config = gpt2_run(cache, steps=2, eval_every=1, eval_batches=6).with_overrides(**LAYOUTS[layout])
    reference = train_reference(config)
    expected = reference_evaluations(config)
    for losses, evaluated in pipelined_evaluations(config):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference.losses), rtol=1e-5, atol=0)
        torch.testing.assert_close(
            torch.tensor(list(evaluated.values())), torch.tensor([expected[1], expected[2]]), rtol=1e-5, atol=0
        )


def test_the_step_line_and_record_carry_the_eval_loss(tmp_path, capsys):
    config = config_from_dict({"run": {"steps": 2, "metrics": str(tmp_path / "metrics.jsonl")}})
    reporter = StepReporter(config, as_json=False, progress=False)
    reporter(StepResult(1, 2.5, 0.01, {"lr": 0.1}))
    reporter(StepResult(2, 2.25, 0.01, {"lr": 0.1, "eval_loss": 2.375}))
    reporter.close()
    lines = capsys.readouterr().out.splitlines()
    assert "eval loss" not in lines[0] and "eval loss 2.375000" in lines[1]
    records = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert '"eval_loss"' not in records[0] and '"eval_loss": 2.375' in records[1]


def assert_clock_moves_on(seconds: list[float]) -> None:
    assert seconds[0] > 0 and all(later > earlier for earlier, later in zip(seconds, seconds[1:])), seconds


def test_the_eval_fields_name_every_part_of_the_loss():
    assert eval_fields({"loss": 2.5, "mlm": 2.0, "nsp": 0.5}) == {"eval_loss": 2.5, "eval_mlm": 2.0, "eval_nsp": 0.5}


def test_the_training_clock_leaves_out_what_it_was_paused_for():
    clock = TrainingClock()
    with clock.paused():
        time.sleep(0.3)
    assert clock.seconds() < 0.2 and clock.paused_s >= 0.3
    stamped = clock.stamped(StepResult(1, 1.0, 0.01, {"lr": 0.1}))
    assert stamped.extra["lr"] == 0.1 and 0 < stamped.extra["train_s"] < 0.2
