"""The helper's side of help ops that multiply a matrix's gradient block by block between two
per-cycle factors (Shampoo: ``L^(-1/4) G R^(-1/4)`` with its roots; SOAP: ``Q_Lᵀ G Q_R`` with its
eigenbases): the factors held for the cycle, the step's gradient and result of each matrix a
rank does for another rank's stage. A method subclasses `MatrixHelping` with what the stage's
rank sends and where the result lands (`pipefisher.methods.help_exchange.HelpBuffers`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

import torch
from torch import Tensor

from pipefisher.methods.block_stacks import block_products
from pipefisher.methods.blocks import FACTORS, MatrixInfo, block_views
from pipefisher.methods.help_roles import HelpRoles
from pipefisher.planning.plan import Plan

H = TypeVar("H", bound="MatrixHelping")


@dataclass
class HelpedMatrix:
    """A matrix of another rank's stage this rank multiplies: its block structure `info`, its
    flat `factors` of A and B held for the cycle (`FACTORS` order, block layout), the step's
    `gradient` and the `result` (both ``(rows, cols)``), all in the working dtype."""

    info: MatrixInfo
    factors: list[Tensor]
    gradient: Tensor
    result: Tensor

    @classmethod
    def empty(cls, info: MatrixInfo, dtype: torch.dtype, device: torch.device) -> HelpedMatrix:
        factors = [torch.zeros(info.statistic_numel(f), dtype=dtype, device=device) for f in FACTORS]
        shape = info.shape
        return cls(
            info,
            factors,
            torch.empty(shape, dtype=dtype, device=device),
            torch.empty(shape, dtype=dtype, device=device),
        )

    def multiply(self, left_transposed: bool, stacked: bool) -> None:
        """`result` = ``A_k G_k B_k`` of each block k of `gradient` (``A_kᵀ`` when `left_transposed`)."""
        left, right = (block_views(factor, self.info.block_sizes(f)) for factor, f in zip(self.factors, FACTORS))
        lefts = [q.mT for q in left] if left_transposed else left
        self.result.copy_(block_products([self.info], [lefts], [right], [self.gradient], stacked)[0])


@dataclass
class MatrixHelping(HelpRoles):
    """One rank's part in a plan's help ops (`HelpRoles`, by matrix name): `matrices[(stage,
    name)]` of the matrices it multiplies for another rank's stage. `section`: the method's run
    file section (named in errors); `left_transposed`: the left factor multiplies transposed."""

    section: ClassVar[str]
    left_transposed: ClassVar[bool] = False
    matrices: dict[tuple[int, str], HelpedMatrix] = field(default_factory=dict)
    #: same-shape blocks in one product (its engines' choice, `block_groups`)
    stacked: bool = False

    @classmethod
    def of_runtime(cls: type[H], plan: Plan | None, runtime: Any) -> H:
        """Its part in `plan` for the rank of `runtime` (the method's `StageRuntime`), with
        buffers of the matrices it multiplies in its engines' working dtype on its parameters'
        device, cut into blocks of its section's `block_size`."""
        helping = cls.of_plan(plan, runtime.topology, runtime.rank)
        parameter = next(p for module in runtime.modules.values() for p in module.parameters())
        engine = next(iter(runtime.engine_of_stage.values()))
        helping.stacked = engine.stack_blocks
        for stage, name, module in helping.helped_in(runtime.config.stage_modules, cls.section):
            shape = tuple(module.get_parameter(name).shape)
            info = MatrixInfo.of(name, shape, runtime.config.settings.block_size)
            helping.matrices[(stage, name)] = HelpedMatrix.empty(info, engine.dtype, parameter.device)
        return helping

    def help(self, stage: int, name: str) -> None:
        """The help op of matrix `name` of `stage`: its product of the step."""
        self.matrices[(stage, name)].multiply(self.left_transposed, self.stacked)

    def held_state(self, stage: int, names: list[str]) -> list[Tensor]:
        return [factor for name in names for factor in self.matrices[(stage, name)].factors]

    def held_inputs(self, stage: int, names: list[str]) -> list[Tensor]:
        return [self.matrices[(stage, name)].gradient for name in names]

    def held_results(self, stage: int, names: list[str]) -> list[Tensor]:
        return [self.matrices[(stage, name)].result for name in names]

    def cycle_state(self) -> dict[str, dict[str, Tensor]]:
        """The helped matrices' factors held for the cycle, by "<stage>/<name>"."""
        return {f"{stage}/{name}": dict(zip(FACTORS, m.factors)) for (stage, name), m in self.matrices.items()}

    def load_cycle_state(self, state: Mapping[str, Mapping[str, Tensor]]) -> None:
        """Restore `cycle_state` output into the buffers of the matrices this rank multiplies."""
        for (stage, name), matrix in self.matrices.items():
            held = state.get(f"{stage}/{name}")
            if held is not None:
                for factor, key in zip(matrix.factors, FACTORS):
                    factor.copy_(held[key])
