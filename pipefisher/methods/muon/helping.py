"""Muon's help ops (`OpKind.HELP`, placed by `pipefisher.planning.packing.helpers`): a matrix's
Newton–Schulz of a stage whose precondition op has no bubble, done on another rank.

On the stage's rank, ``help_in`` (launched once the stage's gradient is final) steps the helped
matrices' momentum (`MuonEngine.directions`: the new momentum stays pending there, as for the
others) and broadcasts their directions to the helper; the stage's precondition op orthogonalises
the other matrices; ``help_out`` receives the helper's results into the matrices' update buffers
before the optimizer step. The helper holds no state across steps: per helped matrix a buffer for
its direction and one for its result, shaped from the run's `MethodInputs.stage_shapes`; each
help op orthogonalises one matrix (`orthogonalise_into`), and ``help_out`` broadcasts the results.
Both ends list a (stage, helper)'s matrices in the helper's op order.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor

from pipefisher.core.topology import Topology
from pipefisher.planning.plan import Plan
from pipefisher.planning.packing.helpers import helped_layers


@dataclass
class Helping:
    """One rank's part in a plan's help ops: `handed[stage][helper]`: the matrices of a stage of
    this rank that global rank `helper` orthogonalises; `inputs`/`outputs[(stage, name)]`: this
    rank's buffers for the matrices it orthogonalises for another rank's stage."""

    handed: dict[int, dict[int, list[str]]] = field(default_factory=dict)
    helped: dict[tuple[int, int], list[str]] = field(default_factory=dict)
    inputs: dict[tuple[int, str], Tensor] = field(default_factory=dict)
    outputs: dict[tuple[int, str], Tensor] = field(default_factory=dict)

    @classmethod
    def of_plan(
        cls,
        plan: Plan | None,
        topology: Topology,
        rank: int,
        shapes: Mapping[int, Mapping[str, tuple[int, ...]]],
        dtype: torch.dtype,
        device: torch.device,
    ) -> Helping:
        """This `rank`'s part in `plan`'s help ops (`shapes`: `MethodInputs.stage_shapes`; its
        buffers in `dtype` on `device`). ValueError when it helps a stage whose shapes it lacks."""
        helping = cls()
        if plan is None:
            return helping
        replica = topology.replica_of(rank)
        for (pipe, stage), layers in helped_layers(plan).items():
            owner = topology.rank(replica, pipe, stage)
            for name, helper_rank in layers:
                helper = replica * topology.pipeline_ranks + helper_rank
                if owner == rank:
                    helping.handed.setdefault(stage, {}).setdefault(helper, []).append(name)
                elif helper == rank:
                    shape = shapes.get(stage, {}).get(name)
                    if shape is None:
                        raise ValueError(
                            f"muon.helpers: this rank helps {name!r} of stage {stage} without its shape; "
                            "the run's method inputs need the stage shapes (pass the model to method_inputs)"
                        )
                    helping.helped.setdefault((stage, owner), []).append(name)
                    helping.inputs[(stage, name)] = torch.empty(shape, dtype=dtype, device=device)
                    helping.outputs[(stage, name)] = torch.empty(shape, dtype=dtype, device=device)
        return helping

    def handed_names(self, stage: int) -> set[str]:
        """The matrices of this rank's `stage` that other ranks orthogonalise."""
        return {name for names in self.handed.get(stage, {}).values() for name in names}
