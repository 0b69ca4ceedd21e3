"""The layout planner: every layout of a GPU count, its predicted step time and memory, the best
packed and ranked. It reads run files, so it sits above `pipefisher.config` and the method and
model registries (tests/test_layers.py). Pure Python: no torch."""
