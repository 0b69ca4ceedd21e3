"""Shampoo's help ops (`OpKind.HELP`, placed by `pipefisher.planning.packing.helpers`): a
matrix's products ``L^(-1/4) G R^(-1/4)`` of a stage whose P op has no bubble, done on another rank.

With `ShampooConfig.helpers` a stage's P op holds each matrix's products of the step's gradient
(`ShampooEngine.hold_products`: linear in the gradient, so taken before clipping; the step end's
norm transfer and the grafting where a root is not ok read them). For a helped matrix the stage's
rank sends, in the cycle's first step (``help_state``), its committed roots of A and B (zeros
before the first commit: its step end then takes the grafting direction whatever comes back);
once the stage's gradient is final, ``help_in`` its gradient as ``(rows, cols)`` in the working
dtype; ``help_out`` receives the helper's products into the matrix's product buffer
(`ShampooEngine.product_buffer`). The helper keeps each helped matrix's roots for the cycle (in
the runtime's cycle state, so a resumption within the cycle has them); one help op multiplies.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from pipefisher.methods.blocks import FACTORS, MatrixInfo, block_views
from pipefisher.methods.help_roles import HelpRoles
from pipefisher.methods.shampoo.engine import ShampooEngine
from pipefisher.methods.shampoo.state import gradient_matrix, roots_or_zeros
from pipefisher.methods.shampoo.step import products


@dataclass
class HelpedMatrix:
    """A matrix of another rank's stage this rank multiplies: its block structure `info`, its
    flat `roots` in use of A and B (`FACTORS` order, block layout), the step's `gradient` and
    the `result` (both ``(rows, cols)``), all in the working dtype."""

    info: MatrixInfo
    roots: list[Tensor]
    gradient: Tensor
    result: Tensor

    @classmethod
    def empty(cls, info: MatrixInfo, dtype: torch.dtype, device: torch.device) -> HelpedMatrix:
        roots = [torch.zeros(info.statistic_numel(f), dtype=dtype, device=device) for f in FACTORS]
        shape = info.shape
        return cls(
            info, roots, torch.empty(shape, dtype=dtype, device=device), torch.empty(shape, dtype=dtype, device=device)
        )

    def multiply(self, stacked: bool) -> None:
        """`result` = the products of `gradient` with the held roots, block by block."""
        left, right = (block_views(root, self.info.block_sizes(f)) for root, f in zip(self.roots, FACTORS))
        self.result.copy_(products([self.info], [left], [right], [self.gradient], stacked)[0])


@dataclass
class ShampooHelping(HelpRoles):
    """One rank's part in a plan's help ops (`HelpRoles`, by matrix name; the buffers of
    `pipefisher.methods.help_exchange.HelpBuffers`): `matrices[(stage, name)]` of the matrices it
    multiplies for another rank's stage."""

    matrices: dict[tuple[int, str], HelpedMatrix] = field(default_factory=dict)

    def allocate(
        self, modules: Mapping[int, Any], block_size: int, dtype: torch.dtype, device: torch.device
    ) -> ShampooHelping:
        """Buffers of the matrices it multiplies (`modules`: `MethodInputs.stage_modules`; cut
        into `block_size` blocks, in `dtype` on `device`); itself."""
        for stage, name, module in self.helped_in(modules, "shampoo"):
            info = MatrixInfo.of(name, tuple(module.get_parameter(name).shape), block_size)
            self.matrices[(stage, name)] = HelpedMatrix.empty(info, dtype, device)
        return self

    @staticmethod
    def state_of(engine: ShampooEngine, names: list[str]) -> list[Tensor]:
        """The stage's rank's ``help_state`` of `names`: each matrix's roots of A and B in use."""
        return [root for name in names for root in roots_or_zeros(engine.matrix_state(name), engine.dtype)]

    @staticmethod
    def inputs_of(engine: ShampooEngine, names: list[str]) -> list[Tensor]:
        """The stage's rank's ``help_in`` of `names`: each matrix's gradient of the step."""
        return [gradient_matrix(engine.matrix_state(name), engine.dtype) for name in names]

    @staticmethod
    def results_of(engine: ShampooEngine, stage: int, names: list[str]) -> list[Tensor]:
        """Where the stage's rank receives the products of `names` (held for its step end)."""
        return [engine.product_buffer(name) for name in names]

    @staticmethod
    def write_results(engine: ShampooEngine, stage: int, names: list[str]) -> None:
        """Nothing to write: the products land in the buffers the step end reads."""

    def held_state(self, stage: int, names: list[str]) -> list[Tensor]:
        return [root for name in names for root in self.matrices[(stage, name)].roots]

    def held_inputs(self, stage: int, names: list[str]) -> list[Tensor]:
        return [self.matrices[(stage, name)].gradient for name in names]

    def held_results(self, stage: int, names: list[str]) -> list[Tensor]:
        return [self.matrices[(stage, name)].result for name in names]

    def cycle_state(self) -> dict[str, dict[str, Tensor]]:
        """The helped matrices' roots held for the cycle, by "<stage>/<name>"."""
        return {f"{stage}/{name}": dict(zip(FACTORS, matrix.roots)) for (stage, name), matrix in self.matrices.items()}

    def load_cycle_state(self, state: Mapping[str, Mapping[str, Tensor]]) -> None:
        """Restore `cycle_state` output into the buffers of the matrices this rank multiplies."""
        for (stage, name), matrix in self.matrices.items():
            held = state.get(f"{stage}/{name}")
            if held is not None:
                for root, factor in zip(matrix.roots, FACTORS):
                    root.copy_(held[factor])
