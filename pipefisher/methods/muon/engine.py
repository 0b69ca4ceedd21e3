"""Muon's state over one module and its operations, matrix by matrix (`newton_schulz` has the maths).

Which parameters Muon updates: the 2-D weight of every ``nn.Linear`` and Hugging Face ``Conv1D``
(recognised by class name; its weight is stored (in, out), so its shape scale reads the shape
reversed), except those whose parameter name matches a `skip` glob. Embeddings, norms, biases
and the skipped weights are left to the first-order rule.

Per matrix: the momentum buffer (allocated at its first use: a replica keeps the buffers of the
matrices it orthogonalises only), the new buffer of the step (`pending`, committed by `apply` so
that a skipped step leaves the momentum as it was) and the step's orthogonalised update.

The work is batched over the matrices of one call: the momentum steps and commits as foreach
kernels, and one stacked Newton–Schulz per group of equal shape (a tall matrix as its transpose,
so an MLP's (4h, h) and (h, 4h) weights share one), dtype and device (`shape_groups`).

Under ZeRO-2/3 a parameter and its gradient are FSDP2 DTensors holding this rank's rows: the step
reads each gradient whole (`whole_gradient`: an all-gather over the stage's replicas, in the
order of `names`) and keeps the buffer, the pending buffer and the update whole (plain tensors of
the parameter's shape); `apply` writes this rank's rows of each update into its gradient's shard.
Unsharded, the gradient is read and written in place as before (bit for bit).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from pipefisher.core.settings import check_section
from pipefisher.methods.muon.method import MUON, MuonConfig
from pipefisher.methods.muon.newton_schulz import momentum_update, orthogonalise, shape_scale
from pipefisher.runtime.primitives.sharding import is_sharded, local, shard_of, whole_gradient


@dataclass
class MuonMatrix:
    """One matrix: its parameter, its (rows, cols) as the layer maps (out, in), and its tensors
    (whole: the parameter's shape, also when the parameter is a shard)."""

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

    def directions(
        self, names: Sequence[str], loss_scale: Tensor | None = None, gradients: Sequence[Tensor] | None = None
    ) -> list[Tensor]:
        """The step's first half for the matrices `names`, from `gradients` (default: their
        parameters' reduced gradients whole, `whole_gradient`: a collective per sharded one, in
        `names` order; divided by `loss_scale`, one element, when given): each one's new momentum
        (pending, committed by `apply`) and its direction, what Newton–Schulz orthogonalises
        (`orthogonalise_into`, here or on a helper). No host read."""
        matrices = [self.matrices[name] for name in names]
        if not matrices:
            return []
        if gradients is None:
            grads = [_reduced_gradient(matrix) for matrix in matrices]
            gradients = grads if loss_scale is None else torch._foreach_div(grads, loss_scale.reshape(()))
        buffers = []
        for matrix, gradient in zip(matrices, gradients, strict=True):
            if matrix.buffer is None:
                matrix.buffer = torch.zeros_like(gradient)
            buffers.append(matrix.buffer)
        pending, directions = momentum_update(buffers, list(gradients), self.settings)
        for matrix, new in zip(matrices, pending):
            matrix.pending = new
        return list(directions)

    def orthogonalise(
        self, names: Sequence[str], loss_scale: Tensor | None = None, gradients: Sequence[Tensor] | None = None
    ) -> None:
        """The step of the matrices `names` (`directions`, arguments as there): each one's new
        momentum and its orthogonalised update (`orthogonalise_into`)."""
        directions = self.directions(names, loss_scale, gradients)
        orthogonalise_into([self.update_buffer(name) for name in names], directions, self.settings)

    def update_buffer(self, name: str) -> Tensor:
        """The tensor matrix `name`'s update is in (allocated on first use; a receiving replica's
        broadcast lands here)."""
        matrix = self.matrices[name]
        if matrix.update is None:
            matrix.update = _whole_empty(matrix.parameter)
        return matrix.update

    def apply(self, updates: Callable[[nn.Parameter], bool] = lambda parameter: True) -> None:
        """The step goes ahead: commit every new momentum, and put each update times its shape
        scale into the `.grad` of its parameter (where `updates` accepts it), for `MuonStep`
        (two foreach kernels for all of them); a sharded gradient takes its rows of the update
        (`shard_of`: no communication)."""
        grads, results, scales = [], [], []
        for matrix in self.matrices.values():
            if matrix.pending is not None:
                matrix.buffer, matrix.pending = matrix.pending, None
            grad = matrix.parameter.grad
            if matrix.update is not None and grad is not None and updates(matrix.parameter):
                grads.append(local(grad))
                results.append(local(shard_of(matrix.update, grad)) if is_sharded(grad) else matrix.update)
                scales.append(shape_scale(matrix.rows, matrix.cols, self.settings.adjust_lr))
        if grads:
            torch._foreach_copy_(grads, results)
            scaled = [i for i, scale in enumerate(scales) if scale != 1.0]
            if scaled:
                torch._foreach_mul_([grads[i] for i in scaled], [scales[i] for i in scaled])

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


def _reduced_gradient(matrix: MuonMatrix) -> Tensor:
    """The matrix's reduced gradient whole (`whole_gradient`); ValueError when it has none."""
    gradient = whole_gradient(matrix.parameter)
    if gradient is None:
        raise ValueError(f"Muon matrix {matrix.name!r} has no gradient to step from")
    return gradient


def _whole_empty(parameter: Tensor) -> Tensor:
    """An uninitialised plain tensor of `parameter`'s whole shape, dtype and device (a DTensor's
    global shape on its local device)."""
    return torch.empty(parameter.shape, dtype=parameter.dtype, device=local(parameter).device)


def _wide(matrix: Tensor) -> Tensor:
    """`matrix` (2-D) as a view with no more rows than columns (its transpose when tall)."""
    return matrix.mT if matrix.size(0) > matrix.size(1) else matrix


def orthogonalise_into(updates: Sequence[Tensor], directions: Sequence[Tensor], settings: MuonConfig) -> None:
    """Each of `directions` orthogonalised into the update of its shape beside it, one stacked
    Newton–Schulz per `shape_groups` group (a group of one: torch.optim.Muon's 2-D kernels, to the bit)."""
    for group in shape_groups(directions):
        if len(group) == 1:
            updates[group[0]].copy_(orthogonalise(directions[group[0]], settings))
            continue
        wide = [_wide(directions[i]) for i in group]
        result = orthogonalise(torch.stack(wide), settings)
        torch._foreach_copy_([_wide(updates[i]) for i in group], list(result.unbind(0)))


def shape_groups(matrices: Sequence[Tensor]) -> list[list[int]]:
    """Indices of `matrices` (2-D) grouped by their shape with no more rows than columns, dtype
    and device, in order of first appearance (each group in list order)."""
    groups: dict[tuple[object, ...], list[int]] = {}
    for index, matrix in enumerate(matrices):
        groups.setdefault((tuple(_wide(matrix).shape), matrix.dtype, matrix.device), []).append(index)
    return list(groups.values())
