"""Muon's state over one module and its operations, matrix by matrix (`newton_schulz` has the maths).

Which parameters Muon updates: the 2-D weight of every ``nn.Linear`` and Hugging Face ``Conv1D``
(recognised by class name; its weight is stored (in, out), so its shape scale reads the shape
reversed), except those whose parameter name matches a `skip` glob. Embeddings, norms, biases
and the skipped weights are left to the first-order rule.

Per matrix: the momentum buffer (allocated at its first use: a replica keeps the buffers of the
matrices it orthogonalises only), the new buffer of the step (`pending`, committed by `apply` so
that a skipped step leaves the momentum as it was) and the step's orthogonalised update.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from pipefisher.core.settings import check_section
from pipefisher.methods.muon.method import MUON, MuonConfig
from pipefisher.methods.muon.newton_schulz import momentum_update, orthogonalise, shape_scale


@dataclass
class MuonMatrix:
    """One matrix: its parameter, its (rows, cols) as the layer maps (out, in), and its tensors."""

    name: str
    parameter: nn.Parameter
    rows: int
    cols: int
    buffer: Tensor | None = None
    pending: Tensor | None = None
    update: Tensor | None = None


def linear_weights(module: nn.Module, skip: Iterable[str] = ()) -> dict[str, tuple[nn.Parameter, int, int]]:
    """name -> (weight, rows, cols) of every trainable linear weight of `module` in module order
    that matches no `skip` glob (fnmatch, case-sensitive); works on the meta device."""
    patterns = list(skip)
    found: dict[str, tuple[nn.Parameter, int, int]] = {}
    for module_name, layer in module.named_modules():
        weight = getattr(layer, "weight", None)
        transposed = type(layer).__name__ == "Conv1D"
        if (
            not (isinstance(layer, nn.Linear) or transposed)
            or not isinstance(weight, nn.Parameter)
            or weight.dim() != 2
        ):
            continue
        name = f"{module_name}.weight" if module_name else "weight"
        if (
            not weight.requires_grad
            or any(fnmatch.fnmatchcase(name, p) for p in patterns)
            or any(weight is w for w, _, _ in found.values())
        ):
            continue
        rows, cols = weight.shape[::-1] if transposed else weight.shape
        found[name] = (weight, rows, cols)
    return found


class MuonEngine:
    """Muon's matrices of one module (see the module docstring), stepped as the run-file section
    `settings` says (checked, `check_section`)."""

    def __init__(self, module: nn.Module, settings: MuonConfig, skip: Iterable[str] = ()):
        check_section(settings, MUON.name)
        self.settings = settings
        self.matrices = {
            name: MuonMatrix(name, weight, rows, cols)
            for name, (weight, rows, cols) in linear_weights(module, skip).items()
        }

    def names(self) -> list[str]:
        return list(self.matrices)

    def orthogonalise(self, name: str, loss_scale: Tensor | None = None, gradient: Tensor | None = None) -> None:
        """The step of matrix `name` from `gradient` (default: its parameter's `.grad`, divided by
        `loss_scale` when given): the new momentum (pending) and the orthogonalised update."""
        matrix = self.matrices[name]
        if gradient is None:
            gradient = matrix.parameter.grad if loss_scale is None else matrix.parameter.grad / loss_scale
        if matrix.buffer is None:
            matrix.buffer = torch.zeros_like(gradient)
        matrix.pending, direction = momentum_update(matrix.buffer, gradient, self.settings)
        result = orthogonalise(direction, self.settings)
        if matrix.update is None:
            matrix.update = torch.empty_like(matrix.parameter)
        matrix.update.copy_(result)

    def update_buffer(self, name: str) -> Tensor:
        """The tensor matrix `name`'s update is in (allocated on first use; a receiving replica's
        broadcast lands here)."""
        matrix = self.matrices[name]
        if matrix.update is None:
            matrix.update = torch.empty_like(matrix.parameter)
        return matrix.update

    def apply(self, updates: Callable[[nn.Parameter], bool] = lambda parameter: True) -> None:
        """The step goes ahead: commit every new momentum, and put each update times its shape
        scale into the `.grad` of its parameter (where `updates` accepts it), for `MuonStep`."""
        for matrix in self.matrices.values():
            if matrix.pending is not None:
                matrix.buffer, matrix.pending = matrix.pending, None
            if matrix.update is not None and matrix.parameter.grad is not None and updates(matrix.parameter):
                scale = shape_scale(matrix.rows, matrix.cols, self.settings.adjust_lr)
                matrix.parameter.grad.copy_(matrix.update)
                if scale != 1.0:
                    matrix.parameter.grad.mul_(scale)

    def state_dict(self) -> dict[str, Tensor]:
        """The momentum buffers this engine holds, by matrix name."""
        return {name: matrix.buffer for name, matrix in self.matrices.items() if matrix.buffer is not None}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        """Restore `state_dict` output (copies on the parameters' devices; ValueError naming a
        matrix whose buffer has another shape)."""
        for name, matrix in self.matrices.items():
            matrix.pending = None
            buffer = state.get(name)
            if buffer is not None and buffer.shape != matrix.parameter.shape:
                raise ValueError(
                    f"Muon matrix {name!r}: momentum of shape {tuple(buffer.shape)}, want {tuple(matrix.parameter.shape)}"
                )
            matrix.buffer = (
                None
                if buffer is None
                else buffer.to(device=matrix.parameter.device, dtype=matrix.parameter.dtype, copy=True)
            )
