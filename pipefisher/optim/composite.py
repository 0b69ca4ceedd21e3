"""Several torch optimizers over disjoint parameters, stepped as one optimizer (a curvature
method's rule for the parameters it preconditions, a first-order rule for the rest)."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch

from pipefisher.optim.update_step import UpdateStep


class Composite(UpdateStep):
    """`parts` (name -> optimizer, disjoint parameters) as one optimizer: `step` steps each in
    order; `param_groups` are the parts' own group dicts, in that order, read anew on every access
    (a part that loads a state dict gets new ones; a learning-rate scheduler scales every part;
    ``param_groups[0]`` is the first part's); `state` is their union by parameter. `state_dict()`
    is ``{"parts": {name: part.state_dict()}}``."""

    def __init__(self, parts: dict[str, torch.optim.Optimizer]) -> None:
        self.parts = dict(parts)
        super().__init__([{"params": []}], {})  # hooks and profiling names; groups and state are the parts'

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """Every part's parameter groups, in part order (a new list of the parts' dicts)."""
        return [group for part in self.parts.values() for group in part.param_groups]

    @param_groups.setter
    def param_groups(self, value: list) -> None:
        self._refuse_setting(value)

    @property
    def state(self) -> defaultdict[torch.Tensor, Any]:
        """Every part's state by parameter (a new dict of the parts' entries)."""
        return defaultdict(
            dict, ((parameter, state) for part in self.parts.values() for parameter, state in part.state.items())
        )

    @state.setter
    def state(self, value: defaultdict[torch.Tensor, Any]) -> None:
        self._refuse_setting(value)

    @staticmethod
    def _refuse_setting(value: Any) -> None:
        """`Optimizer.__init__` sets empty groups and state; anything else goes to the parts."""
        if value:
            raise ValueError(
                "a Composite's parameter groups and state are its parts'; load a state with load_state_dict"
            )

    def update(self) -> None:
        for part in self.parts.values():
            part.step()

    def state_dict(self) -> dict[str, Any]:
        return {"parts": {name: part.state_dict() for name, part in self.parts.items()}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """A composite's state dict of the same parts."""
        if set(state_dict.get("parts", ())) != set(self.parts):
            raise ValueError(
                f"optimizer state of parts {sorted(state_dict.get('parts', ()))}, this optimizer has {sorted(self.parts)}"
            )
        for name, part in self.parts.items():
            part.load_state_dict(state_dict["parts"][name])
