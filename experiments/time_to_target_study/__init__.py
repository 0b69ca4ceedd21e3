"""The time-to-target study's parts (experiments/time_to_target.py runs it)."""
