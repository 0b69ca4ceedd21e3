"""The step records in TensorBoard event files and a W&B offline run, read back with their own
readers; one of each from a two-process run; a sink key without its package refused in one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipefisher.cli.metric_sinks import TensorBoard, WandB, scalars

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "schedules" / "tiny-regression.yaml"

#: records as StepReporter makes them: numbers with units in their names, a flag, a pair
RECORDS = [
    {"step": 1, "loss": 0.75, "lr": 0.01, "lr_rest": 0.0025, "step_time_ms": 12.5, "tokens_per_s": 4096.0},
    {"step": 2, "loss": 0.5, "lr": 0.02, "overflow": True, "exposed_steps": [1, 2], "tokens_per_s": 2048.0},
    {"step": 3, "loss": 0.25, "eval_loss": 0.375, "lr": 0.03, "step_time_ms": 10.0, "tokens_per_s": 1024.0},
]


def _event_scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar tag's (step, value) pairs, as TensorBoard reads the folder."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(folder))
    accumulator.Reload()
    return {tag: [(e.step, e.value) for e in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]}


def _wandb_history(run_file: Path, wait: float = 60.0) -> list[dict[str, float]]:
    """The history rows of a W&B run file (`run-ID.wandb`) once its `exit` record is in (wandb's
    service process may still be writing when `finish` returns; at most `wait` seconds)."""
    deadline = time.monotonic() + wait
    while True:
        records = _wandb_records(run_file)
        if any(record.HasField("exit") for record in records) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    return [
        {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
        for record in records
        if record.HasField("history")
    ]


def _wandb_records(run_file: Path) -> list:
    """The protobuf `Record`s of a W&B run file: a ":W&B" header, then LevelDB-log records in
    32 KiB blocks (7-byte headers: CRC, little-endian length, type 1 full, 2 first, 3 middle, 4
    last)."""
    from wandb.proto import wandb_internal_pb2

    data = run_file.read_bytes()
    assert data[:4] == b":W&B"
    block, position, payloads, pending = 32768, 7, [], b""
    while position + 7 <= len(data):
        left = block - position % block
        length, kind = int.from_bytes(data[position + 4 : position + 6], "little"), data[position + 6]
        if left < 7 or kind == 0:  # a block's zero padding
            position += left
            continue
        pending += data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 4):
            payloads.append(pending)
            pending = b""
    records = []
    for payload in payloads:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        records.append(record)
    return records


def test_scalars_are_the_records_numbers_without_the_step() -> None:
    assert scalars(RECORDS[1]) == {"loss": 0.5, "lr": 0.02, "overflow": 1.0, "tokens_per_s": 2048.0}
    assert scalars({"step": 4, "loss": float("nan"), "note": "x"}) == {}


def test_tensorboard_event_file_holds_every_number_at_its_step(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    sink = TensorBoard(str(tmp_path / "tb"))
    for record in RECORDS:
        sink.write(record, record["step"])
    sink.close()
    assert len(list((tmp_path / "tb").iterdir())) == 1
    got = _event_scalars(tmp_path / "tb")
    expected: dict[str, list[tuple[int, float]]] = {}
    for record in RECORDS:
        for key, value in scalars(record).items():
            expected.setdefault(key, []).append((record["step"], value))
    assert got.keys() == expected.keys()
    for tag, points in expected.items():  # event files store float32
        assert [step for step, _ in got[tag]] == [step for step, _ in points], tag
        assert [value for _, value in got[tag]] == pytest.approx([value for _, value in points], rel=1e-6), tag


def _offline_wandb(monkeypatch: pytest.MonkeyPatch, folder: Path) -> None:
    wandb = pytest.importorskip("wandb")
    for name, value in {"WANDB_MODE": "offline", "WANDB_DIR": str(folder), "WANDB_SILENT": "true"}.items():
        monkeypatch.setenv(name, value)
    try:  # a sandbox that cannot start wandb's service process cannot run these tests
        wandb.init(project="probe", mode="offline").finish()
    except Exception as exc:
        pytest.skip(f"wandb cannot start here: {exc}")


def test_wandb_offline_run_history_holds_the_records(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _offline_wandb(monkeypatch, tmp_path)
    sink = WandB("pipefisher-test", "offline", {"optimizer": {"lr": 0.01}})
    for record in RECORDS:
        sink.write(record, record["step"])
    sink.close()
    run_file = Path(sink.run.dir).parent / f"run-{sink.run.id}.wandb"  # run.dir: the run folder's files/
    history = _wandb_history(run_file)
    assert [row["_step"] for row in history] == [1, 2, 3]
    for row, record in zip(history, RECORDS):
        assert {key: row[key] for key in scalars(record)} == scalars(record)


@pytest.mark.dist
def test_a_two_process_run_writes_one_event_file_and_one_wandb_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _offline_wandb(monkeypatch, tmp_path / "probe")
    env = {**os.environ, "WANDB_DIR": str(tmp_path)}
    result = subprocess.run(
        [sys.executable, "-m", "pipefisher", "run", str(TINY), "--steps", "2", "--json", "--master-port", "0"]
        + ["--run.tensorboard", str(tmp_path / "tb"), "--run.wandb", "pipefisher-test"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert "2 processes" in result.stderr
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert [line["step"] for line in lines] == [1, 2]
    (event_file,) = (tmp_path / "tb").iterdir()
    assert event_file.name.startswith("events.out.tfevents.")
    events = _event_scalars(tmp_path / "tb")
    assert events["loss"] == [(line["step"], pytest.approx(line["loss"], rel=1e-6)) for line in lines]
    assert {"lr", "step_time_ms", "tokens_per_s", "rank0_peak_memory_mib"} <= events.keys()
    (run_file,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    history = _wandb_history(run_file)
    assert [(row["_step"], row["loss"], row["tokens_per_s"]) for row in history] == [
        (line["step"], line["loss"], line["tokens_per_s"]) for line in lines
    ]


@pytest.mark.parametrize("key", ["tensorboard", "wandb"])
def test_a_sink_without_its_package_is_refused_in_one_line(key: str, tmp_path: Path) -> None:
    """Python's own way to make a package missing: None in sys.modules (find_spec then finds none)."""
    argv = ["pipefisher", "run", str(TINY), f"--run.{key}", str(tmp_path / "out")]
    code = (
        f"import sys; sys.modules[{key!r}] = None; sys.argv = {argv!r}; "
        "from pipefisher.cli.entry import main; sys.exit(main())"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        f"pipefisher: error: run.{key}: the {key} package is not installed; pip install pipefisher[log]"
    ]
    assert not (tmp_path / "out").exists()


def test_the_metrics_file_gets_the_record_with_both_rates_of_a_curvature_run(tmp_path: Path) -> None:
    """The scheduler scales both rates alike: lr_rest is lr times the rest's base over the method's."""
    from builders import tiny_model

    from pipefisher.cli.step_report import StepReporter
    from pipefisher.config import config_from_dict
    from pipefisher.runtime.pipeline.executor import StepResult

    config = config_from_dict(
        {
            "model": tiny_model(),
            "optimizer": {"name": "kfac", "lr": 0.005},
            "kfac": {"lr": 0.02},
            "run": {"metrics": str(tmp_path / "m.jsonl")},
        }
    )
    reporter = StepReporter(config, as_json=False, progress=False)
    reporter(StepResult(step=1, loss=0.5, seconds=0.25, extra={"lr": 0.01}))
    reporter.close(completed=False)
    (line,) = (tmp_path / "m.jsonl").read_text().splitlines()
    record = json.loads(line)
    assert record["lr"] == 0.01 and record["lr_rest"] == pytest.approx(0.0025, rel=1e-15)
    assert record["step_time_ms"] == 250.0 and record["tokens_per_s"] == 4 * reporter.tokens
    # this test process's peak resident memory (no CUDA here): at least what it holds now
    current_mib = int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    assert record["rank0_peak_memory_mib"] >= 0.9 * current_mib
