"""The profiler under ZeRO-2/3 (FSDP2): its gradient-dropping steps still reduce-scatter in the
last backward and drop the shards, its end-of-step timing restores the sharded parameters and
optimizer state, so training continues bit for bit; a sharded stage's gradient reduction is
measured from the step records (`profiler._in_backward_reduce_times`); `pipefisher profile`
measures a ZeRO-3 run file."""

import subprocess
from pathlib import Path

import pytest
import torch
import yaml
from _zero_runs import zero_config

from pipefisher.core.profile import load_profile
from pipefisher.runtime.training.launch import run_group
from pipefisher.runtime.training.profiler import _in_backward_reduce_times

pytestmark = pytest.mark.dist
ROOT = Path(__file__).resolve().parents[2]


def held_state(executor) -> dict[str, torch.Tensor]:
    """This rank's parameters and optimizer state by name, each its local part (a shard)."""
    from pipefisher.runtime.primitives.sharding import local

    state = {}
    for key, stage in executor.stages.items():
        for name, parameter in stage.module.named_parameters():
            state[f"{key}.{name}"] = local(parameter.detach()).clone()
            for field, value in executor.optimizer.state.get(parameter, {}).items():
                state[f"{key}.{name}.{field}"] = local(value).clone() if torch.is_tensor(value) else torch.tensor(value)
    return state


def profiled_midway(rank: int, world: int, config, profile: bool):
    """Two steps, a profile measurement if `profile`, two more steps: the losses, this rank's
    final `held_state`, the keys `measure_profile` changed (None: not measured) and the profile."""
    from pipefisher.methods.registry import method_of
    from pipefisher.runtime.pipeline.plan_runner import PlanRunner, schedule_plan
    from pipefisher.runtime.training.assembly import staged_model
    from pipefisher.runtime.training.method_context import method_inputs
    from pipefisher.runtime.training.profiler import measure_profile
    from pipefisher.runtime.training.trainer import build_executor

    executor, schedule = build_executor(config, rank, torch.device("cpu"))
    runner = PlanRunner(executor, rank, schedule_plan(schedule), executor.tied)
    losses = [runner.run_step(step).loss for step in range(2)]
    changed, measured = None, None
    if profile:
        before = held_state(executor)
        modules = {key: stage.module for key, stage in executor.stages.items()}
        parts = method_of(config).runtime_parts()
        timer = parts.timer(method_inputs(config), modules, parts.skip(staged_model(config)))
        measured, _ = measure_profile(executor, rank, modules, config.data.micro_batch_size, timer, repeats=2)
        after = held_state(executor)
        changed = sorted(key for key in before if key not in after or not torch.equal(before[key], after[key]))
    losses += [runner.run_step(step).loss for step in range(2, 4)]
    return losses, held_state(executor), changed, measured


@pytest.mark.slow
@pytest.mark.parametrize(("schedule", "zero"), [("1f1b", 3), ("gpipe", 2)])
def test_profiling_under_zero_2_3_leaves_training_unchanged(schedule, zero):
    """1 stage x 2 replicas, AdamW with clipping: the profiler changes no parameter or optimizer
    state, the steps after it are those of a run without it, bit for bit, and the stage's
    gradient reduction has samples (its armed backward's excess over the others)."""
    config = zero_config(schedule, zero, "adamw", 1, run={"steps": 4})
    plain, profiled = (
        run_group(profiled_midway, 2, args=(config, flag), timeout=30, deadline=180) for flag in (False, True)
    )
    for (losses, state, _, _), (losses_profiled, state_profiled, changed, profile) in zip(plain, profiled):
        assert changed == []
        assert losses == losses_profiled
        assert state.keys() == state_profiled.keys()
        for key, value in state.items():
            assert torch.equal(value, state_profiled[key]), key
        stage = profile.stages[0]
        assert stage.forward > 0 and stage.backward > 0 and stage.step_end > 0
        assert len(stage.samples["grad_reduce"]) == 2 * 2  # one per measured step and rank


def test_a_sharded_stage_reduces_in_what_its_last_backward_takes_over_the_others():
    """Per step and stage: the last backward (by start) less the median of the others, 0 when
    less; stages not sharded, and a stage with one backward, give no sample."""
    step = [
        (0, "0B1", 0.0, 2.0),
        (0, "0B0", 3.0, 5.0),
        (0, "0B2", 6.0, 9.5),
        (0, "0B3", 10.0, 17.0),  # last: 7 ms against a median of 2
        (0, "1F0", 0.0, 1.0),
        (0, "1B0", 20.0, 21.0),  # one backward: no sample
        (0, "2B0", 0.0, 4.0),
        (0, "2B1", 5.0, 6.0),  # last but shorter: 0
    ]
    assert _in_backward_reduce_times([step, step], {0, 1, 2}) == {0: [5.0, 5.0], 2: [0.0, 0.0]}
    assert _in_backward_reduce_times([step], {3}) == {}


@pytest.mark.slow
def test_pipefisher_profile_measures_a_zero3_run_file(tmp_path):
    """`pipefisher profile` of a ZeRO-3 run (1 stage x 2 replicas, AdamW): the profile it writes
    times the stage's ops, its end of step and its in-backward reduction."""
    data = yaml.safe_load((ROOT / "schedules" / "tiny-regression.yaml").read_text())
    data["pipeline"].update(stages=1, data_parallel=2)
    data["optimizer"] = {"name": "adamw", "lr": 0.01, "zero": 3}
    data["run"]["timeout"] = 30
    run_file, output = tmp_path / "run.yaml", tmp_path / "profile.yaml"
    run_file.write_text(yaml.safe_dump(data))
    result = subprocess.run(
        ["pipefisher", "profile", str(run_file), "-o", str(output), "--master-port", "0", "--repeats", "2"],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, result.stderr
    stage = load_profile(output).stages[0]
    assert stage.forward > 0 and stage.backward > 0 and stage.step_end > 0
    assert len(stage.samples["grad_reduce"]) == 2 * 2
    assert "gradient all-reduce" in result.stdout
