"""Shared test helpers live beside this file (e.g. `host_reads`); pytest puts this folder on sys.path."""

import signal

# A suite started as a background job of a non-interactive shell inherits SIGINT ignored, and so
# would every command the tests start (and stop with Ctrl-C): give SIGINT its default meaning.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
