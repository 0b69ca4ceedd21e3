"""A curvature method as the rest of pipefisher sees it: its declaration. Pure Python: no torch.

Every method's refresh work of one layer (a matrix it preconditions) is expressed in the same op
kinds, so the packer, plans, the NCCL-order check, the simulator and viz serve all methods alike.
A layer has one or two *parts* (`TaskRules.factors`: K-FAC's input and output-gradient factors,
Shampoo's left and right statistics, one for a diagonal method; none for a method whose work
recurs every step, which is then its P op alone), and per part:

- curvature CA/CB per micro-batch (methods whose statistics are sums over micro-batches);
- a sync SA/SB, an all-reduce of its input over the stage's replicas (pipes x data-parallel);
- refresh work IA/IB (K-FAC: damped inverse; Shampoo: statistics and inverse root);
- an exchange X per layer when the refresh work is split among the replicas;
- a precondition P per stage in every step, for methods that precondition before the gradient
  reduction (a method that needs the reduced gradient preconditions in the optimizer step).

A method's torch side (`MethodParts`, `pipefisher.methods.interface`) is named by a
"module:attribute" string and imported only when a run needs it, so planning stays torch-free.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from pipefisher.core.tensor_parallel import TensorParallelPlan, split_of

FACTORS = ("A", "B")


@dataclass(frozen=True)
class TaskRules:
    """The task structure of one curvature method.

    `factors`: the parts of a layer's refresh work, a prefix of ("A", "B"); () for a method
    without refresh work (its work is the per-step precondition).
    `curvature`: each part is built from per-micro-batch curvature tasks of the cycle's first
    step (CA/CB); otherwise from the stage's whole gradient of that step (after its backwards).
    `syncs`: the inputs all-reduced over a replicated stage, one sync op each, named by part;
    none for a method whose inputs are alike on every replica already (SOAP's statistics come from
    the reduced gradient).
    `sync_of[f]`: the sync whose result part f's refresh work reads (empty when `syncs` is).
    `precondition`: a per-step precondition op after the stage's backwards, before the gradient
    reduction (False: the method preconditions in the optimizer step, on the reduced gradient).
    `shared_when_split`: (split, part) pairs: under tensor parallelism the part's statistic of a
    layer split that way is the same on every shard of a rank (K-FAC: a column split's input
    factor, a row split's output-gradient factor), so each shard builds it from its share of the
    rows and the refresh work that reads it first sums it over the shards.
    """

    curvature: bool
    syncs: tuple[str, ...]
    sync_of: tuple[tuple[str, str], ...]
    precondition: bool
    factors: tuple[str, ...] = FACTORS
    shared_when_split: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if self.factors not in ((), FACTORS[:1], FACTORS):
            raise ValueError(f"factors: {self.factors!r} must be (), ('A',) or ('A', 'B')")
        for split, part in self.shared_when_split:
            if split not in ("column", "row") or part not in self.factors:
                raise ValueError(
                    f"shared_when_split: ({split!r}, {part!r}) must pair 'column' or 'row' with one of {self.factors!r}"
                )
        if not self.syncs:
            if self.sync_of:
                raise ValueError(f"sync_of: {self.sync_of!r} names syncs of a method without any (`syncs` is empty)")
            return
        parts = [part for part, _ in self.sync_of]
        if sorted(parts) != sorted(self.factors) or not {sync for _, sync in self.sync_of} <= set(self.syncs) <= set(
            self.factors
        ):
            raise ValueError(f"sync_of: {self.sync_of!r} must name one sync of `syncs` for each of {self.factors!r}")

    def shared_factor(self, split: str | None) -> str | None:
        """The part whose statistic a layer split as `split` ("column", "row", None) shares over
        the shards of a rank; None when nothing is shared."""
        return None if split is None else dict(self.shared_when_split).get(split)

    def shared_statistics(
        self, layers: Iterable[tuple[int, str]], plan: TensorParallelPlan
    ) -> frozenset[tuple[int, str, str]]:
        """(stage, layer, part) of the (stage, layer) `layers` whose part the shards of a rank
        share when `plan` splits the model (`shared_when_split`)."""
        found = set()
        for stage, name in layers:
            split = split_of(name, plan)
            part = self.shared_factor(split.value if split is not None else None)
            if part is not None:
                found.add((stage, name, part))
        return frozenset(found)

    def sync_for(self, factor: str) -> str | None:
        """The sync part `factor`'s refresh work reads; None for a method without syncs."""
        return dict(self.sync_of).get(factor)


@dataclass(frozen=True)
class CurvatureMethod:
    """One curvature method: `name` (its `optimizer.name` and run-file section), `label` (its name
    in reports), its task rules, `settings` (the dataclass of its run-file section, a
    `RefreshConfig`), `parts` ("module:attribute" of its `MethodParts`: runtime, task timer,
    layers, reference twin) and `flags`: keys of its section that get a short command-line flag
    `--<name>-<key>` beside the ones every method has (placement, refresh steps); `memory`:
    "module:attribute" of its torch-free memory model of a layer
    (`pipefisher.planning.memory.state.CurvatureLayer`; "" = not modelled)."""

    name: str
    label: str
    rules: TaskRules
    settings: type
    parts: str
    flags: tuple[str, ...] = ()
    memory: str = ""
    _loaded: dict[str, Any] = field(default_factory=dict, init=False, repr=False, compare=False)

    def runtime_parts(self) -> Any:
        """Its `MethodParts`, imported on first use (this imports torch)."""
        if "parts" not in self._loaded:
            module, _, attribute = self.parts.partition(":")
            self._loaded["parts"] = getattr(importlib.import_module(module), attribute)
        return self._loaded["parts"]
