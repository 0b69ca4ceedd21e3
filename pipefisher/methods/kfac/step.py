"""K-FAC's every-step preconditioning ``B⁻¹ G A⁻¹`` (`pipefisher.methods.kfac.engine`) over many
layers at once: layers whose gradient matrices have one shape, factor dtype and device, and the
same committed factors, are stacked, so that each inverse product is one batched kernel per group
instead of one per layer. An inverse that is not ok is skipped on the device (``torch.where``), so
its layer's gradient passes through it bit for bit. No host read.

Under ZeRO-2/3 (FSDP2) a gradient is this rank's shard of the reduced gradient: it is read whole
(`whole_gradient`, an all-gather over the replicas it is sharded over, layer by layer, weight before bias,
in the order of the states given: the same on every replica), preconditioned whole (every replica
computes the same result from the same inverses) and written back as this rank's shard
(`set_gradient`). Unsharded gradients are read and written in place, as they are."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from pipefisher.methods.kfac.layer import LayerState
from pipefisher.runtime.primitives.sharding import is_sharded, set_gradient, whole_gradient


def gradient_matrix(st: LayerState) -> Tensor | None:
    """The layer's whole gradient as ``(dout, din[+1])`` (a bias as the last column, zeros for a
    frozen one), or None when its weight has no gradient. Collective when sharded (see above)."""
    weight, bias = st.weight, st.bias
    whole = whole_gradient(weight)
    if whole is None:
        return None
    grad = whole.T if st.info.transposed else whole
    if bias is not None:
        column = whole_gradient(bias)
        if column is None:
            column = torch.zeros(bias.shape, dtype=bias.dtype, device=grad.device)
        grad = torch.cat([grad, column[:, None]], 1)
    return grad


def write_gradients(parameters: list[Tensor], results: list[Tensor]) -> None:
    """Make each parameter's gradient its whole result: in place, in one kernel, for unsharded
    gradients; this rank's shard of it for sharded ones (no communication)."""
    plain = [
        (p.grad, result) for p, result in zip(parameters, results) if p.grad is not None and not is_sharded(p.grad)
    ]
    if plain:
        torch._foreach_copy_([grad for grad, _ in plain], [result for _, result in plain])
    for parameter, result in zip(parameters, results):
        if is_sharded(parameter.grad):
            set_gradient(parameter, result)


def apply_inverses(matrices: Tensor, inverses: Sequence[tuple[str, Tensor, Tensor]]) -> Tensor:
    """``B⁻¹ G A⁻¹`` of `matrices` (one G or a stack), for each (factor, inverse, ok) in the order
    given: B from the left, A from the right, where ``ok`` (a bool of each matrix's shape
    broadcastable, on the device) else G passes through bit for bit."""
    out = matrices
    for factor, inverse, ok in inverses:
        out = torch.where(ok, inverse @ out if factor == "B" else out @ inverse, out)
    return out


def write_matrices(states: list[LayerState], matrices: list[Tensor]) -> None:
    """Make each layer's weight (and bias) gradient its matrix's columns (`gradient_matrix`'s
    layout), in one kernel for the unsharded gradients (`write_gradients`)."""
    targets: list[Tensor] = []
    results: list[Tensor] = []
    for st, new in zip(states, matrices):
        weight, bias, din = st.weight, st.bias, st.info.in_features
        targets.append(weight)
        results.append(new[:, :din].T if st.info.transposed else new[:, :din])
        if bias is not None and bias.grad is not None:
            targets.append(bias)
            results.append(new[:, din])
    write_gradients(targets, results)


def precondition_layers(states: list[LayerState], with_vg: bool) -> list[Tensor | None]:
    """Replace each layer's weight (and bias) gradient G by ``B⁻¹ G A⁻¹`` with its committed
    inverses (one missing acts as the identity); per layer ``⟨G̃, G⟩`` as a 0-dim tensor in the
    factor dtype when `with_vg` (None otherwise, or without a gradient)."""
    grads: dict[int, Tensor] = {}
    groups: dict[tuple[object, ...], list[int]] = {}
    for number, st in enumerate(states):
        grad = gradient_matrix(st)
        if grad is not None:
            grads[number] = grad
            key = (tuple(grad.shape), st.dtype, grad.device, "B" in st.active, "A" in st.active)
            groups.setdefault(key, []).append(number)
    vgs: list[Tensor | None] = [None] * len(states)
    written: list[LayerState] = []
    matrices: list[Tensor] = []
    for members in groups.values():
        first = states[members[0]]
        original = torch.stack([grads[i].to(first.dtype) for i in members])
        out = apply_inverses(
            original,
            [
                (
                    factor,
                    torch.stack([states[i].active[factor].value for i in members]),
                    torch.stack([states[i].active[factor].ok for i in members]).view(-1, 1, 1),
                )
                for factor in ("B", "A")
                if factor in first.active
            ],
        )
        vg = (out * original).sum(dim=(-2, -1)) if with_vg else None
        for row, number in enumerate(members):
            written.append(states[number])
            matrices.append(out[row])
            if vg is not None:
                vgs[number] = vg[row]
    write_matrices(written, matrices)
    return vgs
