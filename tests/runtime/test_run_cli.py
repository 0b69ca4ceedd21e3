"""`pipefisher run` from a real process, as users run it."""

import json
import socket
import subprocess
from pathlib import Path

import pytest
import yaml

from pipefisher.core.profile import load_profile
from pipefisher.methods.registry import methods

TINY = Path(__file__).resolve().parents[2] / "schedules" / "tiny-regression.yaml"


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(["pipefisher", "run", str(TINY), *args], capture_output=True, text=True, timeout=timeout)


def losses(result: subprocess.CompletedProcess) -> list[float]:
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert [line["step"] for line in lines] == list(range(1, len(lines) + 1))
    return [line["loss"] for line in lines]


@pytest.fixture(scope="module")
def reference_losses() -> list[float]:
    result = run_cli("--steps", "2", "--json", "--reference")
    assert result.returncode == 0, result.stderr
    return losses(result)


@pytest.mark.dist
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved", "chimera", "zb-h1"])
def test_run_prints_one_json_object_per_step(schedule, reference_losses):
    result = run_cli("--schedule", schedule, "--steps", "2", "--json", "--master-port", "0")
    assert result.returncode == 0, result.stderr
    got = losses(result)
    assert len(got) == 2
    if schedule != "interleaved":  # interleaved cuts the model into 4 chunks: another initialisation
        assert got == pytest.approx(reference_losses, rel=1e-5)


def test_text_output_names_units(reference_losses):
    result = run_cli("--steps", "1", "--reference")
    assert result.returncode == 0
    assert result.stdout.startswith("step 1/1  loss ") and result.stdout.rstrip().endswith(" ms")


@pytest.mark.parametrize(
    "content, message",
    [
        (
            "pipeline:\n  stages: 3\n",
            "model.layers: 4 blocks cannot be split into 3 equal stages (pipeline.stages 3); "
            "make pipeline.stages a divisor of 4: 1, 2 or 4",
        ),
        ("checkpoint:\n  resume: auto\n", "checkpoint.resume: 'auto' needs checkpoint.dir (or --checkpoint-dir)"),
        ("pipeline:\n  schedule: chimera\n  micro_batches: 3\n", "micro-batches N=3 must be a multiple of stages D=2"),
        ("pipeline:\n  stagez: 2\n", "pipeline.stagez: unknown key; did you mean stages?"),
        ("optimizer:\n  name: adam\n", "optimizer.name: 'adam' is not one of sgd, adamw, lamb, kfac"),
        ("run:\n  steps: 0\n", "run.steps: 0 must be positive"),
        ("model: [1, 2]\n", "model: expected a mapping"),
    ],
)
def test_bad_run_files_exit_2_with_one_line(tmp_path, content, message):
    path = tmp_path / "bad.yaml"
    path.write_text(content)
    result = subprocess.run(["pipefisher", "run", str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert message in result.stderr and result.stderr.count("\n") == 1 and "Traceback" not in result.stderr


def test_more_nccl_ranks_than_gpus_exits_2_before_starting_processes(tmp_path):
    import torch

    if torch.cuda.device_count() >= 2:
        pytest.skip("this machine has a GPU for each of the run's 2 ranks")
    for command in (["run"], ["profile", "-o", str(tmp_path / "profile.yaml")]):
        result = subprocess.run(
            ["pipefisher", *command, str(TINY), "--backend", "nccl"], capture_output=True, text=True, timeout=60
        )
        assert result.returncode == 2
        assert result.stderr.strip().splitlines() == [
            f"pipefisher: error: run.backend nccl: 2 processes on this machine need 2 GPUs, it has {torch.cuda.device_count()} "
            "(one GPU cannot host two NCCL ranks); use --backend gloo, or fewer processes (pipeline.stages x pipeline.data_parallel x pipeline.tensor_parallel)"
        ]


def test_port_in_use_exits_2_before_starting_processes():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        result = run_cli("--master-port", str(port), timeout=30)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        f"pipefisher: error: run.master_port: port {port} on 127.0.0.1 is in use; pass --master-port "
        "with a free port, or 0 (the default) to let the launcher take one"
    ]


def test_a_taken_port_met_at_the_bind_is_the_same_usage_error():
    """Taken between the check and the bind: the launcher's own store refuses it as one line."""
    from pipefisher.runtime.training.rendezvous import PortInUse, hosted_store

    first = hosted_store("127.0.0.1", 0, timeout=5)
    with pytest.raises(PortInUse, match=f"port {first.port} on 127.0.0.1 is in use"):
        hosted_store("127.0.0.1", first.port, timeout=5)


@pytest.mark.dist
def test_two_runs_at_once_on_one_host_both_succeed():
    """The run file names no port: each launcher serves its store on a port the OS gives it."""
    started = [
        subprocess.Popen(
            ["pipefisher", "run", str(TINY), "--steps", "2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    outcomes = [proc.communicate(timeout=120) for proc in started]
    assert [proc.returncode for proc in started] == [0, 0], [err for _, err in outcomes]
    ports = {err.splitlines()[0].rpartition("port ")[2] for _, err in outcomes}
    assert len(ports) == 2


@pytest.mark.dist
def test_run_under_torchrun_uses_its_ranks(reference_losses):
    result = subprocess.run(
        [
            "torchrun",
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "pipefisher",
            "run",
            str(TINY),
            "--steps",
            "2",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert losses(result) == pytest.approx(reference_losses, rel=1e-5)


def test_torchrun_with_the_wrong_world_size_exits_2():
    result = subprocess.run(
        ["torchrun", "--standalone", "--nproc-per-node", "1", "-m", "pipefisher", "run", str(TINY), "--steps", "1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    assert "torchrun started 1 processes; the run needs 2" in result.stderr


def test_usage_messages_name_things_once(tmp_path):
    """No doubled `pipefisher: error: pipefisher ...` prefix, no path said twice."""
    result = subprocess.run(
        ["pipefisher", "run", str(TINY), "--steps", "x"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2
    assert result.stderr == "pipefisher: error: argument --steps: 'x' is not an integer (see pipefisher run --help)\n"
    missing = tmp_path / "missing.yaml"
    result = subprocess.run(
        ["pipefisher", "run", str(TINY), "--optimizer", "kfac", "--profile", str(missing)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and result.stderr.count(str(missing)) == 1, result.stderr


def test_the_profiler_names_a_methods_end_of_step_work_and_its_rate(tmp_path):
    """Shampoo preconditions in the optimizer step: each stage's line gives that part of its end of
    step, and the FLOP/s lines its achieved rate (its `step_end` flops over that time)."""
    command = ["pipefisher", "profile", str(TINY), "-o", str(tmp_path / "p.yaml"), "--optimizer", "shampoo"]
    result = subprocess.run(
        [*command, "--repeats", "2", "--master-port", "0"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    profile = load_profile(tmp_path / "p.yaml")
    assert any(stage.method_step_end > 0 for stage in profile.stages)
    for stage in profile.stages:
        own = f" (Shampoo's work {stage.method_step_end:.3f} ms)" if stage.method_step_end else ""
        assert f"step end {stage.step_end:.3f} ms{own}, " in result.stdout
    assert "FLOP/s" in result.stdout.split("  its work in the end of step: ", 1)[1].splitlines()[0]


def test_the_profilers_header_says_what_it_measures(tmp_path):
    result = subprocess.run(
        ["pipefisher", "profile", str(TINY), "-o", str(tmp_path / "p.yaml"), "--repeats", "2", "--master-port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    header = result.stderr.splitlines()[0]
    assert "1 warm-up and 2 measured steps (gradients dropped)" in header and "20 steps" not in header, header
    # each K-FAC task kind's achieved FLOP/s, against this CPU's measured matmul rate (no peak table entry)
    rates = result.stdout.split("K-FAC task FLOP/s", 1)[1].splitlines()[1:6]
    kinds = ["A factor curvature", "B factor curvature", "A factor inverse", "B factor inverse", "preconditioning"]
    assert [line.split(":")[0].strip() for line in rates] == kinds, result.stdout
    assert all("FLOP/s, " in line and "% of the measured float32 matmul (" in line for line in rates), rates
    profile = load_profile(tmp_path / "p.yaml")
    assert profile.flop_rates is not None and profile.flop_rates.measured
    assert all(
        set(layer.flops) == {"curvature.0", "curvature.1", "refresh.0", "refresh.1", "precondition"}
        for stage in profile.stages
        for layer in stage.layers
    )


def test_the_run_header_names_every_setting_that_changes_the_training_or_its_cost():
    from pipefisher.config import load_config
    from pipefisher.cli.training import describe

    base = load_config(TINY).with_overrides(pipeline={"data_parallel": 2})
    assert describe(base) == "1f1b: 2 stages x 2 replica(s), 4 micro-batches of 4, fp32, 20 steps, sgd lr 0.05"
    uneven = describe(base.with_overrides(pipeline={"stage_blocks": [3, 1]}))
    assert uneven.startswith("1f1b: 2 stages (blocks 3/1) x 2 replica(s)")
    kfac = describe(base.with_overrides(optimizer={"name": "kfac"}, kfac={"grad_worker_fraction": 0.5}))
    assert kfac.endswith(
        "kfac lr 0.05, adamw lr 0.05 for the rest, K-FAC refresh interval chosen by the packer, packed, "
        "gradient workers 1 per layer"
    )
    assert describe(base.with_overrides(optimizer={"name": "adamw", "zero": 1})).endswith("adamw lr 0.05, ZeRO-1")
    shampoo = describe(
        base.with_overrides(
            optimizer={"name": "shampoo"},
            shampoo={"refresh_steps": 3, "placement": "after-step"},
            comm={"powersgd_rank": 2, "powersgd_start_step": 5},
            run={"precision": "bf16"},
        )
    )
    assert ", bf16, " in shampoo and shampoo.endswith(
        "Shampoo refresh every 3 steps, after-step, PowerSGD rank 2 from step 5"
    )


def test_settings_without_effect_and_emulated_fp16_are_one_line_warnings():
    profile = Path(__file__).resolve().parents[2] / "profiles" / "tiny-cpu-1f1b.yaml"
    result = run_cli(
        "--steps", "1", "--reference", "--precision", "fp16", "--profile", str(profile), "--shampoo-refresh-steps", "2"
    )
    assert result.returncode == 0, result.stderr
    warnings = [line for line in result.stderr.splitlines() if "warning" in line.lower()]
    assert warnings == [
        f"pipefisher: warning: --profile has no effect on a first-order run (optimizer sgd); it serves the packer of --optimizer {' or '.join(methods())}",
        "pipefisher: warning: --shampoo-refresh-steps has no effect with optimizer sgd; it applies to --optimizer shampoo",
        "pipefisher: warning: fp16 on a CPU is emulated, about 10x slower than fp32 here; bf16 or fp32 train at full speed",
    ], result.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["run", "{empty}"], "{empty}: the run file is empty"),
        (["run", "{binary}"], "{binary}: not a text file; a run file is YAML or JSON text"),
        (["run", "{profile}"], "{profile} is a pipefisher profile file (pipefisher.profile/v1), not a run file"),
        (
            ["run", "{tiny}", "--metrics", "{missing}/m.jsonl"],
            "run.metrics (--metrics) {missing}/m.jsonl: folder '{missing}' does not exist",
        ),
        (
            ["run", "{tiny}", "--checkpoint-dir", "{profile}"],
            "checkpoint.dir (--checkpoint-dir) {profile}: is a file; give a folder",
        ),
        (["profile", "{tiny}", "-o", "{missing}/p.yaml"], "-o {missing}/p.yaml: folder '{missing}' does not exist"),
        (["profile", "{tiny}", "-o", "{folder}"], "-o {folder}: is a folder; give a file name inside it"),
        (["run", "{corpus_missing}"], "data.corpus: {missing}/corpus.txt does not exist"),
        (["run", "{corpus_binary}"], "data.corpus: {binary} is not a text file"),
        (["profile", "{vocab_folder}", "-o", "{missing_ok}"], "data.vocab: {folder} is a folder; give a file"),
    ],
)
def test_run_inputs_and_outputs_are_checked_before_any_process_starts(tmp_path, capsys, args, message):
    from pipefisher.cli.main import main

    (tmp_path / "empty.yaml").write_text("")
    (tmp_path / "binary.yaml").write_bytes(bytes(range(256)))
    (tmp_path / "folder").mkdir()
    bert = lambda **data: yaml.safe_dump({"model": {"kind": "bert"}, "data": {"kind": "bert", **data}})
    (tmp_path / "corpus_missing.yaml").write_text(bert(corpus=str(tmp_path / "missing" / "corpus.txt")))
    (tmp_path / "corpus_binary.yaml").write_text(bert(corpus=str(tmp_path / "binary.yaml")))
    (tmp_path / "vocab_folder.yaml").write_text(bert(vocab=str(tmp_path / "folder")))
    names = {
        "empty": tmp_path / "empty.yaml",
        "binary": tmp_path / "binary.yaml",
        "folder": tmp_path / "folder",
        "profile": Path(__file__).resolve().parents[2] / "profiles" / "tiny-cpu-1f1b.yaml",
        "tiny": TINY,
        "missing": tmp_path / "missing",
        "missing_ok": tmp_path / "p.yaml",
        **{name: tmp_path / f"{name}.yaml" for name in ("corpus_missing", "corpus_binary", "vocab_folder")},
    }
    fill = lambda text: text.format(**{key: str(value) for key, value in names.items()})
    assert main([fill(a) for a in args]) == 2
    err = capsys.readouterr().err
    assert fill(message) in err and err.count("\n") == 1, err
