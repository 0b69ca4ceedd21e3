"""Resuming on another layout: a run of 6 steps on layout X stopped after step 3 and resumed on
layout Y takes steps 4-6 as the uninterrupted run on X did (losses to rtol 1e-5, every parameter
by its global name to rtol 1e-5 and `PARAMETER_ATOL`). X -> Y: 2 -> 4 stages, 1F1B -> every other
schedule (each with every method), 2 replicas -> 1, ZeRO-1 on 2 replicas -> 1, 2 -> 1 stage under
tensor parallelism, K-FAC packed -> after-step, Hugging Face GPT-2 2 -> 1 stage; first-order and
with a curvature method whose refresh cycle (3 steps) ends at the stop. A stop inside a cycle
resumed elsewhere drops the cycle's unfinished work and says so.
"""

import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from _workers import checkpointing
from builders import tiny_model
from pipefisher.config import config_from_dict
from pipefisher.methods.registry import methods
from pipefisher.runtime.training.checkpoint import CheckpointError, StateReader, step_folder
from pipefisher.runtime.training.launch import run_group
from pipefisher.runtime.training.resumption import resumable_step, resumption
from pipefisher.schedules import SCHEDULES
from sweeps import micro_batches_for

pytestmark = pytest.mark.dist

#: as the curvature sweep's (`test_curvature_equivalence`): damped inverses amplify summation-order rounding
PARAMETER_ATOL = 1e-5
STOP, STEPS, REFRESH = 3, 6, 3
#: as in `test_curvature_equivalence`: SOAP's ε of 1e-3 keeps eigen-directions of a (nearly) zero
#: gradient from amplifying the rounding of another summation order (1.3e-5 apart on Chimera at 1e-8)
SECTIONS = {"soap": {"epsilon": 1e-3}}


def run_file(
    optimizer: str,
    schedule: str = "1f1b",
    stages: int = 2,
    micro_batches: int = 4,
    data_parallel: int = 1,
    tensor_parallel: int = 1,
    zero: int = 0,
    placement: str = "packed",
    refresh: int = REFRESH,
    workers: float = 1.0,
    **model,
) -> dict:
    """A 4-block transformer (or `model`), SGD after the method's preconditioning and AdamW
    (epsilon 1e-3, see `test_curvature_equivalence`) for the rest; in-order mode."""
    method = (
        {}
        if optimizer in ("adamw", "sgd")
        else {
            optimizer: {
                "refresh_steps": refresh,
                "placement": placement,
                "first_order": "adamw",
                **SECTIONS.get(optimizer, {}),
            }
        }
    )
    if workers != 1.0:
        method[optimizer]["grad_worker_fraction"] = workers
    return {
        "model": model or tiny_model(),
        "data": {"micro_batch_size": 2},
        "pipeline": {
            "schedule": schedule,
            "stages": stages,
            "micro_batches": micro_batches,
            "data_parallel": data_parallel,
            "tensor_parallel": tensor_parallel,
        },
        "optimizer": {"name": optimizer, "lr": 0.01, "eps": 1e-3, "zero": zero},
        **method,
        "run": {"steps": STEPS, "timeout": 30, "master_port": 0, "in_order": True},
    }


def by_global_name(parameters: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A rank's parameters ("<stage>.<name>", "p1.<stage>.<name>") by their global name."""
    return {
        key.split(".", 2)[2] if key.startswith("p1.") else key.split(".", 1)[1]: value
        for key, value in parameters.items()
    }


def stop_and_resume(before: dict, after: dict, folder: Path, stop: int = STOP) -> tuple[list, list]:
    """Train `before` for `STEPS` steps with a checkpoint every `stop`, keep only step `stop`'s,
    and resume it with `after`: (the uninterrupted run's results, the resumed run's)."""
    directory = folder / "checkpoints"
    whole = config_from_dict(before).with_overrides(checkpoint={"dir": str(directory), "every": stop, "keep": 3})
    straight = run_group(checkpointing, whole.world_size, args=(whole, False), timeout=30, deadline=240)
    for later in sorted(directory.glob("step-*"))[1:]:
        shutil.rmtree(later)
    resumed_config = config_from_dict(after).with_overrides(checkpoint={"dir": str(directory)})
    resumed = run_group(checkpointing, resumed_config.world_size, args=(resumed_config, True), timeout=30, deadline=240)
    return straight, resumed


def assert_continues(before: dict, after: dict, folder: Path) -> None:
    straight, resumed = stop_and_resume(before, after, folder)
    expected = by_global_name({key: value for result in straight for key, value in result.parameters.items()})
    for result in resumed:
        torch.testing.assert_close(
            torch.tensor(result.losses), torch.tensor(straight[0].losses[STOP:]), rtol=1e-5, atol=0
        )
        for name, value in by_global_name(result.parameters).items():
            torch.testing.assert_close(
                value, expected[name], rtol=1e-5, atol=PARAMETER_ATOL, msg=lambda text, name=name: f"{name}: {text}"
            )
    assert straight[0].losses[-1] < straight[0].losses[0]


LAYOUTS = {
    "2-to-4-stages": ({}, {"stages": 4}),
    "dp2-to-dp1": ({"data_parallel": 2, "micro_batches": 2}, {}),
    "zero1-2-replicas-to-1": ({"data_parallel": 2, "micro_batches": 2, "zero": 1}, {"zero": 1}),
    "tensor-parallel-2-stages-to-1": ({"tensor_parallel": 2}, {"tensor_parallel": 2, "stages": 1}),
}
#: the curvature methods each layout change is checked with (every method once at least)
METHODS = {
    "2-to-4-stages": ("kfac", "soap"),
    "dp2-to-dp1": ("shampoo",),
    "zero1-2-replicas-to-1": ("shampoo", "kfac"),
    "tensor-parallel-2-stages-to-1": ("kfac",),
}


@pytest.mark.parametrize(
    ("change", "optimizer"), [(change, optimizer) for change in LAYOUTS for optimizer in ("adamw", *METHODS[change])]
)
def test_a_run_resumed_on_another_layout_continues_as_it_would_have(change, optimizer, tmp_path):
    before, after = LAYOUTS[change]
    assert_continues(run_file(optimizer, **before), run_file(optimizer, **after), tmp_path)


@pytest.mark.parametrize("optimizer", ["adamw", *methods()])
@pytest.mark.parametrize("schedule", [name for name in SCHEDULES if name != "1f1b"])
def test_every_schedule_continues_a_1f1b_checkpoint(schedule, optimizer, tmp_path):
    """Swept over the registries: what is added is swept."""
    after = run_file(optimizer, schedule=schedule, micro_batches=micro_batches_for(schedule))
    assert_continues(run_file(optimizer, micro_batches=micro_batches_for(schedule)), after, tmp_path)


def test_kfac_packed_resumes_after_step(tmp_path):
    assert_continues(run_file("kfac", placement="packed"), run_file("kfac", placement="after-step"), tmp_path)


def test_kfac_gradient_workers_resume_on_one_replica(tmp_path):
    """With one gradient worker per layer of two replicas, each layer's inverses are written by its worker."""
    before = run_file("kfac", data_parallel=2, micro_batches=2, workers=0.5)
    assert_continues(before, run_file("kfac"), tmp_path)


def test_a_replica_holds_after_resuming_only_the_refresh_results_it_keeps(tmp_path):
    """Checkpoints take each layer's inverses from its gradient worker; a resumed replica that is
    not its worker does not get them: every process's curvature state has the uninterrupted run's bytes."""
    before = run_file("kfac", data_parallel=2, micro_batches=2, workers=0.5)
    straight, resumed = stop_and_resume(before, before, tmp_path)
    assert [held["curvature"] for held in resumed[0].state_bytes] == [
        held["curvature"] for held in straight[0].state_bytes
    ]


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["sgd", "kfac"])
def test_gpt2_resumes_from_two_stages_on_one(optimizer, tmp_path):
    pytest.importorskip("transformers")
    gpt2 = {"kind": "hf", "hf_config": "gpt2-tiny", "seq_len": 16, "dropout": 0.0}

    def hf(stages: int) -> dict:
        base = run_file(optimizer, stages=stages)
        base["model"] = gpt2
        base["data"] = {
            "kind": "causal",
            "vocab_size": 300,
            "micro_batch_size": 2,
            "cache_dir": str(tmp_path / "cache"),
        }
        base["optimizer"].update({"lr": 0.1, "momentum": 0.9} if optimizer == "sgd" else {})
        return base

    assert_continues(hf(2), hf(1), tmp_path)


def test_a_stop_inside_a_refresh_cycle_restarts_the_cycle_on_another_layout(tmp_path):
    """Stopped after step 3 of K-FAC cycles of 2 steps (one step into the second cycle), resumed
    on 4 stages: the resumption names what it drops; the new cycle starts at step 4 with the first
    cycle's inverses in use, as the uninterrupted run's step 4 has, so the parameters after step 4
    (the stopped cycle's boundary) are that run's; from step 5 on that run uses the stopped cycle's
    inverses, so the parameters after step 5 differ."""
    directory = tmp_path / "checkpoints"
    whole = config_from_dict(run_file("kfac", refresh=2)).with_overrides(
        checkpoint={"dir": str(directory), "every": 1, "keep": STEPS}
    )
    run_group(checkpointing, whole.world_size, args=(whole, False), timeout=30, deadline=240)
    resumed_folder = tmp_path / "resumed"
    resumed_folder.mkdir()
    shutil.copytree(step_folder(directory, STOP), step_folder(resumed_folder, STOP))
    after = config_from_dict(run_file("kfac", refresh=2, stages=4)).with_overrides(
        checkpoint={"dir": str(resumed_folder), "every": 1}
    )
    how = resumption(resumed_folder, STOP, after)
    assert not how.same_layout and any("refresh cycle stopped after step 1 of 2" in line for line in how.dropped)

    def parameters_after(steps: int) -> dict[str, torch.Tensor]:
        results = run_group(
            checkpointing,
            after.world_size,
            args=(after.with_overrides(run={"steps": steps}), True),
            timeout=30,
            deadline=240,
        )
        return by_global_name({key: value for result in results for key, value in result.parameters.items()})

    def straight(step: int, names) -> dict[str, torch.Tensor]:
        reader = StateReader(directory, step)
        return {name: reader.required(f"model/{name}") for name in names}

    at_boundary = parameters_after(STOP + 1)
    expected = straight(STOP + 1, at_boundary)
    for name, value in at_boundary.items():
        torch.testing.assert_close(value, expected[name], rtol=1e-5, atol=PARAMETER_ATOL, msg=name)
    later = parameters_after(STOP + 2)
    expected = straight(STOP + 2, later)
    assert any(not torch.allclose(later[name], expected[name], rtol=1e-4, atol=1e-4) for name in later)


def test_the_same_layout_carries_everything_and_another_says_what_it_drops(tmp_path):
    directory = tmp_path / "checkpoints"
    config = config_from_dict(run_file("kfac", data_parallel=2, micro_batches=2)).with_overrides(
        checkpoint={"dir": str(directory), "every": STOP}, comm={"powersgd_rank": 1}, run={"steps": STOP}
    )
    run_group(checkpointing, config.world_size, args=(config, False), timeout=30, deadline=240)
    assert resumption(directory, STOP, config).summary() == f"resuming from step {STOP}"
    other = config.with_overrides(pipeline={"data_parallel": 1, "micro_batches": 4})
    dropped = resumption(directory, STOP, other).dropped
    assert [line.split(" (")[0] for line in dropped] == [
        "the random streams",
        "PowerSGD's error feedback and warm start",
        "the profile",
    ]
    replanned = resumption(directory, STOP, config.with_overrides(kfac={"placement": "after-step"}))
    assert (
        replanned.same_processes
        and not replanned.same_plan
        and [line.split(" (")[0] for line in replanned.dropped] == ["the profile"]
    )


def test_another_model_or_an_older_format_is_refused_in_one_line(tmp_path):
    directory = tmp_path / "checkpoints"
    config = config_from_dict(run_file("adamw")).with_overrides(checkpoint={"dir": str(directory)}, run={"steps": 1})
    run_group(checkpointing, config.world_size, args=(config, False), timeout=30, deadline=240)
    with pytest.raises(CheckpointError, match="pipeline.tensor_parallel is 1 there and 2 here"):
        resumable_step(directory, config.with_overrides(pipeline={"tensor_parallel": 2}))
    wider = config.with_overrides(model={"hidden": 32})
    with pytest.raises(CheckpointError, match="model.hidden is 16 there and 32 here") as refused:
        resumable_step(directory, wider)
    assert "\n" not in str(refused.value)
    manifest = step_folder(directory, 1) / "manifest.json"
    manifest.write_text(manifest.read_text().replace('"format": 2,', ""))
    with pytest.raises(
        CheckpointError, match="a checkpoint of format 1, written before layout-free checkpoints"
    ) as refused:
        resumable_step(directory, config)
    assert "\n" not in str(refused.value)


def test_the_cli_resumes_on_another_schedule_says_so_and_inspects_the_checkpoint(tmp_path):
    """`pipefisher run --resume` on another layout prints what it drops in one line; `pipefisher
    checkpoint inspect` prints what the checkpoint holds, exit 0 when it verifies, 1 when a file is
    corrupt, 2 (one line) for a folder without checkpoints."""
    run_file_path = Path(__file__).resolve().parents[2] / "schedules" / "tiny-regression.yaml"
    directory = tmp_path / "checkpoints"

    def pipefisher(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["pipefisher", *args], capture_output=True, text=True, timeout=120)

    first = pipefisher(
        "run", str(run_file_path), "--steps", "2", "--checkpoint-dir", str(directory), "--master-port", "0"
    )
    assert first.returncode == 0, first.stderr
    resumed = pipefisher(
        "run",
        str(run_file_path),
        "--steps",
        "4",
        "--checkpoint-dir",
        str(directory),
        "--resume",
        "--schedule",
        "gpipe",
        "--master-port",
        "0",
    )
    assert resumed.returncode == 0, resumed.stderr
    assert "pipefisher: resuming from step 2, written on 1f1b, 2 stages" in resumed.stderr
    assert "on another layout; dropped: the random streams" in resumed.stderr
    inspected = pipefisher("checkpoint", "inspect", str(directory))
    assert inspected.returncode == 0, inspected.stderr
    lines = inspected.stdout.splitlines()
    assert lines[0] == f"checkpoint {step_folder(directory, 4)}: step 4"
    assert lines[2].startswith("layout:   gpipe, 2 stages") and lines[-1].startswith("verifies: yes")
    assert lines[3].startswith("bytes:    model ") and lines[3].endswith(" on disk")
    rank_file = step_folder(directory, 4) / "rank-1.pt"
    rank_file.write_bytes(rank_file.read_bytes()[:-1] + b"x")
    corrupt = pipefisher("checkpoint", "inspect", str(directory), "--step", "4")
    assert (
        corrupt.returncode == 1
        and corrupt.stdout.splitlines()[-1]
        == f"verifies: NO: {rank_file}: its SHA-256 differs from the manifest's (corrupt)"
    )
    empty = pipefisher("checkpoint", "inspect", str(tmp_path))
    assert empty.returncode == 2 and empty.stderr.count("\n") == 1 and "holds no complete checkpoint" in empty.stderr
