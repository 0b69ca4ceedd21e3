"""Per-matrix Shampoo operations, callable one at a time in any dependency-respecting order.

Life of one refresh, per matrix (a >= 2-D trainable parameter viewed as ``(rows, cols)`` and cut
into blocks, :mod:`pipefisher.methods.blocks`) and factor ``f`` in {"A", "B"}:
``capture(name)`` (copy of ``.grad``) -> the replicas sum ``captured_gradient(name)`` in place ->
``update_statistics(name, f)`` for both factors -> ``release(name)``; ``compute_root(name, f)``
(or, on a replica that did not compute it: ``shared_root`` broadcast into ``root_buffer``, then
``receive_root``) -> ``commit(name)``. ``precondition_all`` uses the committed roots every step.

Maths per block ``(i, j)`` of the gradient ``G``: ``L_ij <- β L_ij + (1 - β) G_ij G_ijᵀ`` (A) and
``R_ij <- β R_ij + (1 - β) G_ijᵀ G_ij`` (B), plain sums when ``β = 1``; roots
``(S + ε I)^(-1/4)``; direction ``L_ij^(-1/4) G_ij R_ij^(-1/4)``, rescaled to the Frobenius norm
of the grafting direction's block (Adam or SGD grafting).

Host reads: none, except one in ``check_health`` (the numerics report, once per refresh cycle),
inspection (``health``, ``statistics``, ``roots``) and ``load_state_dict``; and inside
``torch.linalg.eigh`` on CUDA (see :mod:`pipefisher.methods.shampoo.roots`).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor, nn

from pipefisher.core.settings import check_section
from pipefisher.methods.counters import read_counters
from pipefisher.methods.dtypes import torch_dtype, working_dtype
from pipefisher.methods.shampoo import checkpoint as _checkpoint
from pipefisher.methods.shampoo import health as _health
from pipefisher.methods.blocks import FACTORS, Factor, MatrixInfo, block_views
from pipefisher.methods.shampoo.grafting import graft_direction
from pipefisher.methods.shampoo.health import ShampooHealth, ShampooNumericsWarning
from pipefisher.methods.shampoo.roots import inverse_root
from pipefisher.methods.shampoo.method import SHAMPOO, ShampooConfig
from pipefisher.methods.shampoo.state import (
    MatrixState,
    Roots,
    committed,
    gradient_matrix,
    is_matrix,
    new_matrix,
    owned_parameters,
    root_views,
)
from pipefisher.methods.block_stacks import block_products
from pipefisher.methods.shampoo.step import directions
from pipefisher.runtime.primitives.sharding import is_sharded, local, set_gradient, shard_rows, whole_gradient


class ShampooEngine:
    """Shampoo state of every trainable parameter of ``module`` and the operations on it.

    Matrices: parameters with ``ndim >= 2`` whose name matches none of the ``skip`` globs; every
    other trainable parameter only takes the grafting direction (none with ``matrices_only``). Tied parameters count once,
    under their first name in ``named_parameters()``. All state lives on each parameter's device,
    statistics in ``settings.statistics_dtype``, everything else in ``dtype`` (float32 or float64).

    ``settings``: the run-file section (checked, `check_section`); besides it the values from the
    rest of the run: Adam grafting's second-moment decay ``graft_beta2`` in [0, 1) and denominator
    term ``graft_epsilon`` > 0 (a run's optimizer.betas[1] and optimizer.eps), and
    ``matrices_only`` (a run's `ShampooConfig.matrices_only`).
    """

    def __init__(
        self,
        module: nn.Module,
        settings: ShampooConfig | None = None,
        skip: Iterable[str] = (),
        *,
        graft_beta2: float = 0.999,
        graft_epsilon: float = 1e-8,
        dtype: torch.dtype = torch.float32,
        matrices_only: bool = False,
    ) -> None:
        self.settings = settings or ShampooConfig()
        check_section(self.settings, SHAMPOO.name)
        if not 0.0 <= graft_beta2 < 1.0:
            raise ValueError(f"graft_beta2 must be in [0, 1), got {graft_beta2}")
        if not (graft_epsilon > 0.0 and math.isfinite(graft_epsilon)):
            raise ValueError(f"graft_epsilon must be a finite positive number, got {graft_epsilon}")
        self.graft_beta2, self.graft_epsilon = graft_beta2, graft_epsilon
        self.dtype, self.statistics_dtype = working_dtype(dtype), torch_dtype(self.settings.statistics_dtype)
        patterns = tuple(skip)
        self._parameters = owned_parameters(module, patterns, matrices_only)
        self._matrices = {
            name: new_matrix(name, p, self.settings.block_size, self.statistics_dtype)
            for name, p in self._parameters.items()
            if is_matrix(name, p, patterns)
        }
        self._exp_avg_sq = (
            {name: torch.zeros(p.shape, dtype=self.dtype, device=p.device) for name, p in self._parameters.items()}
            if self.settings.grafting == "adam"
            else {}
        )
        self._step = 0
        #: matrix -> its products of this step (`hold_products`, or a helper's), read by precondition_all
        self._held: dict[str, Tensor] = {}
        self._ready: set[str] = set()
        #: whether the step stacks same-shape blocks into one batched product each (on a GPU only)
        self.stack_blocks = any(st.parameter.device.type != "cpu" for st in self._matrices.values())
        #: counter totals per (matrix, factor) already accounted for; present once warned
        self._baseline: dict[tuple[str, Factor], int] = {}
        self._warned: set[tuple[str, Factor]] = set()

    # ----------------------------------------------------------------- inspection
    def matrices(self) -> list[MatrixInfo]:
        """The matrices in parameter order, with their block structure (for the planner)."""
        return [st.info for st in self._matrices.values()]

    @property
    def step(self) -> int:
        """Number of :meth:`precondition_all` calls so far."""
        return self._step

    def health(self) -> dict[str, ShampooHealth]:
        """Per-matrix numerics counters as host values (one host read for all matrices)."""
        values = self._read_counters()
        return {name: _health.total(values[name, f] for f in FACTORS) for name in self._matrices}

    def statistics(self, name: str, factor: Factor) -> list[Tensor]:
        """Views of ``factor``'s block statistics, in block order (do not modify)."""
        st = self._matrix(name)
        return block_views(st.factors[_checked(factor)].statistic, st.info.block_sizes(factor))

    def roots(self, name: str, factor: Factor) -> list[Tensor] | None:
        """Views of ``factor``'s committed block roots (NaN for a block that never had a valid
        root), or None before the first commit of that factor."""
        st = self._matrix(name)
        committed = st.factors[_checked(factor)].committed
        return None if committed is None else block_views(committed.value, st.info.block_sizes(factor))

    # ----------------------------------------------------------------- refresh tasks (no host reads)
    def capture(self, name: str | None = None) -> None:
        """Copy the matrix's current ``.grad`` (any float dtype; None counts as zeros) into its
        captured ``(rows, cols)`` gradient in ``dtype``; None: every matrix. A sharded ``.grad``
        (ZeRO-2/3: this rank's rows of the reduced gradient) fills its rows (`shard_rows`) and
        leaves the others zero, so the replicas' sum of the captures is the whole gradient. No
        communication."""
        for st in self._selected(name):
            rows, cols = st.info.shape
            p = st.parameter
            captured = torch.zeros(rows, cols, dtype=self.dtype, device=p.device)
            grad = p.grad
            if grad is not None:
                held = captured[shard_rows(p)] if is_sharded(grad) else captured
                held.copy_(local(grad.detach()).reshape(held.shape))
            st.captured = captured

    def captured_gradient(self, name: str) -> Tensor:
        """The captured ``(rows, cols)`` gradient itself: the caller may sum it over replicas in place."""
        st = self._matrix(name)
        if st.captured is None:
            raise RuntimeError(f"Shampoo matrix {name!r}: no captured gradient; call capture first")
        return st.captured

    def update_statistics(self, name: str, factor: Factor) -> None:
        """Fold the captured gradient into ``factor``'s block statistics (see the module doc).

        A non-finite captured gradient leaves them unchanged and is counted (device-side).
        """
        st = self._matrix(name)
        fs = st.factors[_checked(factor)]
        g = self.captured_gradient(name).to(fs.statistic.dtype, copy=True)  # one copy, zeroed in place
        finite = torch.isfinite(g).all()
        g.masked_fill_(~finite, 0.0)
        beta2 = self.settings.beta2
        decay = torch.where(finite, torch.full((), beta2, dtype=g.dtype, device=g.device), 1.0) if beta2 < 1.0 else None
        alpha = 1.0 - beta2 if beta2 < 1.0 else 1.0
        stats = block_views(fs.statistic, st.info.block_sizes(factor))
        for k, rows, cols in st.info.grid():
            block = g[rows, cols]
            if decay is not None:
                stats[k].mul_(decay)
            if factor == "A":
                stats[k].addmm_(block, block.T, alpha=alpha)
            else:
                stats[k].addmm_(block.T, block, alpha=alpha)
        fs.counters[_health.SKIPPED_STATISTICS].add_(~finite)

    def release(self, name: str) -> None:
        """Drop the captured gradient (after both factors' statistics are updated)."""
        self._matrix(name).captured = None

    def compute_root(self, name: str, factor: Factor) -> None:
        """Pending roots ``(S_k + ε I)^(-1/4)`` of every block of ``factor``.

        A block whose root fails (non-finite, or decomposition failed) keeps its previous
        pending root, else its committed root, else a NaN placeholder marked not ok (that block
        then takes the grafting direction); counted on the device (:meth:`check_health` reports).
        """
        st = self._matrix(name)
        fs = st.factors[_checked(factor)]
        sizes = st.info.block_sizes(factor)
        stats = block_views(fs.statistic, sizes)
        found: dict[int, tuple[Tensor, Tensor]] = {}  # block -> its root and whether it is ok
        for n in sorted(set(sizes)):
            indices = [k for k, size in enumerate(sizes) if size == n]
            batch, ok = inverse_root(
                torch.stack([stats[k] for k in indices]), self.settings.epsilon, self.settings.root
            )
            for i, k in enumerate(indices):
                found[k] = batch[i], ok[i]
        fresh = [found[k][0] for k in range(len(sizes))]
        ok = torch.stack([found[k][1] for k in range(len(sizes))])
        previous = fs.pending if fs.pending is not None else fs.committed
        value = self.root_buffer(name, factor)
        fallback = block_views(previous.value, sizes) if previous is not None else None
        nan = torch.full((), float("nan"), dtype=value.dtype, device=value.device)
        for k, view in enumerate(block_views(value, sizes)):
            view.copy_(torch.where(ok[k], fresh[k], fallback[k] if fallback is not None else nan))
        fs.pending = Roots(value, ok if previous is None else ok | previous.ok)
        fs.counters[_health.SKIPPED_ROOTS].add_((~ok).sum())

    def shared_root(self, name: str, factor: Factor) -> Tensor:
        """The pending roots of ``factor`` as ONE contiguous 1-D tensor (block layout of
        :mod:`pipefisher.methods.blocks`), to broadcast to the other replicas (do not modify)."""
        pending = self._matrix(name).factors[_checked(factor)].pending
        if pending is None:
            raise RuntimeError(f"Shampoo matrix {name!r}: no pending {factor} roots; call compute_root first")
        return pending.value

    def root_buffer(self, name: str, factor: Factor) -> Tensor:
        """An empty tensor of :meth:`shared_root`'s shape, dtype and device to receive it into."""
        st = self._matrix(name)
        return torch.empty_like(st.factors[_checked(factor)].statistic, dtype=self.dtype)

    def receive_root(self, name: str, factor: Factor, tensor: Tensor) -> None:
        """Store a received :meth:`shared_root` tensor as ``factor``'s pending roots (kept, not
        copied, when its dtype and device match); a non-finite block is marked not ok."""
        st = self._matrix(name)
        fs = st.factors[_checked(factor)]
        if tensor.shape != fs.statistic.shape:
            raise ValueError(
                f"Shampoo matrix {name!r}: {factor} roots of shape {tuple(tensor.shape)}, "
                f"want {tuple(fs.statistic.shape)}"
            )
        value = tensor.to(device=fs.statistic.device, dtype=self.dtype)
        views = block_views(value, st.info.block_sizes(factor))
        fs.pending = Roots(value, torch.stack([torch.isfinite(v).all() for v in views]))

    def commit(self, name: str | None = None) -> None:
        """Pending roots become the roots in use (None: every matrix); factors without pending
        roots keep theirs."""
        for st in self._selected(name):
            for fs in st.factors.values():
                if fs.pending is not None:
                    fs.committed, fs.pending = fs.pending, None

    def check_health(self) -> None:
        """One host read of every counter: warn (:class:`ShampooNumericsWarning`) the first time a
        (matrix, factor) skipped a statistics update or a block root; call once per refresh
        cycle, outside the steps' hot path."""
        for key, values in self._read_counters().items():
            if key not in self._warned and sum(values) > self._baseline.get(key, 0):
                self._warned.add(key)
                warnings.warn(_health.message(*key, values), ShampooNumericsWarning, stacklevel=2)

    # ----------------------------------------------------------------- a P op's products (helpers)
    def hold_products(self, names: Iterable[str]) -> None:
        """The P op of `ShampooConfig.helpers`: for each matrix of `names` with committed roots of
        both factors, the products of its current gradient (`block_products`: linear in it, so
        taken before clipping and fp16's unscaling, which grafting's norm transfer undoes), held
        for this step's `precondition_all`. Unsharded gradients only. No host read."""
        if self._step + 1 <= self.settings.start_step:
            return
        states = [st for st in map(self._matrix, names) if st.parameter.grad is not None and committed(st)]
        if not states:
            return
        found = block_products(
            [st.info for st in states],
            [root_views(st, "A") for st in states],
            [root_views(st, "B") for st in states],
            [gradient_matrix(st, self.dtype) for st in states],
            self.stack_blocks,
        )
        for st, product in zip(states, found):
            self._held[st.info.name] = product
            self._ready.add(st.info.name)

    def matrix_state(self, name: str) -> MatrixState:
        """Matrix `name`'s state (KeyError naming a parameter that is not a Shampoo matrix)."""
        return self._matrix(name)

    def product_buffer(self, name: str) -> Tensor:
        """Where a helper's products of matrix `name` are received, held for this step's
        `precondition_all` (allocated on first use)."""
        st = self._matrix(name)
        held = self._held.get(name)
        if held is None:
            held = self._held[name] = torch.zeros(st.info.shape, dtype=self.dtype, device=st.parameter.device)
        self._ready.add(name)
        return held

    # ----------------------------------------------------------------- every step (no host reads)
    def precondition_all(self, keep: Callable[[nn.Parameter], bool] | None = None) -> None:
        """Replace every parameter's ``.grad`` by its Shampoo direction (see the module doc),
        computed in ``dtype`` and written back in ``.grad``'s dtype; with `keep`, only
        of the parameters it accepts (ZeRO-1: those this rank updates; the others' grafting state
        stays untouched). A sharded ``.grad`` (ZeRO-2/3) is gathered whole (`whole_gradient`, a
        collective over the stage's replicas, one per parameter in parameter order: every replica
        calls this at the same step end with the same parameters), preconditioned as a whole one,
        and this rank keeps its rows (`set_gradient`); an unsharded one is rewritten in place.

        Counts the call (``step`` t, from 1). The grafting direction (Adam state updated for every
        parameter with a gradient) is used alone for non-matrices, for matrices without committed
        roots of both factors, for blocks whose roots are not ok, and while ``t <= start_step``.
        Parameters without ``.grad`` are left alone. The matrices' same-shape blocks are stacked
        into one batched product each (`pipefisher.methods.shampoo.step`).
        """
        self._step += 1
        stacked: list[tuple[MatrixState, Tensor, Tensor, Tensor]] = []
        sharded: list[tuple[nn.Parameter, Tensor]] = []
        for name, p in self._parameters.items():
            if keep is not None and not keep(p):
                continue
            grad = whole_gradient(p)
            if grad is None:
                continue
            if is_sharded(p.grad):
                sharded.append((p, grad))
            g = grad.detach().to(self.dtype)
            graft = graft_direction(g, self._exp_avg_sq.get(name), self._step, self.graft_beta2, self.graft_epsilon)
            st = self._matrices.get(name)
            if st is not None and self._preconditions(st):
                stacked.append((st, grad, g.reshape(st.info.shape), graft.reshape(st.info.shape)))
            else:
                grad.copy_(graft)
        if stacked:
            states, grads, gs, grafts = (list(column) for column in zip(*stacked))
            held = [self._held.get(st.info.name) if st.info.name in self._ready else None for st in states]
            found = directions(states, gs, grafts, self.settings.grafting != "none", self.stack_blocks, held)
            torch._foreach_copy_(grads, [d.view_as(grad) for d, grad in zip(found, grads)])
        for p, whole in sharded:
            set_gradient(p, whole)
        self._ready.clear()

    # ----------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict[str, Any]:
        """Step counter, Adam grafting state per parameter and, per matrix, statistics, pending and
        committed roots with their flags, health counters and a held captured gradient (nested
        dicts of tensors, ints and strings only)."""
        return {
            "step": self._step,
            "exp_avg_sq": dict(self._exp_avg_sq),
            "matrices": {name: _checkpoint.matrix_state(st) for name, st in self._matrices.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output (copies) into an engine over an equally shaped model
        with the same matrices and block size. Trouble counted before is not warned about again."""
        matrices = state["matrices"]
        if set(matrices) != set(self._matrices):
            raise ValueError(
                f"Shampoo matrices differ: checkpoint {sorted(matrices)} vs model {sorted(self._matrices)}"
            )
        if set(state["exp_avg_sq"]) != set(self._exp_avg_sq):
            raise ValueError("Shampoo grafting state differs from this engine's (other grafting or parameters)")
        for name, entry in matrices.items():
            _checkpoint.load_matrix_state(self._matrices[name], entry, self.dtype, self.statistics_dtype)
        for name, saved in state["exp_avg_sq"].items():
            target = self._exp_avg_sq[name]
            if saved.shape != target.shape:
                raise ValueError(
                    f"Shampoo grafting state of {name!r} has shape {tuple(saved.shape)}, want {tuple(target.shape)}"
                )
            target.copy_(saved)
        self._step = int(state["step"])
        self._baseline = {key: sum(v) for key, v in self._read_counters().items()}
        self._warned = set()

    # ----------------------------------------------------------------- internals
    def _matrix(self, name: str) -> MatrixState:
        try:
            return self._matrices[name]
        except KeyError:
            raise KeyError(f"{name!r} is not a Shampoo matrix") from None

    def _selected(self, name: str | None) -> list[MatrixState]:
        return list(self._matrices.values()) if name is None else [self._matrix(name)]

    def _preconditions(self, st: MatrixState) -> bool:
        """Whether the matrix takes Shampoo's direction this step (committed roots of both
        factors, past start_step); else the grafting direction."""
        return committed(st) and self._step > self.settings.start_step

    def _read_counters(self) -> dict[tuple[str, Factor], tuple[int, ...]]:
        return read_counters(
            {(name, f): fs.counters for name, st in self._matrices.items() for f, fs in st.factors.items()}
        )


def _checked(factor: Factor) -> Factor:
    if factor not in FACTORS:
        raise ValueError(f"factor must be 'A' or 'B', got {factor!r}")
    return factor
