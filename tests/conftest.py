"""Shared test helpers live beside this file (e.g. `host_reads`); pytest puts this folder on sys.path."""

import signal

import pytest

# A suite started as a background job of a non-interactive shell inherits SIGINT ignored, and so
# would every command the tests start (and stop with Ctrl-C): give SIGINT its default meaning.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="session")
def forkserver_with_hf_models():
    """This worker's forkserver, started once with the shipped Hugging Face families imported
    (`ModelKind.preload`): every rank a test starts forks with them, instead of importing
    transformers itself (about 3 s of CPU per rank)."""
    from importlib.util import find_spec
    from types import SimpleNamespace

    from pipefisher.models.registry import preload_of
    from pipefisher.runtime.training.launch import start_forkserver

    if find_spec("transformers") is not None:
        families = [
            preload_of(SimpleNamespace(kind="hf", hf_config=c)) for c in ("gpt2-tiny", "llama-tiny", "bert-tiny")
        ]
        start_forkserver(sorted({module for modules in families for module in modules}))


@pytest.fixture(autouse=True)
def _process_groups_share_the_forkserver(request):
    """Tests that start process groups: those marked `dist` and those under tests/runtime."""
    if request.node.get_closest_marker("dist") is not None or "runtime" in request.node.path.parent.parts:
        request.getfixturevalue("forkserver_with_hf_models")
