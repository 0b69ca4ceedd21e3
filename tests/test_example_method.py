"""The example method plugin of `examples/pipefisher-diagonal-ggn` (a method written outside the
package on its public API, `docs/writing-a-method.md`), as a user would have it installed: its
source folder on the import path and its ``pipefisher.methods`` entry point visible (a dist-info
in a temporary folder, no pip), held to its reference with `pipefisher.testing` on every
registered schedule (2 stages, 6 steps) and with 2 replicas, and not vacuous."""

import sys
from pathlib import Path

import pytest

from pipefisher import testing
from pipefisher.methods import registry

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "pipefisher-diagonal-ggn"


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """The example on sys.path (spawned ranks take this path) with its entry point, registered in
    this process by the registry's entry-point scan."""
    folder = tmp_path_factory.mktemp("site")
    info = folder / "pipefisher_diagonal_ggn-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: pipefisher-diagonal-ggn\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text("[pipefisher.methods]\ndiag_ggn = pipefisher_diagonal_ggn.method:DIAG_GGN\n")
    sys.path[:0] = [str(EXAMPLE), str(folder)]
    registry.read_entry_points_again()  # now that the entry point is on the path
    try:
        assert "diag_ggn" in registry.methods(), "the example's entry point did not register"
        yield registry.method("diag_ggn")
    finally:
        registry.unregister("diag_ggn")
        for path in (str(EXAMPLE), str(folder)):
            sys.path.remove(path)


def run(schedule: str, data_parallel: int = 1, **section):
    return testing.method_run("diag_ggn", schedule, data_parallel, refresh_steps=2, **section)


def test_it_is_small():
    lines = sum(len(path.read_text().splitlines()) for path in (EXAMPLE / "pipefisher_diagonal_ggn").glob("*.py"))
    assert lines <= 250, f"the example method is {lines} lines"


def test_it_is_not_vacuous(installed):
    testing.assert_not_vacuous(run("1f1b", first_order="sgd"))


@pytest.mark.dist
@pytest.mark.parametrize("schedule", testing.schedules())
def test_it_equals_its_reference(installed, schedule):
    testing.assert_equal_to_reference(run(schedule))


@pytest.mark.dist
def test_it_equals_its_reference_with_two_replicas(installed):
    testing.assert_equal_to_reference(run("1f1b", data_parallel=2))
