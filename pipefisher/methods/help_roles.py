"""One rank's part in a plan's help ops (`OpKind.HELP`, placed by
`pipefisher.planning.packing.helpers`), as every method with helpers reads it: which layers of
its own stages other ranks do, and which layers of other ranks' stages it does. Pure Python."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pipefisher.core.topology import Topology
from pipefisher.planning.packing.helpers import helped_layers
from pipefisher.planning.plan import Plan

R = TypeVar("R", bound="HelpRoles")


@dataclass
class HelpRoles:
    """`handed[stage][helper]`: the layers of a stage of this rank that global rank `helper` does;
    `helped[(stage, owner)]`: the layers of global rank `owner`'s stage this rank does. Both list a
    (stage, helper)'s layers in the helper's op order, the order of every help collective."""

    handed: dict[int, dict[int, list[str]]] = field(default_factory=dict)
    helped: dict[tuple[int, int], list[str]] = field(default_factory=dict)

    @classmethod
    def of_plan(cls: type[R], plan: Plan | None, topology: Topology, rank: int) -> R:
        """Both from `plan`'s help ops for global rank `rank` (none without a plan)."""
        roles = cls()
        roles.fill(plan, topology, rank)
        return roles

    def fill(self, plan: Plan | None, topology: Topology, rank: int) -> None:
        """Set both from `plan`'s help ops for global rank `rank` (none without a plan)."""
        self.handed, self.helped = {}, {}
        if plan is None:
            return
        replica = topology.replica_of(rank)
        for (pipe, stage), layers in helped_layers(plan).items():
            owner = topology.rank(replica, pipe, stage)
            for name, helper_rank in layers:
                helper = replica * topology.pipeline_ranks + helper_rank
                if owner == rank:
                    self.handed.setdefault(stage, {}).setdefault(helper, []).append(name)
                elif helper == rank:
                    self.helped.setdefault((stage, owner), []).append(name)

    def handed_names(self, stage: int) -> set[str]:
        """The layers of this rank's `stage` that other ranks do."""
        return {name for names in self.handed.get(stage, {}).values() for name in names}

    def helped_in(self, modules: Mapping[int, Any], section: str) -> Iterator[tuple[int, str, Any]]:
        """(stage, name, the stage's module) of every layer this rank does for another rank's
        stage (`modules`: `MethodInputs.stage_modules`); ValueError naming `section` (the method's
        name) where `modules` lacks the stage."""
        for (stage, _), names in self.helped.items():
            if stage not in modules:
                raise ValueError(
                    f"{section}.helpers: this rank helps stage {stage} without its module; the run's method "
                    "inputs need the stage modules (pass the model to method_inputs)"
                )
            for name in names:
                yield stage, name, modules[stage]
