"""The help collectives of a method whose helper keeps per-cycle state (K-FAC's inverses,
Shampoo's roots): ``help_state`` (the stage's rank sends each helped layer's state once per
cycle), ``help_in`` (its input of the step) and ``help_out`` (the helper's results back).

Each is a broadcast on the (owner, helper) help communicator of a list of tensors, in the
layers' order of `pipefisher.methods.help_roles.HelpRoles` on both sides; `HelpBuffers` says which tensors each side sends or
receives, so a method's runtime only names its buffers.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

from torch import Tensor

from pipefisher.planning.comm.actions import Collective, CollectiveKind
from pipefisher.runtime.primitives.comm import Comm, Handle


class HelpBuffers(Protocol):
    """A method's part in the help collectives (on a `HelpRoles`): for the stage's rank, what it
    sends of `names` of a stage and where results land; for the helper, its buffers of the layers
    it does for (stage, owner)."""

    handed: dict[int, dict[int, list[str]]]
    helped: dict[tuple[int, int], list[str]]

    def state_of(self, engine: Any, names: list[str]) -> list[Tensor]: ...

    def inputs_of(self, engine: Any, names: list[str]) -> list[Tensor]: ...

    def results_of(self, engine: Any, stage: int, names: list[str]) -> list[Tensor]: ...

    def write_results(self, engine: Any, stage: int, names: list[str]) -> None: ...

    def held_state(self, stage: int, names: list[str]) -> list[Tensor]: ...

    def held_inputs(self, stage: int, names: list[str]) -> list[Tensor]: ...

    def held_results(self, stage: int, names: list[str]) -> list[Tensor]: ...


class HelpExchange:
    """Launches the three help collectives of one rank (`comm`, global `rank`) for a method's
    `helping` (`HelpBuffers`) over its stages' `engines` (by stage)."""

    def __init__(self, comm: Comm, rank: int, helping: HelpBuffers, engines: Mapping[int, Any]):
        self.comm, self.rank, self.helping, self.engines = comm, rank, helping, engines

    def launch_state(self, collective: Collective) -> Handle:
        """The stage's rank sends the helped layers' state; the helper receives it into its buffers."""
        return self._launch(collective, self.helping.state_of, self.helping.held_state)

    def launch_in(self, collective: Collective) -> Handle:
        """The stage's rank sends the helped layers' inputs of the step."""
        return self._launch(collective, self.helping.inputs_of, self.helping.held_inputs)

    def launch_out(self, collective: Collective) -> Handle:
        """The helper sends its results; the stage's rank receives them (`write_results` once done)."""
        (stage,), (_, owner, helper) = collective.key, collective.group
        if self.rank == owner:
            engine, names = self.engines[stage], self.helping.handed[stage][helper]
            return self.comm.broadcast(
                [(tensor, helper) for tensor in self.helping.results_of(engine, stage, names)],
                collective.group,
                on_done=lambda: self.helping.write_results(engine, stage, names),
            )
        held = self.helping.held_results(stage, self.helping.helped[(stage, owner)])
        return self.comm.broadcast([(tensor, helper) for tensor in held], collective.group)

    def _launch(
        self,
        collective: Collective,
        sent: Callable[[Any, list[str]], list[Tensor]],
        held: Callable[[int, list[str]], list[Tensor]],
    ) -> Handle:
        """A broadcast from the stage's rank: `sent` of its handed layers, into the helper's `held`."""
        (stage,), (_, owner, helper) = collective.key, collective.group
        if self.rank == owner:
            tensors = sent(self.engines[stage], self.helping.handed[stage][helper])
        else:
            tensors = held(stage, self.helping.helped[(stage, owner)])
        return self.comm.broadcast([(tensor, owner) for tensor in tensors], collective.group)


def help_launchers(exchange: Callable[[], HelpExchange]) -> dict[CollectiveKind, Callable[[Collective], Handle]]:
    """A runtime's launchers of the three help collectives (its `collectives` entries), through
    `exchange()`, looked up at each launch (a runtime makes its exchange anew with each plan)."""
    return {
        CollectiveKind.HELP_STATE: lambda collective: exchange().launch_state(collective),
        CollectiveKind.HELP_IN: lambda collective: exchange().launch_in(collective),
        CollectiveKind.HELP_OUT: lambda collective: exchange().launch_out(collective),
    }
