"""K-FAC's help ops (`OpKind.HELP`, placed by `pipefisher.planning.packing.helpers`): a layer's
``B⁻¹ G A⁻¹`` of a stage whose precondition op has no bubble, done on another rank.

The stage's rank sends, in the cycle's first step (``help_state``, launched before its first op),
each helped layer's committed inverses and their flags (a placeholder not ok where none was
committed yet: the identity, as on the stage's rank); once the stage's gradient is final,
``help_in`` its gradient matrix (weight and bias, `gradient_matrix`, in the factor dtype); its P
op preconditions the other layers; ``help_out`` receives the results, written into the gradients
when it completes (before the world reduction: clipping and the optimizer see them). The helper
keeps each helped layer's inverses for the cycle (`HelpedLayer`; in the runtime's cycle state,
so a resumption within the cycle has them) and one help op applies them (`apply_inverses`, the
stage's rank's own products on one matrix).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from pipefisher.methods.help_roles import HelpRoles
from pipefisher.methods.kfac.engine import KFACEngine
from pipefisher.methods.kfac.layer import Factor
from pipefisher.methods.kfac.step import apply_inverses, gradient_matrix, write_matrices
from pipefisher.methods.layers import LayerInfo, linear_info

#: the order of a layer's inverses in ``help_state`` and of their flags
ORDER: tuple[Factor, Factor] = ("B", "A")


@dataclass
class HelpedLayer:
    """A layer of another rank's stage this rank preconditions: its `inverses` in use ("B":
    dout x dout, "A": a_size x a_size), their flags `ok` (uint8, in `ORDER`), the step's gradient
    matrix `gradient` and its `result` (dout x a_size); all in the factor dtype but `ok`."""

    inverses: dict[Factor, Tensor]
    ok: Tensor
    gradient: Tensor
    result: Tensor

    @classmethod
    def empty(cls, info: LayerInfo, dtype: torch.dtype, device: torch.device) -> HelpedLayer:
        def square(n: int) -> Tensor:
            return torch.zeros(n, n, dtype=dtype, device=device)

        shape = (info.b_size, info.a_size)
        return cls(
            {"B": square(info.b_size), "A": square(info.a_size)},
            torch.zeros(len(ORDER), dtype=torch.uint8, device=device),
            torch.empty(shape, dtype=dtype, device=device),
            torch.empty(shape, dtype=dtype, device=device),
        )

    @property
    def state(self) -> list[Tensor]:
        """What ``help_state`` fills: the inverses in `ORDER`, then their flags."""
        return [*(self.inverses[factor] for factor in ORDER), self.ok]

    def precondition(self) -> None:
        """`result` = ``B⁻¹ G A⁻¹`` of `gradient`, each inverse skipped where not ok."""
        flags = self.ok.bool()
        inverses = [(factor, self.inverses[factor], flags[i]) for i, factor in enumerate(ORDER)]
        self.result.copy_(apply_inverses(self.gradient, inverses))


@dataclass
class KfacHelping(HelpRoles):
    """One rank's part in a plan's help ops (`HelpRoles`, by layer name): `layers[(stage, name)]`
    of the layers it preconditions for another rank's stage, `results[(stage, name)]` of its own
    stages' layers that other ranks precondition (their buffers)."""

    layers: dict[tuple[int, str], HelpedLayer] = field(default_factory=dict)
    results: dict[tuple[int, str], Tensor] = field(default_factory=dict)

    def allocate(
        self, engines: Mapping[int, KFACEngine], modules: Mapping[int, Any], dtype: torch.dtype, device: torch.device
    ) -> KfacHelping:
        """Its buffers: results for its own stages' handed layers (`engines` by stage), inverses,
        input and result for the layers it helps (`modules`: every stage's on the meta device,
        `MethodInputs.stage_modules`; in the factor `dtype` on `device`); itself. ValueError when
        it helps a stage whose module it lacks."""
        for stage, by_helper in self.handed.items():
            for name in (name for names in by_helper.values() for name in names):
                st = engines[stage].layer_state(name)
                self.results[(stage, name)] = torch.empty(
                    (st.info.b_size, st.info.a_size), dtype=st.dtype, device=device
                )
        for stage, name, module in self.helped_in(modules, "kfac"):
            info = linear_info(name, module.get_submodule(name))
            if info is None:
                raise ValueError(f"kfac.helpers: {name!r} of stage {stage} is not a linear layer")
            self.layers[(stage, name)] = HelpedLayer.empty(info, dtype, device)
        return self

    def state_of(self, engine: KFACEngine, names: list[str]) -> list[Tensor]:
        """The stage's rank's ``help_state`` of `names`: per layer its committed inverses in
        `ORDER` (zeros where none) and their flags (uint8)."""
        sent: list[Tensor] = []
        for name in names:
            st = engine.layer_state(name)
            flags = []
            for factor in ORDER:
                slot = st.active.get(factor)
                n = st.info.size(factor)
                sent.append(
                    slot.value if slot is not None else torch.zeros(n, n, dtype=st.dtype, device=st.weight.device)
                )
                flags.append(
                    slot.ok if slot is not None else torch.zeros((), dtype=torch.bool, device=st.weight.device)
                )
            sent.append(torch.stack(flags).to(torch.uint8))
        return sent

    @staticmethod
    def inputs_of(engine: KFACEngine, names: list[str]) -> list[Tensor]:
        """The stage's rank's ``help_in`` of `names`: each layer's gradient matrix of the step."""
        sent = []
        for name in names:
            st = engine.layer_state(name)
            matrix = gradient_matrix(st)
            if matrix is None:
                raise RuntimeError(f"kfac.helpers: layer {name!r} has no gradient to hand to its helper")
            sent.append(matrix.to(st.dtype).contiguous())
        return sent

    def results_of(self, engine: KFACEngine, stage: int, names: list[str]) -> list[Tensor]:
        """Where the stage's rank receives the results of `stage`'s `names`."""
        return [self.results[(stage, name)] for name in names]

    def held_state(self, stage: int, names: list[str]) -> list[Tensor]:
        """The helper's buffers of ``help_state`` for `stage`'s `names`."""
        return [tensor for name in names for tensor in self.layers[(stage, name)].state]

    def held_inputs(self, stage: int, names: list[str]) -> list[Tensor]:
        return [self.layers[(stage, name)].gradient for name in names]

    def held_results(self, stage: int, names: list[str]) -> list[Tensor]:
        return [self.layers[(stage, name)].result for name in names]

    def write_results(self, engine: KFACEngine, stage: int, names: list[str]) -> None:
        """Write the received results of `stage`'s `names` into their gradients."""
        write_matrices([engine.layer_state(name) for name in names], [self.results[(stage, name)] for name in names])

    def cycle_state(self) -> dict[str, dict[str, Tensor]]:
        """The helped layers' inverses and flags held for the cycle, by "<stage>/<name>"."""
        return {
            f"{stage}/{name}": {"B": layer.inverses["B"], "A": layer.inverses["A"], "ok": layer.ok}
            for (stage, name), layer in self.layers.items()
        }

    def load_cycle_state(self, state: Mapping[str, Mapping[str, Tensor]]) -> None:
        """Restore `cycle_state` output into the buffers of the layers this rank helps."""
        for (stage, name), layer in self.layers.items():
            held = state.get(f"{stage}/{name}")
            if held is not None:
                for factor in ORDER:
                    layer.inverses[factor].copy_(held[factor])
                layer.ok.copy_(held["ok"])
