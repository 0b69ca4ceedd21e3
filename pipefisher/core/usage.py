"""The usage error every command reports: bad command-line or run-file input, printed as one line
with exit code 2 (no traceback)."""

USAGE_ERROR = 2


class UsageError(Exception):
    """Bad command-line input; printed as one line, exit code 2."""
