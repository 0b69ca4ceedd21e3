"""Muon's help ops (`OpKind.HELP`, placed by `pipefisher.planning.packing.helpers`): a matrix's
Newton–Schulz of a stage whose precondition op has no bubble, done on another rank.

On the stage's rank, ``help_in`` (launched once the stage's gradient is final) steps the helped
matrices' momentum (`MuonEngine.directions`: the new momentum stays pending there, as for the
others) and broadcasts their directions to the helper; the stage's precondition op orthogonalises
the other matrices; ``help_out`` receives the helper's results into the matrices' update buffers
before the optimizer step. The helper holds no state across steps: per helped matrix a buffer for
its direction and one for its result, shaped from the run's `MethodInputs.stage_modules`; each
help op orthogonalises one matrix (`orthogonalise_into`), and ``help_out`` broadcasts the results.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from pipefisher.core.topology import Topology
from pipefisher.methods.help_roles import HelpRoles
from pipefisher.planning.plan import Plan


@dataclass
class Helping(HelpRoles):
    """One rank's part in a plan's help ops (`HelpRoles`, by matrix name) and, per (stage, name)
    of a matrix it orthogonalises for another rank's stage, its `inputs` and `outputs` buffers."""

    inputs: dict[tuple[int, str], Tensor] = field(default_factory=dict)
    outputs: dict[tuple[int, str], Tensor] = field(default_factory=dict)

    @classmethod
    def of_plan(
        cls,
        plan: Plan | None,
        topology: Topology,
        rank: int,
        modules: Mapping[int, Any],
        dtype: torch.dtype,
        device: torch.device,
    ) -> Helping:
        """This `rank`'s part in `plan`'s help ops (`modules`: `MethodInputs.stage_modules`; its
        buffers in `dtype` on `device`). ValueError when it helps a stage whose module it lacks."""
        helping = cls()
        helping.fill(plan, topology, rank)
        for stage, name, module in helping.helped_in(modules, "muon"):
            shape = module.get_parameter(name).shape
            helping.inputs[(stage, name)] = torch.empty(shape, dtype=dtype, device=device)
            helping.outputs[(stage, name)] = torch.empty(shape, dtype=dtype, device=device)
        return helping
