import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pipefisher.cli.main import main
from pipefisher.core.profile import uniform_profile
from pipefisher.cli.viz_command import parse_compare


def _rows(text):
    return [line for line in text.splitlines() if line.startswith("rank ")]


def test_entry_point_writes_every_output_type(tmp_path):
    for suffix in (".svg", ".png", ".json", ".txt"):
        out = tmp_path / f"g{suffix}"
        result = subprocess.run(
            ["pipefisher", "viz", "--schedule", "gpipe", "-D", "2", "-N", "2", "-o", str(out), "--width", "40"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 0, result.stderr
        assert out.stat().st_size > 0 and "gpipe (8 ops)" in result.stdout


def test_run_file_gives_the_pipeline_and_flags_override_it(tmp_path, capsys):
    config = str(tmp_path / "run.yaml")
    Path(config).write_text(
        yaml.safe_dump({"pipeline": {"schedule": "1f1b", "stages": 2, "micro_batches": 4, "chunks": 2}})
    )
    assert main(["viz", config, "-o", "-", "--width", "60"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("1f1b: D=2, N=4;") and len(_rows(out)) == 2
    assert main(["viz", config, "--schedule", "interleaved", "-N", "8", "-o", "-", "--width", "60"]) == 0
    assert capsys.readouterr().out.startswith("interleaved: D=2, N=8, v=2;")


def test_compare_syntax():
    assert parse_compare("gpipe, gpipe+kfac,chimera") == [("gpipe", None), ("gpipe", "kfac"), ("chimera", None)]


def test_compare_stacks_schedules(capsys):
    assert main(["viz", "--compare", "gpipe,1f1b,chimera", "-D", "4", "-N", "8", "-o", "-", "--width", "80"]) == 0
    out = capsys.readouterr().out
    titles = [line.split(":")[0] for line in out.splitlines() if ": D=" in line]
    assert titles == ["gpipe", "1f1b", "chimera"] and len(_rows(out)) == 12


def test_kfac_draws_the_refresh_cycle(bert_profile_path, capsys):
    assert (
        main(
            [
                "viz",
                "--schedule",
                "1f1b",
                "-D",
                "4",
                "-N",
                "4",
                "--profile",
                str(bert_profile_path),
                "--curvature",
                "-o",
                "-",
                "--width",
                "100",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert out.startswith("1f1b + PipeFisher: D=4, N=4;") and "K-FAC refresh every" in out
    assert len(_rows(out)) == 4 and any(line.startswith("step ") and "|2" in line for line in out.splitlines())


@pytest.fixture
def unit_profile_path(tmp_path):
    path = tmp_path / "unit.yaml"
    path.write_text(yaml.safe_dump(uniform_profile(4).to_dict()))
    return str(path)


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--schedule", "1f1b", "-D", "4", "-N", "4", "--curvature"],
            "needs --profile FILE with a curvature method's layers",
        ),
        (["--compare", "gpipe,gpipe+kfac", "-D", "4", "-N", "4"], "gpipe+kfac: needs --profile FILE"),
        (
            ["--compare", "gpipe,gpipe+kfac", "-D", "4", "-N", "4", "--profile", "UNIT"],
            "gpipe+kfac: packing needs a profile whose stages list",
        ),
        (
            ["--schedule", "1f1b", "-D", "4", "-N", "4", "--curvature", "--profile", "UNIT"],
            "profile whose stages list `layers`",
        ),
        (["--compare", "gpipe,zigzag", "-D", "4", "-N", "4"], "'zigzag' is not a schedule"),
        (
            ["--compare", "gpipe+shampoo", "-D", "4", "-N", "4", "--profile", "BERT"],
            "gpipe+shampoo: the profile times kfac tasks; write gpipe+kfac",
        ),
        (["--compare", "gpipe", "--schedule", "1f1b", "-D", "4", "-N", "4"], "not both"),
        (["--compare", "gpipe,1f1b", "--curvature", "-D", "4", "-N", "4"], "write S+M for each schedule S"),
        (["--schedule", "gpipe", "-D", "4", "-N", "4", "--chunks", "2"], "--chunks applies to the interleaved"),
        (["--schedule", "gpipe", "-D", "4"], "--stages and --micro-batches are required"),
        (["-D", "4", "-N", "4"], "nothing to draw"),
        (["--schedule", "chimera", "-D", "3", "-N", "3"], "stages D must be even"),
        (["--schedule", "zigzag", "-D", "2", "-N", "2"], "invalid choice: 'zigzag'"),
        (["--timeline", "t.json", "--schedule", "gpipe"], "drop --schedule"),
        (["--timeline", "/nonexistent.json"], "cannot read timeline"),
        (["/nonexistent.yaml"], "cannot read run file"),
    ],
)
def test_invalid_arguments_exit_2_with_one_line(args, message, unit_profile_path, bert_profile_path, capsys):
    args = [{"UNIT": unit_profile_path, "BERT": str(bert_profile_path)}.get(a, a) for a in args]
    assert main(["viz", *args, "-o", "-"]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


@pytest.mark.parametrize(
    "output, message",
    [
        ("out.pdf", "unknown output type"),
        ("/nonexistent/dir/out.svg", "folder '/nonexistent/dir' does not exist; create it first"),
        ("/nonexistent/dir/out.txt", "folder '/nonexistent/dir' does not exist"),
    ],
)
def test_bad_outputs_exit_2(output, message, capsys):
    assert main(["viz", "--schedule", "gpipe", "-D", "2", "-N", "2", "-o", output]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_missing_output_exits_2(capsys):
    assert main(["viz", "--schedule", "gpipe", "-D", "2", "-N", "2"]) == 2
    assert "-o/--output" in capsys.readouterr().err


def test_viz_imports_neither_torch_nor_matplotlib_until_it_draws():
    code = (
        "import sys\nimport pipefisher.cli.main, pipefisher.cli.viz_command, pipefisher.viz.layout, pipefisher.viz.text, "
        "pipefisher.viz.chrome, pipefisher.planning.timeline_file, pipefisher.viz.figure, pipefisher.cli.bert_profile\n"
        "pipefisher.cli.main.build_parser()\n"
        "print('torch' in sys.modules, 'matplotlib' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "False"]


def test_bert_profile_script_builds_a_kfac_profile(tmp_path, capsys):
    from pipefisher.core.profile import load_profile
    from pipefisher.cli.bert_profile import main as bert_main

    csv = tmp_path / "bert-base_times.csv"  # made-up numbers in the reference CSV's columns
    csv.write_text("bs,time_f,time_b,time_kron,time_inv,time_prec\n8,2.7,4.6,6.8,71.6,6.9\n32,9.7,16.5,25.5,71.7,6.8\n")
    out = tmp_path / "p.yaml"
    assert bert_main([str(csv), "-D", "4", "--micro-batch-size", "32", "-o", str(out)]) == 0
    profile = load_profile(out)
    assert profile.num_stages == 4 and all(len(stage.layers) == 18 for stage in profile.stages)
    assert profile.stages[0].forward == pytest.approx(3 * 9.7)
    assert bert_main([str(csv), "-D", "4", "--micro-batch-size", "16", "-o", str(out)]) == 2
    assert "no row for micro-batch size 16" in capsys.readouterr().err
    other = tmp_path / "times.csv"
    other.write_text(csv.read_text())
    assert bert_main([str(other), "-D", "4", "--micro-batch-size", "32", "-o", str(out)]) == 2
    assert "give --model" in capsys.readouterr().err
