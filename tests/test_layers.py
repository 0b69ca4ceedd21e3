"""Packages in layers: every import of the package goes to its own layer or one below, so no two
packages import each other, however indirectly (function-level and `TYPE_CHECKING` imports
included). A module belongs to the longest unit in `LAYERS` that prefixes its name."""

import networkx as nx
from test_import_graph import import_graph

#: lowest first; a unit may import its own modules and those of every unit before it
LAYERS = (
    "core",  # ir, topology, profile and plan formats, files, settings
    "schedules",  # pure generators and their registry
    "planning",  # simulate, tasks, plan, packing, comm, memory, replicas: no method or model by name
    "runtime.primitives",  # communication in NCCL's order, device clocks, recomputation
    "optim",  # first-order rules
    "models",  # the model API, its registry and the built-in kinds
    "data",  # token sources
    "methods",  # the method API, its registry and the built-in methods
    "config",  # the run file: every registered method's and model's section
    "planning.planner",  # the layout planner reads run files
    "runtime",  # executor, gradient paths, training, launch
    "testing",  # the public harness that holds a method to its reference
    "viz",  # pictures
    "cli",  # commands: print here, nowhere below
)


def unit(module: str) -> str:
    """The unit of `module` (`pipefisher.a.b.c`): the longest `LAYERS` entry that prefixes it."""
    parts = module.split(".")[1:]
    for length in range(len(parts), 0, -1):
        candidate = ".".join(parts[:length])
        if candidate in LAYERS:
            return candidate
    return ""


def test_every_module_has_a_layer():
    loose = sorted(m for m in import_graph() if m not in ("pipefisher", "pipefisher.__main__") and not unit(m))
    assert not loose, f"modules in no layer: {loose}"


def test_imports_go_down_the_layers():
    rank = {name: position for position, name in enumerate(LAYERS)}
    upward = sorted(
        f"{a} -> {b}" for a, b in import_graph().edges() if unit(a) and unit(b) and rank[unit(b)] > rank[unit(a)]
    )
    assert not upward, f"{len(upward)} imports go up the layers: " + "; ".join(upward)


def test_no_package_level_cycles():
    packages = nx.DiGraph()
    for a, b in import_graph().edges():
        if unit(a) and unit(b) and unit(a) != unit(b):
            packages.add_edge(unit(a), unit(b))
    cycles = list(nx.simple_cycles(packages))
    assert not cycles, "package cycles: " + "; ".join(" -> ".join([*cycle, cycle[0]]) for cycle in cycles[:5])
