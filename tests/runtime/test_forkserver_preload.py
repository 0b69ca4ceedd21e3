"""A run's ranks fork from a server that has imported its model's modules once (`ModelKind.preload`)."""

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from pipefisher.models.registry import preload_of

GPT2 = "transformers.models.gpt2.modeling_gpt2"


def imported(rank: int, world: int, module: str) -> bool:
    """Whether `module` was imported when the rank's function began."""
    return module in sys.modules


def test_a_hugging_face_run_preloads_its_family_and_other_kinds_nothing(tmp_path):
    assert preload_of(SimpleNamespace(kind="hf", hf_config="gpt2-tiny"))[-1] == GPT2
    assert preload_of(SimpleNamespace(kind="hf", hf_config="llama-tiny"))[-1].endswith("llama.modeling_llama")
    config = tmp_path / "config.json"
    config.write_text('{"model_type": "bert"}')
    assert preload_of(SimpleNamespace(kind="hf", hf_config=str(config)))[-1].endswith("bert.modeling_bert")
    assert preload_of(SimpleNamespace(kind="hf", hf_config=str(tmp_path / "missing.json"))) == (
        "pipefisher.models.hf",
        "transformers.modeling_utils",
    ), "the builder, not the preload, names a bad config"
    assert preload_of(SimpleNamespace(kind="bert")) == () and preload_of(SimpleNamespace(kind="nope")) == ()


@pytest.mark.dist
def test_ranks_fork_with_the_preloaded_modules_and_skip_missing_ones():
    """In a fresh launcher (this worker's forkserver runs already): both ranks begin with `wave`
    imported, a standard module that neither torch nor pipefisher imports, nor the ranks; a module
    that does not exist is skipped."""
    script = (
        "from test_forkserver_preload import imported; "
        "from pipefisher.runtime.training.launch import run_group; "
        "print(run_group(imported, 2, args=('wave',), timeout=30, deadline=120, preload=['wave', 'no_such.module']))"
    )
    here = Path(__file__).parent
    done = subprocess.run([sys.executable, "-c", script], cwd=here, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[True, True]"
