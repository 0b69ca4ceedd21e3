"""The README tests itself: every command of its shell blocks and every `$ ` line of its examples
runs from the checkout on the README's own arguments, and the lines the README shows after a `$ `
command are what it prints (a line `...` stands for lines left out).

The same few adjustments apply to every command, so that none is silent:
- paths under /tmp/ and docs/ are replaced by a temporary folder (no test writes a tracked file);
- `pipefisher run` gets `--steps 3` (the demo's 300 steps take minutes; where its loss goes is
  held by tests/runtime/test_bert_harness.py);
- `pip install ...` and `python -m pytest ...` are what CI itself runs (.ci/run installs with the
  first and runs the second), so they are not run again here.
"""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
RUN_STEPS = "3"


@dataclass(frozen=True)
class Example:
    """One command of the README, the output lines it shows after it (empty: none shown) and the
    commands before it in its block (run first: a later command may read an earlier one's file)."""

    command: str
    shown: tuple[str, ...]
    line: int
    before: tuple[str, ...] = ()

    def __str__(self) -> str:
        return f"README.md:{self.line}: {self.command[:60]}"


def examples(text: str) -> list[Example]:
    """Commands of ```sh blocks (one per line, `&&` parts apart) and `$ ` lines of plain blocks."""
    found = []
    for match in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.S | re.M):
        language, body = match.group(1), match.group(2)
        first = text[: match.start()].count("\n") + 2
        lines = body.splitlines()
        before: list[str] = []
        if language in ("sh", "bash", "shell"):
            for offset, line in enumerate(lines):
                for part in line.split("&&"):
                    if part.strip() and not part.strip().startswith("#"):
                        found.append(Example(part.strip(), (), first + offset, tuple(before)))
                        before.append(part.strip())
            continue
        for offset, line in enumerate(lines):
            if line.startswith("$ "):
                shown = []
                for following in lines[offset + 1:]:
                    if following.startswith("$ "):
                        break
                    shown.append(following)
                found.append(Example(line[2:].strip(), tuple(shown), first + offset, tuple(before)))
                before.append(line[2:].strip())
    return found


def run_by_ci(command: str) -> bool:
    return command.startswith("pip install") or command.startswith("python -m pytest")


def adjusted(text: str, folder: Path) -> str:
    """The README's text with its /tmp/ and docs/ paths in `folder`."""
    return re.sub(r"(?<![\w/])(/tmp/|docs/)", f"{folder}/", text)


def matches(shown: list[str], printed: list[str]) -> bool:
    """The shown lines, in order, are printed lines; `...` stands for any number of lines."""
    pattern = "".join(".*?" if line.strip() == "..." else re.escape(line.rstrip()) + r"\n" for line in shown)
    return re.match(pattern, "".join(line.rstrip() + "\n" for line in printed), re.S) is not None


EXAMPLES = examples(README.read_text())


def test_the_readme_shows_commands_to_run():
    """Not vacuous: the two commands of a fresh machine and the planning examples are found."""
    commands = [example.command for example in EXAMPLES]
    assert "pipefisher run schedules/tiny-cpu.yaml" in commands and "python -m pytest -q" in commands
    assert any(command.startswith("pipefisher pack") for command in commands)
    assert sum(bool(example.shown) for example in EXAMPLES) >= 4


def shell(command: str, folder: Path) -> subprocess.CompletedProcess:
    """Run a README command with the module's adjustments, from the checkout, with this Python."""
    command = adjusted(command, folder)
    if command.startswith("pipefisher run") and "--steps" not in command:
        command += f" --steps {RUN_STEPS}"
    if command.startswith("pipefisher "):
        command = f"{sys.executable} -m {command}"
    elif command.startswith("python "):
        command = f"{sys.executable} {command[len('python '):]}"
    return subprocess.run(command, shell=True, cwd=ROOT, capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("example", [e for e in EXAMPLES if not run_by_ci(e.command)], ids=str)
def test_a_readme_command_runs_and_prints_what_the_readme_shows(example, tmp_path):
    for earlier in example.before:
        if not run_by_ci(earlier):
            assert shell(earlier, tmp_path).returncode == 0, earlier
    result = shell(example.command, tmp_path)
    assert result.returncode == 0, f"{example}\n{result.stderr[-2000:]}"
    if example.shown:
        shown = [adjusted(line, tmp_path) for line in example.shown]
        assert matches(shown, result.stdout.splitlines()), f"{example}: printed\n{result.stdout}\nREADME shows\n" + "\n".join(shown)
