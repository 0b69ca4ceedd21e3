"""Experiments: benchmarks, checks and studies, each a script run as `python experiments/NAME.py`
(`--help` says what it does) and importable from the checkout root as `experiments.NAME` (tests
do). They use pipefisher's public API only: the run's parts, training, launching and measuring
from `pipefisher.runtime.training` (its docstring lists them), a script's `entry_point` from
`pipefisher.cli.scripts`, the configuration, planning and model packages; `common` holds what
only experiments share."""
