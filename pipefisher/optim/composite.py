"""Several torch optimizers over disjoint parameters, stepped as one optimizer (a curvature
method's rule for the parameters it preconditions, a first-order rule for the rest)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn


class Composite(torch.optim.Optimizer):
    """`parts` (name -> optimizer, disjoint parameters) as one optimizer: `step` steps each in
    order; `param_groups` are the parts' own group dicts, in that order, read anew on every access
    (a part that loads a state dict gets new ones; a learning-rate scheduler scales every part;
    ``param_groups[0]`` is the first part's); `state` is their union by parameter. `state_dict()`
    is ``{"parts": {name: part.state_dict()}}``.

    `single`: every parameter in the index order of the one optimizer a checkpoint written before
    the composite holds (its state dict loads when `refusal` is ""; `refusal` says why it cannot)."""

    def __init__(self, parts: dict[str, torch.optim.Optimizer], single: Sequence[nn.Parameter] = (), refusal: str = "") -> None:
        self.parts = dict(parts)
        self._single, self._refusal = list(single), refusal
        super().__init__([{"params": []}], {})  # hooks and profiling names; groups and state are the parts'

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """Every part's parameter groups, in part order (a new list of the parts' dicts)."""
        return [group for part in self.parts.values() for group in part.param_groups]

    @param_groups.setter
    def param_groups(self, value: list) -> None:
        self._refuse_setting(value)

    @property
    def state(self) -> dict[torch.Tensor, Any]:
        """Every part's state by parameter (a new dict of the parts' entries)."""
        return {parameter: state for part in self.parts.values() for parameter, state in part.state.items()}

    @state.setter
    def state(self, value: dict) -> None:
        self._refuse_setting(value)

    @staticmethod
    def _refuse_setting(value: Any) -> None:
        """`Optimizer.__init__` sets empty groups and state; anything else goes to the parts."""
        if value:
            raise ValueError("a Composite's parameter groups and state are its parts'; load a state with load_state_dict")

    @torch.no_grad()
    def step(self, closure: None = None) -> None:
        if closure is not None:
            raise ValueError("Composite.step takes no closure")
        for part in self.parts.values():
            part.step()

    def state_dict(self) -> dict[str, Any]:
        return {"parts": {name: part.state_dict() for name, part in self.parts.items()}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """A composite's state dict (the same parts), or one optimizer's over `single` (see the class)."""
        if "parts" not in state_dict:
            self._load_single(state_dict)
            return
        if set(state_dict["parts"]) != set(self.parts):
            raise ValueError(f"optimizer state of parts {sorted(state_dict['parts'])}, this optimizer has {sorted(self.parts)}")
        for name, part in self.parts.items():
            part.load_state_dict(state_dict["parts"][name])

    def _load_single(self, state_dict: dict[str, Any]) -> None:
        """Each part takes the per-parameter state of its parameters from one optimizer's state dict
        over `single`; the parts keep their own hyperparameters."""
        if self._refusal or not self._single:
            raise ValueError(self._refusal or "the optimizer state is of one optimizer; this one is a Composite")
        counted = sum(len(group["params"]) for group in state_dict["param_groups"])
        if counted != len(self._single):
            raise ValueError(f"the optimizer state covers {counted} parameters, this optimizer {len(self._single)}")
        index = {id(parameter): number for number, parameter in enumerate(self._single)}
        for part in self.parts.values():
            own = part.state_dict()
            mine = [parameter for group in part.param_groups for parameter in group["params"]]
            own["state"] = {number: state_dict["state"][index[id(parameter)]] for number, parameter in enumerate(mine)
                            if index[id(parameter)] in state_dict["state"]}
            part.load_state_dict(own)
