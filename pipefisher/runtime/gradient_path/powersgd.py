"""PowerSGD (Vogels, Karimireddy and Jaggi, NeurIPS 2019) for one stage's gradient reduction over
its replicas: rank-r compression with error feedback and a warm-started Q, the scheme of
`torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook`, in two all-reduces the
communication plan names (``grad``, then ``grad_q``).

Every gradient of >= 2 dimensions, viewed as rows x rest (n x m), with r(n + m) < nm is compressed;
the others (vectors, small matrices) travel whole. Per step, for each compressed M (this replica's
gradient plus its carried error):

1. P = M Q, Q being the previous step's reduced Q (the first: normal draws from a generator seeded
   alike on every replica); all-reduce the P's with the uncompressed tensors (`p_factors`).
2. P̂ = an orthonormal basis of the summed P (Gram–Schmidt, twice: `orthonormalise_`); this
   replica's Q_i = Mᵀ P̂; its error, what the
   projection dropped, M − P̂ Q_iᵀ (`q_factors`); all-reduce the Q's.
3. M ← P̂ Qᵀ with the summed Q: the projection of the replicas' summed gradient onto span P̂
   (`decompress`); the summed Q starts the next step.

Sums, not means: pipefisher sums gradients over replicas (each loss is already divided by the
global micro-batch count). When r is at least the rank of the summed gradient, span P̂ holds its
column space and the result is exact to rounding. Everything runs on the gradient's device, with
no host read. fp16: errors are kept unscaled (divided by the loss scale of their step), and a
non-finite error (an overflowing step, skipped anyway) is reset to zero and a non-finite summed Q
is replaced by the Q that started the step.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from pipefisher.planning.comm.volume import powersgd_elements
from pipefisher.runtime.gradient_path.buffers import GradientBuffer


def _carve(flat: Tensor, shapes: list[tuple[int, ...]]) -> list[Tensor]:
    """Consecutive views of `flat` with `shapes`."""
    views, offset = [], 0
    for shape in shapes:
        size = int(torch.Size(shape).numel())
        views.append(flat[offset : offset + size].view(shape))
        offset += size
    return views


def orthonormalise_(matrix: Tensor) -> None:
    """Make the columns of `matrix` (n x r, r small) orthonormal in place: modified Gram–Schmidt,
    run twice so that the columns stay orthogonal to rounding even when they are nearly dependent
    ("twice is enough", Giraud et al. 2005). All on the device: no host read, where
    `torch.linalg.qr` syncs with the host on CUDA (seen on an H100). A zero column stays zero."""
    smallest = torch.finfo(matrix.dtype).tiny
    for _ in range(2):
        for i in range(matrix.shape[1]):
            column = matrix[:, i : i + 1]
            column.div_(torch.linalg.vector_norm(column).clamp_min(smallest))
            rest = matrix[:, i + 1 :]
            rest.sub_(column @ (column.T @ rest))


class PowerSGD:
    """The compression state of one stage's gradient buffer on one replica: the Q factors (m x r
    each, in one flat tensor that is all-reduced), the P factors and the uncompressed tensors (one
    flat tensor), and the error of every compressed matrix (n x m, like the gradient)."""

    def __init__(
        self, buffer: GradientBuffer, rank: int, seed: int, loss_scale: Callable[[], Tensor | None] = lambda: None
    ):
        if rank < 1:
            raise ValueError(f"rank: expected >= 1, got {rank}")
        self.rank, self.loss_scale = rank, loss_scale
        self.matrices: list[Tensor] = []
        self.whole: list[Tensor] = []
        for gradient in buffer.gradients:
            if powersgd_elements(tuple(gradient.shape), rank) < gradient.numel():
                self.matrices.append(gradient.view(gradient.shape[0], -1))
            else:
                self.whole.append(gradient.view(-1))
        device, dtype = buffer.flat.device, buffer.flat.dtype
        p_shapes: list[tuple[int, ...]] = [(m.shape[0], rank) for m in self.matrices]
        whole_shapes: list[tuple[int, ...]] = [(w.numel(),) for w in self.whole]
        self.p_flat = torch.zeros(
            sum(shape[0] * rank for shape in p_shapes) + sum(s[0] for s in whole_shapes), dtype=dtype, device=device
        )
        views = _carve(self.p_flat, p_shapes + whole_shapes)
        self.p, self.whole_slots = views[: len(p_shapes)], views[len(p_shapes) :]
        q_shapes: list[tuple[int, ...]] = [(m.shape[1], rank) for m in self.matrices]
        generator = torch.Generator().manual_seed(seed)
        self.q_flat = torch.randn(
            sum(shape[0] * rank for shape in q_shapes), generator=generator, dtype=torch.float32
        ).to(device=device, dtype=dtype)
        self.q = _carve(self.q_flat, q_shapes)
        #: fp16: the Q that started the step, kept while a step may overflow
        self._q_start = torch.empty_like(self.q_flat) if loss_scale() is not None else None
        self.errors = [torch.zeros_like(m) for m in self.matrices]

    @property
    def compressed_elements(self) -> int:
        """Elements of the gradient that go through the P and Q factors."""
        return sum(m.numel() for m in self.matrices)

    def p_factors(self) -> list[Tensor]:
        """Step 1: add the errors, P = M Q, gather the uncompressed tensors; returns what to all-reduce."""
        scale, start = self.loss_scale(), self._q_start
        if scale is not None and start is not None:
            start.copy_(self.q_flat)
        for matrix, error, p, q in zip(self.matrices, self.errors, self.p, self.q):
            matrix.add_(error if scale is None else error * scale)
            torch.matmul(matrix, q, out=p)
        for slot, tensor in zip(self.whole_slots, self.whole):
            slot.copy_(tensor)
        return [self.p_flat]

    def q_factors(self) -> list[Tensor]:
        """Step 2 (the P's are summed): uncompressed tensors back, P̂, this replica's Q and error;
        returns what to all-reduce."""
        for slot, tensor in zip(self.whole_slots, self.whole):
            tensor.copy_(slot)
        scale = self.loss_scale()
        for matrix, error, p, q in zip(self.matrices, self.errors, self.p, self.q):
            orthonormalise_(p)
            torch.matmul(matrix.T, p, out=q)
            torch.sub(matrix, p @ q.T, out=error)
            if scale is not None:
                error.div_(scale)
                torch.nan_to_num_(error, nan=0.0, posinf=0.0, neginf=0.0)
        return [self.q_flat]

    def decompress(self) -> None:
        """Step 3 (the Q's are summed): every compressed gradient becomes P̂ Qᵀ; with fp16 a
        non-finite Q falls back to the one that started the step (its gradient is skipped)."""
        for matrix, p, q in zip(self.matrices, self.p, self.q):
            torch.matmul(p, q.T, out=matrix)
        start = self._q_start
        if start is not None and self.loss_scale() is not None:
            self.q_flat.copy_(torch.where(torch.isfinite(self.q_flat), self.q_flat, start))

    def tensors(self) -> list[Tensor]:
        """Everything it keeps between and within steps (for the state-bytes report)."""
        return [self.q_flat, self.p_flat, *self.errors] + ([self._q_start] if self._q_start is not None else [])

    def state_dict(self) -> dict:
        return {"q": self.q_flat.clone(), "errors": [error.clone() for error in self.errors]}

    def load_state_dict(self, state: dict) -> None:
        self.q_flat.copy_(state["q"])
        for error, saved in zip(self.errors, state["errors"], strict=True):
            error.copy_(saved)
