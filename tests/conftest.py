"""Shared test helpers live beside this file (e.g. `host_reads`); pytest puts this folder on sys.path."""
