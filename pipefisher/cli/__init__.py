"""The `pipefisher` command line: `main` (the entry point), its arguments and the checks before a run."""
