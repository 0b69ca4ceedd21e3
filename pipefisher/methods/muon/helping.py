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

from pipefisher.methods.help_roles import HelpRoles


@dataclass
class Helping(HelpRoles):
    """One rank's part in a plan's help ops (`HelpRoles`, by matrix name) and, per (stage, name)
    of a matrix it orthogonalises for another rank's stage, its `inputs` and `outputs` buffers."""

    inputs: dict[tuple[int, str], Tensor] = field(default_factory=dict)
    outputs: dict[tuple[int, str], Tensor] = field(default_factory=dict)

    def allocate(self, modules: Mapping[int, Any], dtype: torch.dtype, device: torch.device) -> Helping:
        """Its buffers for the matrices it orthogonalises (`modules`: `MethodInputs.stage_modules`;
        in `dtype` on `device`); itself. ValueError when it helps a stage whose module it lacks."""
        for stage, name, module in self.helped_in(modules, "muon"):
            shape = module.get_parameter(name).shape
            self.inputs[(stage, name)] = torch.empty(shape, dtype=dtype, device=device)
            self.outputs[(stage, name)] = torch.empty(shape, dtype=dtype, device=device)
        return self
