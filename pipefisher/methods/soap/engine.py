"""Per-matrix SOAP operations (Vyas et al. 2024: Adam in the eigenbasis of Shampoo's statistics),
callable one at a time in any dependency-respecting order.

Every step, on the reduced, clipped gradient G of each matrix (a >= 2-D parameter viewed as
``(rows, cols)`` and cut into blocks, :mod:`pipefisher.methods.blocks`), ``precondition_all``
replaces ``.grad`` by SOAP's direction and folds G into the statistics. Per block, with the
eigenbases ``Q_L``, ``Q_R`` in use, ``G' = Q_Lᵀ G Q_R``, ``m <- lerp(m, G', 1 - β₁)`` and
``v <- lerp(v, G'², 1 - β₂)`` (both in the eigenbasis), direction
``Q_L (m / (√v + ε)) Q_Rᵀ · √(1 - β₂ᵗ) / (1 - β₁ᵗ)`` (t: the matrix's directions so far);
then ``L <- lerp(L, G Gᵀ, 1 - β_s)`` and ``R <- lerp(R, Gᵀ G, 1 - β_s)``. The first call gives no
direction (``.grad`` zeroed): it folds G and takes the eigendecomposition of the statistics as the
first bases. A step then applies ``p <- (p - lr · direction)(1 - lr · wd)``, skipping a
parameter's first (`pipefisher.methods.soap.front.SoapStep`).

Deferred statistics (``defer_statistics``, the runtime's choice): the step end folds only the
gradients of matrices without bases yet and holds a copy of the others, which ``fold_held()``
folds later (SOAP's U op, in the next step's bubbles); everything that reads the statistics folds
what is held first (the next step end, a refresh, ``statistics``, ``state_dict``), and a snapshot
asked for while gradients are held is taken right after they are folded, so the maths and every
result are those of folding at the step end.

With helpers (``hold_rotations``, SOAP's P op after the stage's last backward) the gradient is
rotated in before the step end, on this rank or another (``rotation_buffer``); rotation is linear,
so the step end takes it times the ratio of the gradient's norms then and now (clipping and
fp16's unscaling are scalar factors), and rotates only the direction out.

Refresh, per matrix and factor f: ``snapshot()`` keeps the statistics at a fixed point (the
refresh cycle's start); ``refresh(name, f)`` computes from the snapshot and the bases in use one
power-iteration step with QR (:func:`pipefisher.methods.soap.basis.power_basis`), pending (a
replica that did not compute it: ``shared_basis`` broadcast into ``basis_buffer``, then
``receive_basis``); ``commit()`` puts pending bases in use, rotates ``m`` into them (``Q_newᵀ Q_old``
on its side: the same moment in the original basis, ``Q_L m Q_Rᵀ``, as when SOAP keeps it there
and rotates it every step) and reorders ``v`` like their columns.

Host reads: none, except one in ``check_health`` (once per refresh cycle), inspection and
``load_state_dict``; and inside ``torch.linalg.eigh``/``qr`` on CUDA (see the basis module).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor, nn

from pipefisher.core.settings import check_section
from pipefisher.methods.blocks import Factor, MatrixInfo, block_views
from pipefisher.methods.counters import read_counters
from pipefisher.methods.dtypes import torch_dtype, working_dtype
from pipefisher.methods.soap import checkpoint as _checkpoint
from pipefisher.methods.soap.basis import eigenbasis, power_basis
from pipefisher.methods.soap.health import KEPT_BASES, SoapHealth, SoapNumericsWarning, message
from pipefisher.methods.soap.method import SOAP, SoapConfig
from pipefisher.methods.soap.state import MatrixState, matrix_parameters, new_matrix, pending_numel
from pipefisher.methods.soap.step import directions, fold, rotate_in
from pipefisher.runtime.primitives.sharding import is_sharded, set_gradient, whole_gradient


class SoapEngine:
    """SOAP state of the matrices of ``module`` (`pipefisher.methods.soap.state.matrix_parameters`
    with the ``skip`` globs) and the operations on it; all state on each parameter's device: the
    statistics, their snapshot and the refresh maths in ``settings.statistics_dtype`` (float64 by
    default: it resolves the statistics' null space far below the tie-break that fixes the
    eigenbasis there, `pipefisher.methods.soap.basis`), the eigenbases and moments in ``dtype``
    (float32 or float64). ``settings``: the run-file section (checked, `check_section`)."""

    def __init__(
        self,
        module: nn.Module,
        settings: SoapConfig | None = None,
        skip: Iterable[str] = (),
        *,
        dtype: torch.dtype = torch.float32,
        defer_statistics: bool = False,
    ) -> None:
        self.settings = settings or SoapConfig()
        check_section(self.settings, SOAP.name)
        self.dtype, self.statistics_dtype = working_dtype(dtype), torch_dtype(self.settings.statistics_dtype)
        self._matrices = {
            name: new_matrix(name, p, self.settings.block_size, self.dtype, self.statistics_dtype)
            for name, p in matrix_parameters(module, skip).items()
        }
        #: whether the step stacks same-shape blocks of all matrices into one batched product each
        #: (on a GPU, where it saves kernel launches; a CPU's batched products are the slower ones)
        self.stack_blocks = any(st.parameter.device.type != "cpu" for st in self._matrices.values())
        self.defer_statistics = defer_statistics
        #: the matrices and copies of their gradients of the last step end, not yet folded
        self._held: tuple[list[MatrixState], list[Tensor]] | None = None
        #: matrix -> its gradient rotated into its eigenbases by this step's P op (or a helper)
        #: and that gradient's norm (`hold_rotations`), read by the step end
        self._rotations: dict[str, tuple[Tensor, Tensor]] = {}
        self._received: dict[str, Tensor] = {}
        #: a snapshot was asked for while gradients were held: taken once they are folded
        self._snapshot_due = False
        #: counter totals per matrix already accounted for; present once warned
        self._baseline: dict[str, int] = {}
        self._warned: set[str] = set()

    # ----------------------------------------------------------------- inspection
    def matrices(self) -> list[MatrixInfo]:
        """The matrices in parameter order, with their block structure (for the planner)."""
        return [st.info for st in self._matrices.values()]

    def parameters(self) -> list[nn.Parameter]:
        """The matrices' parameters, in `matrices` order (what SOAP's step updates)."""
        return [st.parameter for st in self._matrices.values()]

    def updates(self, name: str) -> int:
        """Directions matrix `name` took so far (t of its bias correction)."""
        return self._matrix(name).updates

    def statistics(self, name: str, factor: Factor) -> list[Tensor]:
        """Views of ``factor``'s block statistics, in block order (do not modify)."""
        self.fold_held()
        st = self._matrix(name)
        return block_views(st.factors[factor].statistic, st.info.block_sizes(factor))

    def basis(self, name: str, factor: Factor) -> list[Tensor] | None:
        """Views of ``factor``'s block eigenbases in use (columns), or None before the first step."""
        st = self._matrix(name)
        basis = st.factors[factor].basis
        return None if basis is None else block_views(basis, st.info.block_sizes(factor))

    def matrix_state(self, name: str) -> MatrixState:
        """Matrix `name`'s state (KeyError naming a parameter that is not a SOAP matrix)."""
        return self._matrix(name)

    @property
    def held_gradient_bytes(self) -> int:
        """Bytes of the gradient copies held for `fold_held` (0 when none are)."""
        return 0 if self._held is None else sum(g.numel() * g.element_size() for g in self._held[1])

    @property
    def held_rotation_bytes(self) -> int:
        """Bytes of the rotated gradients held for the step end and of the buffers helpers send theirs to."""
        held = {id(t): t for t in [turned for turned, _ in self._rotations.values()] + list(self._received.values())}
        return sum(t.numel() * t.element_size() for t in held.values())

    def health(self) -> dict[str, SoapHealth]:
        """Per-matrix numerics counters as host values (one host read for all matrices)."""
        return {name: SoapHealth(*values) for name, values in self._read_counters().items()}

    # ----------------------------------------------------------------- every step (no host reads)
    def precondition_all(self, keep: Callable[[nn.Parameter], bool] | None = None) -> None:
        """SOAP's step-end work on every matrix with a ``.grad`` (with `keep`: those it accepts),
        see the module doc: ``.grad`` becomes the direction (in its own dtype; computed in
        ``dtype``), and the gradient is folded into the statistics; a matrix's first call
        takes its first eigenbases instead of a direction and zeroes ``.grad``. The matrices'
        same-shape blocks are stacked into one batched product each (`pipefisher.methods.soap.step`).
        With ``defer_statistics`` the gradients of started matrices are held for `fold_held`.

        A sharded ``.grad`` (ZeRO-2/3) is gathered whole (`whole_gradient`, a collective over the
        stage's replicas, one per matrix in `matrices` order: every replica calls this at the same
        step end with the same matrices), so every replica folds the same statistics; this rank
        keeps its rows of the direction (`set_gradient`). An unsharded one is rewritten in place."""
        self.fold_held()
        chosen: list[MatrixState] = []
        raw: list[Tensor] = []
        for st in self._matrices.values():
            if keep is not None and not keep(st.parameter):
                continue
            grad = whole_gradient(st.parameter)
            if grad is not None:
                chosen.append(st)
                raw.append(grad.detach())
        grads = [grad.reshape(st.info.shape).to(self.dtype) for st, grad in zip(chosen, raw)]
        started = [number for number, st in enumerate(chosen) if st.started]
        held = self._held_rotations([chosen[i] for i in started], [grads[i] for i in started])
        now = [i for i, st in enumerate(chosen) if not (self.defer_statistics and st.started)]
        fold([chosen[i] for i in now], [grads[i] for i in now], self.settings, self.statistics_dtype, self.stack_blocks)
        if self.defer_statistics and started:  # a copy: `raw` (maybe `grads`' storage) becomes the direction
            self._held = ([chosen[i] for i in started], [grads[i].clone() for i in started])
        if started:
            found = directions(
                [chosen[i] for i in started], [grads[i] for i in started], self.settings, self.stack_blocks, held
            )
            torch._foreach_copy_([raw[i] for i in started], [d.view_as(raw[i]) for d, i in zip(found, started)])
        for st, grad in zip(chosen, raw):
            if not st.started:
                self._first_bases(st)
                grad.zero_()
            if is_sharded(st.parameter.grad):
                set_gradient(st.parameter, grad)

    def hold_rotations(self, names: Iterable[str], received: Iterable[str] = ()) -> None:
        """SOAP's P op (`SoapConfig.helpers`): each started matrix of `names` with a ``.grad`` has
        its gradient rotated into its eigenbases now (`rotate_in`: linear in it, so taken before
        clipping and fp16's unscaling), and those of `received` get it from a helper into
        `rotation_buffer`; both are held with the gradient's norm now for this step's
        `precondition_all`, which scales them by the ratio of its gradient's norm to it. Unsharded
        gradients only; replaces what an earlier call held. No host read."""
        self._rotations.clear()
        local = [st for st in map(self._matrix, names) if st.started and st.parameter.grad is not None]
        helped = [st for st in map(self._matrix, received) if st.started and st.parameter.grad is not None]
        grads = [self.gradient_matrix(st.info.name) for st in local + helped]
        norms = torch._foreach_norm(grads) if grads else []
        turned = rotate_in(local, grads[: len(local)], self.stack_blocks)
        buffers = turned + [self.rotation_buffer(st.info.name) for st in helped]
        for st, buffer, norm in zip(local + helped, buffers, norms):
            self._rotations[st.info.name] = (buffer, norm)

    def gradient_matrix(self, name: str) -> Tensor:
        """Matrix `name`'s ``.grad`` as ``(rows, cols)`` in the working dtype (unsharded: a P op's)."""
        st = self._matrix(name)
        if st.parameter.grad is None:
            raise ValueError(f"SOAP matrix {name!r} has no gradient")
        return st.parameter.grad.detach().reshape(st.info.shape).to(self.dtype)

    def rotation_buffer(self, name: str) -> Tensor:
        """Where a helper's rotation of matrix `name`'s gradient is received (``(rows, cols)`` in
        the working dtype; the same tensor every step, allocated on first use)."""
        st = self._matrix(name)
        if name not in self._received:
            self._received[name] = torch.zeros(st.info.shape, dtype=self.dtype, device=st.parameter.device)
        return self._received[name]

    def _held_rotations(self, states: list[MatrixState], grads: list[Tensor]) -> list[Tensor | None]:
        """Per started matrix of `states` (with the step end's `grads`) what `hold_rotations` held,
        times the ratio of the norms of its gradient now and then (0 where that was 0), or None
        (`directions` rotates it). Consumes what is held."""
        held = [self._rotations.get(st.info.name) for st in states]
        self._rotations.clear()
        kept = [(i, found) for i, found in enumerate(held) if found is not None]
        now = torch._foreach_norm([grads[i] for i, _ in kept]) if kept else []
        scaled = {i: turned * torch.where(then > 0, norm / then, 0.0) for (i, (turned, then)), norm in zip(kept, now)}
        return [scaled.get(i) for i in range(len(states))]

    def fold_held(self) -> None:
        """Fold the gradients held since the last step end into the statistics (SOAP's U op;
        nothing when none are held), then take a snapshot asked for meanwhile."""
        if self._held is not None:
            states, grads = self._held
            self._held = None
            fold(states, grads, self.settings, self.statistics_dtype, self.stack_blocks)
        if self._snapshot_due:
            self._snapshot_due = False
            self.snapshot()

    def drop_held(self) -> None:
        """Forget the held gradients unfolded and the rotations held (the profiler's throwaway
        engines, which time the fold and the rotation in as tasks of their own)."""
        self._held, self._snapshot_due = None, False
        self._rotations.clear()

    def fold_into_statistics(self, name: str, grad: Tensor) -> None:
        """Fold ``grad`` (``(rows, cols)``) into matrix `name`'s statistics now (the profiler
        times each matrix's fold with it)."""
        st = self._matrix(name)
        fold(
            [st], [grad.reshape(st.info.shape).to(self.dtype)], self.settings, self.statistics_dtype, self.stack_blocks
        )

    # ----------------------------------------------------------------- refresh (no host reads)
    def snapshot(self) -> None:
        """Keep every started matrix's statistics as the next refreshes' input (while gradients
        are held: once `fold_held` folded them)."""
        if self._held is not None:
            self._snapshot_due = True
            return
        for st in self._matrices.values():
            if st.started:
                for fs in st.factors.values():
                    fs.snapshot = fs.statistic.clone()

    def refresh(self, name: str, factor: Factor) -> None:
        """Pending eigenbases of ``factor`` from its snapshot and the bases in use (nothing before
        the first snapshot); a block whose refresh fails keeps its basis and column order."""
        self.fold_held()
        st = self._matrix(name)
        fs = st.factors[factor]
        if fs.snapshot is None:
            return
        sizes = st.info.block_sizes(factor)
        pending = self.basis_buffer(name, factor)
        bases = block_views(pending, sizes)
        orders = _order_views(pending, sizes)
        stats, current = block_views(fs.snapshot, sizes), block_views(fs.basis_in_use(), sizes)
        for n in sorted(set(sizes)):
            indices = [k for k, size in enumerate(sizes) if size == n]
            before = torch.stack([current[k] for k in indices])
            fresh, order, ok = power_basis(torch.stack([stats[k] for k in indices]), before)
            keep = torch.arange(n, device=order.device).expand_as(order)
            for i, k in enumerate(indices):
                bases[k].copy_(torch.where(ok[i], fresh[i].to(pending.dtype), before[i]))
                orders[k].copy_(torch.where(ok[i], order[i], keep[i]))
            st.counters[KEPT_BASES].add_((~ok).sum())
        fs.pending = pending

    def shared_basis(self, name: str, factor: Factor) -> Tensor:
        """The pending result of ``factor`` as ONE contiguous 1-D tensor (bases, then column
        orders), to broadcast to the other replicas; a placeholder where nothing was refreshed
        (before the first snapshot, which every replica knows alike)."""
        pending = self._matrix(name).factors[factor].pending
        return pending if pending is not None else self.basis_buffer(name, factor).zero_()

    def basis_buffer(self, name: str, factor: Factor) -> Tensor:
        """An empty tensor of :meth:`shared_basis`'s shape, dtype and device."""
        st = self._matrix(name)
        return torch.empty(pending_numel(st.info, factor), dtype=self.dtype, device=st.parameter.device)

    def receive_basis(self, name: str, factor: Factor, tensor: Tensor) -> None:
        """Keep a received :meth:`shared_basis` tensor as ``factor``'s pending result (ignored
        before the first snapshot, when the sender refreshed nothing)."""
        st = self._matrix(name)
        fs = st.factors[factor]
        if tensor.numel() != pending_numel(st.info, factor):
            raise ValueError(
                f"SOAP matrix {name!r}: {factor} basis of {tensor.numel()} elements, want {pending_numel(st.info, factor)}"
            )
        if fs.snapshot is not None:
            fs.pending = tensor.to(device=st.parameter.device, dtype=self.dtype)

    def commit(self) -> None:
        """Pending bases become the ones in use: each block's first moment is rotated into them
        (``Q_newᵀ Q_old m`` for A, ``m Q_oldᵀ Q_new`` for B) and its second moment follows their
        new column order (rows for A, columns for B)."""
        for st in self._matrices.values():
            for factor, fs in st.factors.items():
                if fs.pending is None:
                    continue
                sizes = st.info.block_sizes(factor)
                basis = fs.pending[: st.info.statistic_numel(factor)].clone()
                old, new = block_views(fs.basis_in_use(), sizes), block_views(basis, sizes)
                orders = _order_views(fs.pending, sizes)
                for k, rows, cols in st.info.grid():
                    turn = new[k].mT @ old[k]
                    first, second = st.exp_avg[rows, cols], st.exp_avg_sq[rows, cols]
                    first.copy_(turn @ first if factor == "A" else first @ turn.mT)
                    second.copy_(second.index_select(0 if factor == "A" else 1, orders[k].long()))
                fs.basis, fs.pending = basis, None

    def check_health(self) -> None:
        """One host read of every counter: warn (:class:`SoapNumericsWarning`) the first time a
        matrix skipped a statistics update or kept a basis; call once per refresh cycle (a held
        gradient's skip is counted once it is folded, and read at the next check)."""
        for name, values in self._read_counters().items():
            if name not in self._warned and sum(values) > self._baseline.get(name, 0):
                self._warned.add(name)
                warnings.warn(message(name, values), SoapNumericsWarning, stacklevel=2)

    # ----------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict[str, Any]:
        """Per matrix: statistics, snapshots, bases in use and pending, moments, its direction
        count and health counters (nested dicts of tensors and ints), held gradients folded."""
        self.fold_held()
        return {"matrices": {name: _checkpoint.matrix_state(st) for name, st in self._matrices.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output (copies) into an engine over an equally shaped model
        with the same matrices and block size. Trouble counted before is not warned about again."""
        matrices = state["matrices"]
        if set(matrices) != set(self._matrices):
            raise ValueError(f"SOAP matrices differ: checkpoint {sorted(matrices)} vs model {sorted(self._matrices)}")
        self.drop_held()
        for name, entry in matrices.items():
            _checkpoint.load_matrix_state(self._matrices[name], entry, self.dtype, self.statistics_dtype)
        self._baseline = {name: sum(values) for name, values in self._read_counters().items()}
        self._warned = set()

    # ----------------------------------------------------------------- internals
    def _matrix(self, name: str) -> MatrixState:
        try:
            return self._matrices[name]
        except KeyError:
            raise KeyError(f"{name!r} is not a SOAP matrix") from None

    def _first_bases(self, st: MatrixState) -> None:
        """Each factor's first eigenbases from its statistics (the identity where that fails)."""
        for factor, fs in st.factors.items():
            sizes = st.info.block_sizes(factor)
            basis = torch.empty_like(fs.statistic, dtype=self.dtype)
            views, stats = block_views(basis, sizes), block_views(fs.statistic, sizes)
            for n in sorted(set(sizes)):
                indices = [k for k, size in enumerate(sizes) if size == n]
                fresh, ok = eigenbasis(torch.stack([stats[k] for k in indices]))
                eye = torch.eye(n, dtype=fresh.dtype, device=fresh.device)
                for i, k in enumerate(indices):
                    views[k].copy_(torch.where(ok[i], fresh[i], eye))
                st.counters[KEPT_BASES].add_((~ok).sum())
            fs.basis = basis

    def _read_counters(self) -> dict[str, tuple[int, ...]]:
        return read_counters({name: st.counters for name, st in self._matrices.items()})


def _order_views(pending: Tensor, sizes: tuple[int, ...]) -> list[Tensor]:
    """The column-order part of a pending result: one 1-D view of n numbers per block."""
    views, start = [], sum(n * n for n in sizes)
    for n in sizes:
        views.append(pending[start : start + n])
        start += n
    return views
