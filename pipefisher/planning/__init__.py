"""Planning: simulation, task graphs, plans, packing, communication order and parallel layouts. Nothing under this folder imports torch (tests/test_planning_is_torch_free.py)."""
