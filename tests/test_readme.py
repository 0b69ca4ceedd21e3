"""The README and its docs/ pages test themselves: every command of their shell blocks and every
`$ ` line of their examples runs from the checkout on the page's own arguments, and the lines a
page shows after a `$ ` command are what it prints (a line `...` stands for lines left out).

The same few adjustments apply to every command, so that none is silent:
- paths under /tmp/ and docs/ are replaced by a temporary folder (no test writes a tracked file);
- `pipefisher run` gets `--steps 3` (the demo's 300 steps take minutes; where its loss goes is
  held by tests/runtime/test_bert_harness.py);
- `pip install ...` and `python -m pytest ...` are what CI itself runs (.ci/run installs with the
  first and runs the second), so they are not run again here;
- a command runs once per test session: a page that shows a command another page shows (or that
  a later command of its block needs) reuses its result.
Commands in prose (`inline code`) and in plain blocks without `$ ` (synopses, a cluster's torchrun,
the README's tour of the measured `run`, `profile` and `export` output) are not run here.
"""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: records that experiments/ or a GPU session wrote (their commands ran there), not pages
RECORDS = {
    "bench_pipefisher_shampoo.md",
    "bench_zero_bubble.md",
    "gpu_h100.md",
    "overhead.md",
    "powersgd_bert.md",
    "zero_memory.md",
}
PAGES = [ROOT / "README.md"] + sorted(page for page in (ROOT / "docs").glob("*.md") if page.name not in RECORDS)
RUN_STEPS = "3"


@dataclass(frozen=True)
class Example:
    """One command of a page, the output lines it shows after it (empty: none shown) and the
    commands before it in its block (run first: a later command may read an earlier one's file)."""

    page: str
    command: str
    shown: tuple[str, ...]
    line: int
    before: tuple[str, ...] = ()

    def __str__(self) -> str:
        return f"{self.page}:{self.line}: {self.command[:60]}"


def examples(text: str, page: str) -> list[Example]:
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
                        found.append(Example(page, part.strip(), (), first + offset, tuple(before)))
                        before.append(part.strip())
            continue
        for offset, line in enumerate(lines):
            if line.startswith("$ "):
                shown = []
                for following in lines[offset + 1 :]:
                    if following.startswith("$ "):
                        break
                    shown.append(following)
                found.append(Example(page, line[2:].strip(), tuple(shown), first + offset, tuple(before)))
                before.append(line[2:].strip())
    return found


def run_by_ci(command: str) -> bool:
    return command.startswith("pip install") or command.startswith("python -m pytest")


def adjusted(text: str, folder: Path) -> str:
    """A page's text with its /tmp/ and docs/ paths in `folder`."""
    return re.sub(r"(?<![\w/])(/tmp/|docs/)", f"{folder}/", text)


def matches(shown: list[str], printed: list[str]) -> bool:
    """The shown lines, in order, are printed lines; `...` stands for any number of lines."""
    pattern = "".join(".*?" if line.strip() == "..." else re.escape(line.rstrip()) + r"\n" for line in shown)
    return re.match(pattern, "".join(line.rstrip() + "\n" for line in printed), re.S) is not None


EXAMPLES = [example for page in PAGES for example in examples(page.read_text(), page.relative_to(ROOT).as_posix())]


def test_the_pages_show_commands_to_run():
    """Not vacuous: the two commands of a fresh machine and the planning examples are found, and
    every page the test reads is one the README links to."""
    commands = [example.command for example in EXAMPLES if example.page == "README.md"]
    assert "pipefisher run schedules/tiny-cpu.yaml" in commands
    (test_command,) = [command for command in commands if command.startswith("python -m pytest -q -n")]
    assert test_command.replace("python", "python3", 1) in (ROOT / ".ci" / "run").read_text(), (
        "CI runs the README's tests"
    )
    assert any(example.command.startswith("pipefisher pack") for example in EXAMPLES)
    assert sum(bool(example.shown) for example in EXAMPLES) >= 4
    readme = PAGES[0].read_text()
    assert len(PAGES) > 1 and all(f"(docs/{page.name})" in readme for page in PAGES[1:])


def anchors(page: Path) -> set[str]:
    """The anchors GitHub gives a page's headings."""
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
    return {
        re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")
        for title in re.findall(r"^#+ (.*)$", text, re.M)
    }


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.relative_to(ROOT).as_posix())
def test_a_pages_relative_links_and_images_exist(page):
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
    for target, anchor in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)", text):
        if re.match(r"\w+://", target):
            continue
        linked = (page.parent / target) if target else page
        assert linked.exists(), f"{page.name}: ({target}) does not exist"
        if anchor and linked.suffix == ".md":
            assert anchor in anchors(linked), f"{page.name}: {target}#{anchor}: no such heading"


@pytest.fixture(scope="session")
def results(tmp_path_factory):
    """Each command's result by its shell command line, all in one folder (pages that write a path
    write the same file)."""
    return tmp_path_factory.mktemp("pages"), {}


def shell(command: str, results) -> subprocess.CompletedProcess:
    """Run a page's command with the module's adjustments, from the checkout, with this Python (once)."""
    folder, done = results
    command = adjusted(command, folder)
    if command.startswith("pipefisher run") and "--steps" not in command:
        command += f" --steps {RUN_STEPS}"
    if command.startswith("pipefisher "):
        command = f"{sys.executable} -m {command}"
    elif command.startswith("python "):
        command = f"{sys.executable} {command[len('python ') :]}"
    if command not in done:
        done[command] = subprocess.run(command, shell=True, cwd=ROOT, capture_output=True, text=True, timeout=600)
    return done[command]


@pytest.mark.parametrize("example", [e for e in EXAMPLES if not run_by_ci(e.command)], ids=str)
def test_a_page_command_runs_and_prints_what_the_page_shows(example, results):
    for earlier in example.before:
        if not run_by_ci(earlier):
            assert shell(earlier, results).returncode == 0, earlier
    result = shell(example.command, results)
    assert result.returncode == 0, f"{example}\n{result.stderr[-2000:]}"
    if example.shown:
        shown = [adjusted(line, results[0]) for line in example.shown]
        assert matches(shown, result.stdout.splitlines()), (
            f"{example}: printed\n{result.stdout}\nthe page shows\n" + "\n".join(shown)
        )
