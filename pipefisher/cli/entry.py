"""The `pipefisher` console script and `python -m pipefisher`: the CLI run under
`pipefisher.cli.scripts.entry_point` before any of its imports, so that SIGINT or SIGTERM from the
first instant (while the CLI's modules load) ends it with one line and 128 + signal, no traceback."""

from __future__ import annotations

from pipefisher.cli.scripts import entry_point


def main() -> int:
    """The CLI's exit code (`pipefisher.cli.main.main`)."""

    def cli() -> int:
        from pipefisher.cli.main import main as run

        return run()

    return entry_point(cli, "pipefisher")
