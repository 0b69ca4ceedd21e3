"""The method registry takes each name once: a plugin that does not load, or whose name is taken
(a plugin called `kfac`), is one warning and every command that does not use it works; `register`
refuses a second method of a taken name."""

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipefisher.methods.kfac.method import KFAC
from pipefisher.methods.registry import method, register, unregister
from pipefisher.methods.shampoo.method import SHAMPOO

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def plugins(tmp_path) -> Path:
    """An installed distribution (a dist-info on the import path) with two method entry points: one
    naming a missing attribute, one a method called `kfac` (Shampoo under K-FAC's name)."""
    (tmp_path / "mypkg").mkdir()
    (tmp_path / "mypkg" / "__init__.py").write_text("")
    (tmp_path / "mypkg" / "mod.py").write_text(
        "import dataclasses\nfrom pipefisher.methods.shampoo.method import SHAMPOO\n"
        "FAKE = dataclasses.replace(SHAMPOO, name='kfac')\n"
    )
    info = tmp_path / "mypkg-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: mypkg\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[pipefisher.methods]\nbroken = mypkg.mod:MISSING\nkfac = mypkg.mod:FAKE\n")
    return tmp_path


def test_broken_and_clashing_plugins_are_one_warning_each(plugins):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(plugins)])}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipefisher",
            "run",
            str(ROOT / "schedules" / "tiny-regression.yaml"),
            "--reference",
            "--steps",
            "1",
            "--optimizer",
            "kfac",
            "--kfac-refresh-steps",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert result.returncode == 0, result.stderr
    warnings = [line for line in result.stderr.splitlines() if "warning" in line]
    assert warnings == [
        "pipefisher: warning: method plugin 'broken' (entry point mypkg.mod:MISSING) did not load: AttributeError: "
        "module 'mypkg.mod' has no attribute 'MISSING'; runs and commands that do not use it work",
        "pipefisher: warning: method plugin 'kfac' (entry point mypkg.mod:FAKE): method name 'kfac' is taken by the built-in "
        "K-FAC; choose another name; skipped",
    ]
    assert "K-FAC refresh every 1 steps" in result.stderr and "Traceback" not in result.stderr


def test_register_refuses_a_taken_name_but_not_the_same_method():
    assert register(KFAC) is KFAC
    with pytest.raises(ValueError, match="method name 'kfac' is taken by the built-in K-FAC; choose another name"):
        register(dataclasses.replace(SHAMPOO, name="kfac"))
    unregister("kfac")  # built-in methods stay
    assert method("kfac") is KFAC
    other = dataclasses.replace(SHAMPOO, name="other_method")
    register(other)
    try:
        with pytest.raises(ValueError, match="taken by another method"):
            register(dataclasses.replace(SHAMPOO, name="other_method"))
    finally:
        unregister("other_method")
