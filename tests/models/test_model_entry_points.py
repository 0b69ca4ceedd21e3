"""Model kinds are plugins through the ``pipefisher.models`` entry-point group, as methods are
through ``pipefisher.methods``: an installed distribution's kind trains (`pipefisher run
--reference`), while one entry that does not load and one that takes a built-in kind's name are
one warning each and skipped."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

KIND_MODULE = '''
import dataclasses

from pipefisher.models.kind import ModelKind
from pipefisher.models.kinds import MLP


def build(run):
    """A deep MLP under another name: the regression MLP of the run's model section."""
    from pipefisher.models.tiny import TinyRegression

    return TinyRegression(dataclasses.replace(run.config.model, kind="mlp"))


DEEP = ModelKind(
    "deep",
    ("synthetic",),
    ("layers", "hidden", "input_dim", "output_dim"),
    lambda model: f"deep layers {model.layers}",
    f"{__name__}:build",
    blocks_key="layers",
    tensor_parallel=False,
)
CLASH = dataclasses.replace(MLP, identity=lambda model: "not the built-in mlp")
'''

RUN_FILE = """
model: {kind: deep, layers: 2, hidden: 8, seq_len: 4, input_dim: 4, output_dim: 2}
data: {kind: synthetic, micro_batch_size: 2}
pipeline: {schedule: 1f1b, stages: 2, micro_batches: 2}
optimizer: {name: sgd, lr: 0.05}
run: {steps: 2, seed: 0}
"""


@pytest.fixture
def plugins(tmp_path) -> Path:
    """A distribution on the import path with three model entry points: a kind `deep`, one naming
    a missing attribute and one claiming the built-in name `mlp`."""
    (tmp_path / "mymodels").mkdir()
    (tmp_path / "mymodels" / "__init__.py").write_text("")
    (tmp_path / "mymodels" / "kinds.py").write_text(KIND_MODULE)
    info = tmp_path / "mymodels-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: mymodels\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        "[pipefisher.models]\ndeep = mymodels.kinds:DEEP\nbroken = mymodels.kinds:MISSING\nmlp = mymodels.kinds:CLASH\n"
    )
    (tmp_path / "deep.yaml").write_text(RUN_FILE)
    return tmp_path


def test_an_installed_model_kind_trains_and_bad_entries_are_one_warning_each(plugins):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(plugins)])}
    result = subprocess.run(
        [sys.executable, "-m", "pipefisher", "run", str(plugins / "deep.yaml"), "--reference", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert result.returncode == 0, result.stderr
    warnings = [line for line in result.stderr.splitlines() if "warning" in line]
    assert warnings == [
        "pipefisher: warning: model kind plugin 'broken' (entry point mymodels.kinds:MISSING) did not load: "
        "AttributeError: module 'mymodels.kinds' has no attribute 'MISSING'; runs and commands that do not use it work",
        "pipefisher: warning: model kind plugin 'mlp' (entry point mymodels.kinds:CLASH): model kind name 'mlp' is taken by "
        "a built-in model kind; choose another name; skipped",
    ]
    assert "Traceback" not in result.stderr
    assert len([line for line in result.stdout.splitlines() if '"loss"' in line]) == 2, result.stdout


def test_without_the_plugin_the_kind_is_unknown(plugins):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-m", "pipefisher", "run", str(plugins / "deep.yaml"), "--reference"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert result.returncode == 2
    assert "model.kind: 'deep' is not one of transformer, mlp, bert, hf" in result.stderr
