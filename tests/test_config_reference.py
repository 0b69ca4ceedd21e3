"""Every setting is declared once: the run-file key reference is generated from the declarations,
`pipefisher config --show` prints a run as pipefisher takes it, and every key can be set as
`--SECTION.KEY VALUE`."""

from pathlib import Path

import pytest
import yaml

from pipefisher.cli.main import main
from pipefisher.config import config_from_dict, load_config
from pipefisher.config.reference import run_file_reference

ROOT = Path(__file__).resolve().parents[1]
RUN_FILES = sorted((ROOT / "schedules").glob("*.yaml"))


def test_the_key_reference_page_is_the_generated_one():
    page = (ROOT / "docs" / "run-file-keys.md").read_text()
    assert page == run_file_reference(), "regenerate it: pipefisher config --keys > docs/run-file-keys.md"


def test_the_reference_names_every_section_and_method():
    page = run_file_reference()
    for section in (
        "model",
        "data",
        "pipeline",
        "optimizer",
        "<method>",
        "kfac",
        "shampoo",
        "checkpoint",
        "comm",
        "run",
    ):
        assert f"## `{section}`" in page
    assert "| `damping` | number | `0.001` | positive |" in page


@pytest.mark.parametrize("run_file", RUN_FILES, ids=lambda path: path.name)
def test_show_prints_the_run_as_a_run_file_of_the_same_run(run_file, capsys):
    assert main(["config", "--show", str(run_file)]) == 0
    assert config_from_dict(yaml.safe_load(capsys.readouterr().out)) == load_config(run_file)


def test_every_key_can_be_set_on_the_command_line(capsys):
    run_file = str(ROOT / "schedules" / "tiny-cpu.yaml")
    assert (
        main(
            [
                "config",
                "--show",
                run_file,
                "--optimizer.betas",
                "[0.8, 0.9]",
                "--kfac.damping",
                "0.02",
                "--run.in_order",
                "true",
            ]
        )
        == 0
    )
    shown = yaml.safe_load(capsys.readouterr().out)
    assert (shown["optimizer"]["betas"], shown["kfac"]["damping"], shown["run"]["in_order"]) == ([0.8, 0.9], 0.02, True)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--optimizer.momentum", "1.5"], "optimizer.momentum: 1.5 must be in [0, 1)"),
        (["--run.steps", "many"], "run.steps: expected an integer, got 'many'"),
        (["--model.nope", "3"], "unrecognized arguments: --model.nope"),
    ],
)
def test_a_bad_key_or_value_exits_2_naming_it(args, message, capsys):
    assert main(["config", "--show", str(ROOT / "schedules" / "tiny-cpu.yaml"), *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_config_needs_one_of_show_and_keys(capsys):
    assert main(["config"]) == 2
    assert "give --show RUN.yaml" in capsys.readouterr().err


def _printed_defaults() -> dict[str, dict[str, str]]:
    """{section: {key: default as the reference page prints it}}; `<method>`'s keys in every method's section."""
    from pipefisher.methods.registry import methods

    printed: dict[str, dict[str, str]] = {}
    section = ""
    for line in run_file_reference().splitlines():
        if line.startswith("## `"):
            section = line[4:-1]
        elif line.startswith("| `"):
            key, _, default = (cell.strip() for cell in line.split("|")[1:4])
            printed.setdefault(section, {})[key.strip("`")] = default.strip("`")
    shared = printed.pop("<method>")
    for name in methods():
        printed[name] = {**shared, **printed.get(name, {})}
    return printed


def test_every_default_the_reference_prints_is_read_back_as_itself():
    from pipefisher.config import config_to_dict
    from pipefisher.core.files import parse_yaml

    defaults = config_to_dict(config_from_dict({}))
    printed = _printed_defaults()
    assert {section: set(keys) for section, keys in printed.items()} == {
        section: set(keys) for section, keys in defaults.items()
    }
    for section, keys in printed.items():
        for key, text in keys.items():
            read = config_to_dict(config_from_dict({section: {key: parse_yaml(text)}}))[section][key]
            assert read == defaults[section][key] and type(read) is type(defaults[section][key]), (
                f"{section}.{key}: {text}"
            )
