import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pipefisher.methods.registry import task_rules
from pipefisher.cli.main import main
from pipefisher.core.profile import uniform_profile


def run_cli(*args: str) -> subprocess.CompletedProcess:
    """The installed entry point, as a user runs it."""
    return subprocess.run(["pipefisher", *args], capture_output=True, text=True, timeout=60)


def test_simulate_json_from_the_entry_point():
    result = run_cli("simulate", "--schedule", "chimera", "--stages", "8", "--micro-batches", "8", "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["step_time"] == pytest.approx(36.0)
    assert [d["rank"] for d in data["devices"]] == list(range(8))
    for device in data["devices"]:
        assert device["busy_time"] + device["bubble_time"] == pytest.approx(data["step_time"])


def test_simulate_table_names_units_and_ranks():
    result = run_cli("simulate", "--schedule", "chimera", "--stages", "8", "--micro-batches", "8")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "step time 36 units" in lines[0] and "bubble 33.3 %" in lines[0]
    assert "busy [units]" in lines[1]
    assert len(lines) == 2 + 8


def test_simulate_with_a_profile_uses_its_time_unit(tmp_path, capsys):
    path = tmp_path / "p.yaml"
    profile = uniform_profile(4, 10.0, 20.0)
    path.write_text(yaml.safe_dump({**profile.to_dict(), "time_unit": "ms"}))
    assert main(["simulate", "--schedule", "1f1b", "-D", "4", "-N", "8", "--profile", str(path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["time_unit"] == "ms" and data["step_time"] == pytest.approx(30 * 11)


def test_interleaved_default_profile_keeps_work_per_rank():
    assert main(["simulate", "--schedule", "interleaved", "-D", "4", "-N", "8", "--chunks", "4", "--json"]) == 0


@pytest.mark.parametrize(
    "args, message",
    [
        (["simulate", "--schedule", "chimera", "--stages", "3", "--micro-batches", "6"], "stages D must be even"),
        (["simulate", "--schedule", "zigzag", "-D", "2", "-N", "2"], "invalid choice: 'zigzag'"),
        (["simulate", "--schedule", "1f1b", "-D", "two", "-N", "2"], "'two' is not an integer"),
        (
            ["simulate", "--schedule", "1f1b", "-D", "4", "-N", "4", "--profile", "/nonexistent.yaml"],
            "cannot read profile",
        ),
        (["simulate", "--schedule", "gpipe", "-D", "4", "-N", "4", "--chunks", "2"], "chunks apply to the interleaved"),
        ([], "required: command"),
        (
            ["simulate", "--schedule", "1f1b", "-D", "100000", "-N", "100000"],
            "--stages 100000 x --micro-batches 100000 = 10,000,000,000 slots per step: simulating takes at most 262,144",
        ),
        (
            ["simulate", "--schedule", "interleaved", "-D", "256", "-N", "1024", "--chunks", "2"],
            "x 2 chunks = 524,288 slots",
        ),
        (
            ["viz", "--compare", "1f1b,zbv", "-D", "100000", "-N", "100000", "-o", "-"],
            "simulating takes at most 262,144",
        ),
    ],
)
def test_usage_errors_exit_2_with_one_line(args, message, capsys):
    assert main(args) == 2
    err = capsys.readouterr().err
    assert message in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_wrong_profile_stage_count_exits_2(tmp_path, capsys):
    path = tmp_path / "p.json"
    uniform_profile(3).save(path)
    assert main(["simulate", "--schedule", "1f1b", "-D", "4", "-N", "4", "--profile", str(path)]) == 2
    assert "profile has 3 stages but the schedule needs 4" in capsys.readouterr().err


def test_usage_error_from_a_real_process_has_no_traceback():
    result = run_cli("simulate", "--schedule", "chimera", "--stages", "3", "--micro-batches", "6")
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "Traceback" not in result.stderr


def test_module_entry_point_works():
    result = subprocess.run(
        [sys.executable, "-m", "pipefisher", "simulate", "--schedule", "gpipe", "-D", "2", "-N", "2", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["step_time"] == pytest.approx(9.0)


@pytest.fixture
def bert_like_profile(tmp_path):
    from pipefisher.planning.transformer_profile import BlockTimes, transformer_profile

    times = BlockTimes(time_f=9.7, time_b=16.5, time_kron=25.5, time_inv=71.7, time_prec=6.8)
    path = tmp_path / "bert.yaml"
    transformer_profile(times, 12, 4, 768, 3072, 32, device="P100").save(path)
    return path


def test_pack_json_has_the_documented_fields(bert_like_profile, tmp_path, capsys):
    plan_path = tmp_path / "plan.json"
    code = main(
        [
            "pack",
            "--profile",
            str(bert_like_profile),
            "--schedule",
            "1f1b",
            "-D",
            "4",
            "-N",
            "4",
            "--json",
            "-o",
            str(plan_path),
        ]
    )
    assert code == 0
    data = json.loads(capsys.readouterr().out)
    assert isinstance(data["refresh_steps"], int) and data["refresh_steps"] >= data["lower_bound"] >= 1
    assert data["step_time"] >= data["first_order_step_time"] > 0
    assert data["exposed_share"] == pytest.approx(data["step_time"] / data["first_order_step_time"] - 1)
    assert 0 <= data["bubble_utilization"] <= 1
    assert len(data["devices"]) == 4 and data["time_unit"] == "ms"
    frontier = data["frontier"]
    assert [p["refresh_steps"] for p in frontier] == sorted(p["refresh_steps"] for p in frontier)
    assert frontier[0]["refresh_steps"] <= data["lower_bound"] or frontier[0]["refresh_steps"] == data["refresh_steps"]
    chosen = next(p for p in frontier if p["refresh_steps"] == data["refresh_steps"])
    assert chosen["overhead"] == pytest.approx(data["overhead"]) and data["reason"].startswith(
        f"k = {data['refresh_steps']}"
    )
    assert data["capture_peak_mib"] > 0 and data["percentile"] == 90.0
    assert max(d["capture_peak_mib"] for d in data["devices"]) == pytest.approx(data["capture_peak_mib"])
    from pipefisher.planning.plan import Plan, validate_plan

    assert validate_plan(Plan.load(plan_path, task_rules)).refresh_steps == data["refresh_steps"]


def test_pack_table_from_the_entry_point(bert_like_profile):
    result = run_cli("pack", "--profile", str(bert_like_profile), "--schedule", "gpipe", "-D", "4", "-N", "4")
    assert result.returncode == 0, result.stderr
    assert "refresh interval" in result.stdout and "[ms]" in result.stdout
    assert "exposed optimizer time: " in result.stdout and " % of the first-order step" in result.stdout


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--schedule", "1f1b", "-D", "8", "-N", "8"], "profile has 4 stages but the schedule needs 8"),
        (["--schedule", "zigzag", "-D", "4", "-N", "4"], "invalid choice: 'zigzag'"),
        (["--schedule", "1f1b", "-D", "4", "-N", "4", "--margin", "1.5"], "must be in [0, 1)"),
        (["--schedule", "1f1b", "-D", "4", "-N", "4", "--percentile", "101"], "--percentile: 101 must be in (0, 100]"),
        (["--schedule", "1f1b", "-D", "4", "-N", "4", "--percentile", "0"], "--percentile: 0 must be in (0, 100]"),
        (
            ["--schedule", "1f1b", "-D", "4", "-N", "4", "--max-capture-mb", "-3"],
            "--max-capture-mb: -3 must be >= 0 (0 = no cap)",
        ),
        (
            ["--schedule", "1f1b", "-D", "4", "-N", "4", "--max-capture-mb", "nan"],
            "--max-capture-mb: nan must be >= 0 (0 = no cap)",
        ),
        (
            ["--schedule", "1f1b", "-D", "4", "-N", "4", "--max-refresh-steps", "-1"],
            "--max-refresh-steps: -1 must be >= 0 (0 = no cap)",
        ),
        (
            ["--schedule", "1f1b", "-D", "4", "-N", "10000"],
            "--stages 4 x --micro-batches 10000 = 40,000 slots per step: packing takes at most 32,768",
        ),
    ],
)
def test_pack_usage_errors_exit_2(bert_like_profile, extra, message, capsys):
    assert main(["pack", "--profile", str(bert_like_profile), *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_pack_rejects_negative_times_and_profiles_without_layers(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "schema: pipefisher.profile/v1\nstages:\n  - {forward: 1, backward: -2}\n  - {forward: 1, backward: 2}\n"
    )
    assert main(["pack", "--profile", str(bad), "--schedule", "1f1b", "-D", "2", "-N", "2"]) == 2
    assert "stages[0].backward: -2 is negative" in capsys.readouterr().err
    plain = tmp_path / "plain.yaml"
    uniform_profile(2).save(plain)
    assert main(["pack", "--profile", str(plain), "--schedule", "1f1b", "-D", "2", "-N", "2"]) == 2
    assert "no stage lists layers of a curvature method" in capsys.readouterr().err


def test_a_capture_cap_that_changes_the_plan_is_reported_without_contradiction(tmp_path, capsys):
    """docs/cli.md's BERT-Large paper run on the shipped P100 block times, captures capped at 4000
    MiB: the frontier is of the plans before the cap, and `why` says what the cap cost."""
    times = Path(__file__).resolve().parents[1] / "profiles" / "reference" / "bert-large_time_memory_p100.csv"
    profile = tmp_path / "bl8.yaml"
    made = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipefisher.cli.bert_profile",
            str(times),
            "-D",
            "8",
            "--micro-batch-size",
            "32",
            "-o",
            str(profile),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert made.returncode == 0, made.stderr
    assert (
        main(
            [
                "pack",
                "--profile",
                str(profile),
                "--schedule",
                "chimera",
                "-D",
                "8",
                "-N",
                "8",
                "--max-capture-mb",
                "4000",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "then the 4000 MiB capture cap moved curvature earlier, at 9.86 % overhead" in out
    assert "frontier before the capture cap (k: overhead): 4: 0.00 %" in out and "(packing overhead 9.86 %)" in out
    assert "rank  steps used  bound" in out


def test_a_reader_that_leaves_early_ends_the_command_quietly():
    """`pipefisher simulate ... | head -1`: no BrokenPipeError traceback, exit 128 + SIGPIPE."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "pipefisher", "simulate", "--schedule", "1f1b", "-D", "64", "-N", "64"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    proc.stdout.close()  # before the command writes: its first write meets a closed pipe
    assert proc.wait(timeout=60) == 141
    assert proc.stderr.read() == ""


@pytest.fixture
def files(tmp_path, bert_like_profile):
    """A plan written by pack -o, a binary file, an empty file and a folder, beside the profile."""
    plan = tmp_path / "plan.json"
    assert (
        main(
            [
                "pack",
                "--profile",
                str(bert_like_profile),
                "--schedule",
                "gpipe",
                "-D",
                "4",
                "-N",
                "4",
                "-o",
                str(plan),
                "--json",
            ]
        )
        == 0
    )
    (tmp_path / "binary.yaml").write_bytes(bytes(range(256)))
    (tmp_path / "empty.yaml").write_text("\n")
    (tmp_path / "folder").mkdir()
    return tmp_path


@pytest.mark.parametrize(
    "args, message",
    [
        (["pack", "--profile", "{plan}"], "{plan} is a pipefisher plan file (pipefisher.plan/v2), not a profile"),
        (["pack", "--profile", "{binary}"], "{binary}: not a text file; a profile is YAML or JSON text"),
        (["pack", "--profile", "{empty}"], "{empty}: the profile is empty"),
        (["pack", "--profile", "{folder}"], "is a folder; give the profile's file"),
        (["pack", "--profile", "{profile}", "-o", "{folder}"], "-o {folder}: is a folder; give a file name inside it"),
        (
            ["pack", "--profile", "{profile}", "-o", "{missing}/plan.json"],
            "folder '{missing}' does not exist; create it first",
        ),
        (
            ["viz", "--timeline", "{profile}", "-o", "-"],
            "is a pipefisher profile file (pipefisher.profile/v2), not a timeline",
        ),
        (
            ["viz", "--schedule", "1f1b", "-D", "2", "-N", "4", "-o", "{missing}/a.png"],
            "folder '{missing}' does not exist",
        ),
    ],
)
def test_input_and_output_files_are_checked_before_any_work(files, args, message, capsys):
    """Every file a command names: exists, is a file of text, of the expected kind (a pipefisher
    file of another kind is named as such); every output: its folder exists and it is no folder."""
    names = {
        "plan": files / "plan.json",
        "binary": files / "binary.yaml",
        "empty": files / "empty.yaml",
        "folder": files / "folder",
        "profile": files / "bert.yaml",
        "missing": files / "missing",
    }
    fill = lambda text: text.format(**{key: str(value) for key, value in names.items()})
    capsys.readouterr()
    assert (
        main([fill(a) for a in args] + (["--schedule", "gpipe", "-D", "4", "-N", "4"] if args[0] == "pack" else []))
        == 2
    )
    err = capsys.readouterr().err
    assert fill(message) in err and err.count("\n") == 1, err


def test_a_folder_is_written_whole_or_not_at_all(tmp_path):
    from pipefisher.core.files import write_folder_atomically

    def interrupted(folder):
        (folder / "config.json").write_text("{}")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_folder_atomically(tmp_path / "model", interrupted)
    assert list(tmp_path.iterdir()) == []
    write_folder_atomically(tmp_path / "model", lambda folder: (folder / "config.json").write_text("{}"))
    write_folder_atomically(tmp_path / "model", lambda folder: (folder / "weights").write_text("w"))
    assert sorted(p.name for p in (tmp_path / "model").iterdir()) == ["config.json", "weights"]
    assert [p.name for p in tmp_path.iterdir()] == ["model"]


TINY = str(Path(__file__).resolve().parents[1] / "schedules" / "tiny-cpu.yaml")


@pytest.mark.parametrize(
    "args, line",
    [
        (
            ["run", TINY, "--kfac.damp", "0.3"],
            "pipefisher: error: unrecognized argument --kfac.damp; did you mean --kfac.damping? (see pipefisher run --help)",
        ),
        (
            ["config", "--show", TINY, "--kfac.dampng=0.3"],
            "pipefisher: error: unrecognized argument --kfac.dampng; did you mean --kfac.damping? (see pipefisher config --help)",
        ),
        (
            ["run", TINY, "--step", "3"],
            "pipefisher: error: unrecognized argument --step; did you mean --steps? (see pipefisher run --help)",
        ),
        (
            ["simulate", "--schedule", "1f1b", "-D", "2", "-N", "4", "--micro-batch", "4"],
            "pipefisher: error: unrecognized argument --micro-batch; did you mean --micro-batches? (see pipefisher simulate --help)",
        ),
    ],
)
def test_an_abbreviated_or_mistyped_option_is_refused_with_the_one_it_meant(args, line, capsys):
    assert main(args) == 2
    assert capsys.readouterr().err == line + "\n"


def test_no_parser_of_the_package_or_experiments_takes_abbreviations():
    root = Path(__file__).resolve().parents[1]
    calls = 0
    for path in [*root.glob("pipefisher/**/*.py"), *root.glob("experiments/*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "argparse.ArgumentParser":
                calls += 1
                keywords = {keyword.arg: ast.unparse(keyword.value) for keyword in node.keywords}
                assert keywords.get("allow_abbrev") == "False", f"{path.relative_to(root)}:{node.lineno}"
    assert calls > 1


@pytest.mark.parametrize(
    "args, line",
    [
        (
            ["--steps", "99999999999999999999999"],
            "run.steps: 99999999999999999999999 exceeds 1,000,000,000, more steps than any run takes (12 days at 1 ms a step)",
        ),
        (
            ["--pipeline.stages", "9999999"],
            "pipeline.stages: 9999999 exceeds 1,048,576, more than any cluster could run (2^20)",
        ),
    ],
)
def test_absurd_counts_are_refused_before_anything_starts(args, line, capsys):
    assert main(["run", TINY, *args]) == 2
    assert capsys.readouterr().err == f"pipefisher: error: {line}\n"


def test_numbers_on_the_command_line_are_read_as_in_a_run_file(capsys):
    assert (
        main(["config", "--show", TINY, "--optimizer.lr", "1e-3", "--kfac.damping", "3E-2", "--run.steps", "1e3"]) == 0
    )
    shown = yaml.safe_load(capsys.readouterr().out)
    assert (shown["optimizer"]["lr"], shown["kfac"]["damping"], shown["run"]["steps"]) == (0.001, 0.03, 1000)


def test_a_method_key_flag_with_another_optimizer_is_a_warning(capsys):
    assert (
        main(["run", TINY, "--kfac.damping", "0.2", "--reference", "--trace", "unused"]) == 2
    )  # stops before training
    assert (
        "pipefisher: warning: --kfac.damping has no effect with optimizer lamb; it applies to --optimizer kfac\n"
        in capsys.readouterr().err
    )


def test_version_is_the_installed_distributions():
    from importlib.metadata import version

    result = run_cli("--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"pipefisher {version('pipefisher')}\n"


@pytest.mark.parametrize("command", ["run", "profile"])
def test_run_and_profile_help_say_every_key_is_a_flag(command, capsys):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    assert "Every run-file key is also a flag --SECTION.KEY VALUE" in " ".join(capsys.readouterr().out.split())
