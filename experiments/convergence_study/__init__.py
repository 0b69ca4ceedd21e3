"""The convergence study's parts (experiments/convergence.py runs it)."""
