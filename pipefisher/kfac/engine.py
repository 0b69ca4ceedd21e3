"""Per-layer K-FAC operations, callable one at a time in any dependency-respecting order.

Life of one refresh, per layer and factor ``f`` in {"A", "B"}:
``capture(mb)`` (forward/backward) -> ``curvature(layer, f, mb)`` for every micro-batch ->
``sync(layer, f, group)`` -> ``invert(layer, f)`` -> ``commit(layer)``; ``precondition`` uses the
committed inverses every step. The pipeline executor and :class:`pipefisher.kfac.KFAC` both
drive exactly these calls.

Scaling (why B does not depend on micro-batch count or size):
- ``A = (1/R) Σ_r a_r a_rᵀ`` over the R rows (tokens) of the step, with a trailing 1 in ``a_r``
  when the layer has a bias.
- The captured ``e_r`` is the gradient of the step loss w.r.t. the layer output row r. If the step
  loss is the mean of per-row losses over all R rows (each of M micro-batch losses is its mean
  scaled by ``R_m / R``, i.e. ``1/M`` for equal micro-batches), the per-row loss gradient is
  ``λ e_r`` with ``λ = R``. Then ``B = (1/R) Σ_r (λ e_r)(λ e_r)ᵀ``: the mean over rows of
  per-example gradient outer products. ``λ`` defaults to this replica's row count of the
  factor (taken before ``sync``); set ``KFACConfig.grad_scale`` for other loss scalings
  (e.g. ``1`` for a summed loss, or ``R / loss_scale`` under a static AMP loss scale).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Hashable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from pipefisher.kfac import capture as _capture
from pipefisher.kfac.factors import (
    INVERSE_METHODS,
    InverseMethod,
    InversionError,
    accumulate_covariance,
    damped_inverse,
    damping_too_small,
    fold_ema,
    kl_clip_scale,
    precondition_matrix,
)
from pipefisher.kfac.layer import (
    FACTORS,
    BuiltFactor,
    Factor,
    Health,
    LayerInfo,
    LayerState,
    select_layers,
)


class KFACNumericsWarning(RuntimeWarning):
    """A layer skipped an inversion or has damping lost to float rounding."""


@dataclass(frozen=True)
class KFACConfig:
    """K-FAC hyper-parameters.

    ``damping`` λ > 0: curvature ``(A + √λ I) ⊗ (B + √λ I)``. ``factor_decay`` in [0, 1): EMA
    weight of the old factor (0 = fresh factor only). ``kl_clip``: bound on ``lr² Σ⟨G̃, G⟩`` or
    None. ``grad_scale``: λ in the B scaling (None = row count). ``max_factor_dim``: larger
    layers stay first-order.
    """

    damping: float = 1e-3
    factor_decay: float = 0.95
    inverse: InverseMethod = "eigen"
    kl_clip: float | None = None
    grad_scale: float | None = None
    max_factor_dim: int = 8192

    def __post_init__(self) -> None:
        if not (self.damping > 0.0 and math.isfinite(self.damping)):
            raise ValueError(f"damping must be a finite positive number, got {self.damping}")
        if math.sqrt(self.damping) < torch.finfo(torch.float32).tiny:
            raise ValueError(f"damping {self.damping:g} underflows in float32")
        if not 0.0 <= self.factor_decay < 1.0:
            raise ValueError(f"factor_decay must be in [0, 1), got {self.factor_decay}")
        if self.inverse not in INVERSE_METHODS:
            raise ValueError(f"inverse must be one of {INVERSE_METHODS}, got {self.inverse!r}")
        if self.kl_clip is not None and not self.kl_clip > 0.0:
            raise ValueError(f"kl_clip must be positive or None, got {self.kl_clip}")
        if self.grad_scale is not None and not self.grad_scale > 0.0:
            raise ValueError(f"grad_scale must be positive or None, got {self.grad_scale}")


@dataclass
class PendingWork:
    """Asynchronous collectives in flight; ``wait()`` blocks until done and applies the result."""

    works: list
    on_done: Callable[[], None]

    def wait(self) -> None:
        for work in self.works:
            work.wait()
        self.works = []
        self.on_done()


@dataclass(frozen=True)
class PreconditionReport:
    """Outcome of one whole-model precondition: ``vg_sum = Σ⟨G̃, G⟩`` before clipping and the
    factor (≤ 1) all preconditioned gradients were multiplied by."""

    vg_sum: float
    clip_scale: float


class KFACEngine:
    """K-FAC state of the selected ``nn.Linear`` layers of ``model`` and the operations on it."""

    def __init__(
        self, model: nn.Module, config: KFACConfig | None = None, skip: Iterable[str] = ()
    ) -> None:
        self.config = config or KFACConfig()
        self._layers = select_layers(model, skip, self.config.max_factor_dim)

    # ----------------------------------------------------------------- inspection
    def layers(self) -> list[LayerInfo]:
        """K-FAC layers in module order with their factor sizes (for the planner)."""
        return [st.info for st in self._layers.values()]

    def health(self) -> dict[str, Health]:
        """Per-layer numerics counters (live objects)."""
        return {name: st.health for name, st in self._layers.items()}

    @property
    def skipped_inversions(self) -> int:
        """Total inversions that kept a previous inverse, over all layers."""
        return sum(st.health.skipped for st in self._layers.values())

    def captured(self, layer: str, factor: Factor) -> list[Hashable]:
        """Micro-batch ids with a capture of ``factor``'s input waiting for curvature."""
        return list(self._state(layer).captures[factor])

    def built_rows(self, layer: str, factor: Factor) -> int:
        """Rows accumulated into the factor being built (0 when none)."""
        built = self._state(layer).built.get(factor)
        return 0 if built is None else built.rows

    def factor(self, layer: str, factor: Factor) -> Tensor | None:
        """The running (EMA) factor, or None before its first inversion."""
        return self._state(layer).ema.get(factor)

    def inverse(self, layer: str, factor: Factor) -> Tensor | None:
        """The committed damped inverse used by precondition, or None (identity)."""
        return self._state(layer).active.get(factor)

    # ----------------------------------------------------------------- operations
    @contextmanager
    def capture(self, micro_batch: Hashable = 0) -> Iterator[None]:
        """Record ``a`` and ``e`` of every K-FAC layer for forwards run inside the block."""
        with _capture.capture(self._layers, micro_batch):
            yield

    def curvature(self, layer: str, factor: Factor, micro_batch: Hashable) -> None:
        """Accumulate ``xᵀx`` of one micro-batch's capture into the built factor and free it."""
        st = self._state(layer)
        tensors = st.captures[_checked(factor)].pop(micro_batch, None)
        if tensors is None:
            raise KeyError(f"layer {layer!r}: nothing captured for {factor}, micro-batch {micro_batch!r}")
        built = st.built.get(factor)
        if built is None:
            size = st.info.size(factor)
            built = st.built[factor] = BuiltFactor(
                torch.zeros(size, size, dtype=st.dtype, device=st.module.weight.device)
            )
        if built.sealed:
            raise RuntimeError(f"layer {layer!r}: factor {factor} was synced; invert it first")
        ones = factor == "A" and st.info.has_bias
        for t in tensors:
            rows = t.reshape(-1, t.shape[-1])
            accumulate_covariance(built.total, rows, ones)
            built.rows += rows.shape[0]

    def release(self, layer: str, micro_batch: Hashable | None = None) -> None:
        """Drop captures of ``layer`` (one micro-batch, or all) without taking curvature."""
        for store in self._state(layer).captures.values():
            if micro_batch is None:
                store.clear()
            else:
                store.pop(micro_batch, None)

    def sync(self, layer: str, factor: Factor, group: Any = None) -> None:
        """All-reduce (sum) the built factor and its row count over ``group``; no-op for None.

        Pass ``torch.distributed.group.WORLD`` for all ranks. Every rank of ``group`` must call it.
        """
        if group is not None:
            self.start_sync(layer, factor, group).wait()

    def start_sync(self, layer: str, factor: Factor, group: Any) -> "PendingWork":
        """Launch the all-reduce of :meth:`sync` asynchronously; ``wait()`` before inverting.

        Every rank of ``group`` must launch the group's syncs in the same order.
        """
        built = self._built(layer, factor)
        self._seal(built, factor)
        rows = torch.tensor([built.rows], dtype=torch.int64, device=built.total.device)
        works = [dist.all_reduce(built.total, group=group, async_op=True), dist.all_reduce(rows, group=group, async_op=True)]

        def done() -> None:
            built.rows = int(rows.item())

        return PendingWork(works, done)

    def start_share_inverse(self, layer: str, factor: Factor, source: int, group: Any) -> "PendingWork":
        """Broadcast the new inverse of ``factor`` from global rank ``source`` (the replica that
        computed it) to the other ranks of ``group``, into their pending slot; asynchronous.

        The source sends its pending inverse (or, if that inversion was skipped, the one in use,
        or the identity before the first).
        """
        st = self._state(layer)
        n = st.info.size(_checked(factor))
        if dist.get_rank() == source:
            tensor = st.pending.get(factor)
            if tensor is None:
                tensor = st.active.get(factor, torch.eye(n, dtype=st.dtype, device=st.module.weight.device))
            return PendingWork([dist.broadcast(tensor.contiguous(), source, group=group, async_op=True)], lambda: None)
        buffer = torch.empty(n, n, dtype=st.dtype, device=st.module.weight.device)

        def store() -> None:
            st.pending[factor] = buffer

        return PendingWork([dist.broadcast(buffer, source, group=group, async_op=True)], store)

    def invert(self, layer: str, factor: Factor, decompose: bool = True) -> bool:
        """Finalise the built factor (mean, EMA) and compute its damped inverse into ``pending``.

        With ``decompose=False`` only the moving average is updated (a replica whose inverse is
        computed elsewhere and shared keeps the same running factor). Returns False, warns and
        counts (keeping the previous inverse) when the fresh factor is not finite or the
        decomposition fails. Warns when damping is lost to rounding.
        """
        st = self._state(layer)
        built = self._built(layer, factor)
        del st.built[factor]
        self._seal(built, factor)
        fresh = built.total / max(built.rows, 1)
        if not torch.isfinite(fresh).all():
            st.health.nonfinite_factor += 1
            self._warn(layer, f"non-finite {factor} factor; keeping the previous inverse")
            return False
        cfg = self.config
        st.ema[factor] = fold_ema(st.ema.get(factor), fresh, cfg.factor_decay)
        if not decompose:
            return True
        if damping_too_small(st.ema[factor], cfg.damping):
            st.health.damping_too_small += 1
            self._warn(layer, f"damping {cfg.damping:g} is below {st.ema[factor].dtype} "
                       f"resolution for factor {factor}")
        try:
            st.pending[factor] = damped_inverse(st.ema[factor], cfg.damping, cfg.inverse)
        except InversionError as exc:
            st.health.failed_inverse += 1
            self._warn(layer, f"{cfg.inverse} inverse of {factor} failed ({exc}); "
                       "keeping the previous inverse")
            return False
        return True

    def commit(self, layer: str) -> None:
        """Make the inverses computed since the last commit the ones precondition uses."""
        st = self._state(layer)
        st.active.update(st.pending)
        st.pending.clear()

    def precondition(self, layer: str) -> float:
        """Replace the layer's weight (and bias) gradient G by ``B⁻¹ G A⁻¹`` with the committed
        inverses; returns ``⟨G̃, G⟩`` (0 when the layer has no gradient)."""
        st = self._state(layer)
        weight, bias = st.module.weight, st.module.bias
        if weight.grad is None:
            return 0.0
        grad = weight.grad
        if bias is not None:  # a frozen bias contributes a zero column
            column = bias.grad if bias.grad is not None else torch.zeros_like(bias)
            grad = torch.cat([grad, column[:, None]], 1)
        new = precondition_matrix(grad, st.active.get("A"), st.active.get("B"))
        vg = float((new * grad.to(new.dtype)).sum())
        din = st.info.in_features
        weight.grad.copy_(new[:, :din])
        if bias is not None and bias.grad is not None:
            bias.grad.copy_(new[:, din])
        return vg

    def rescale(self, layer: str, scale: float) -> None:
        """Multiply the layer's weight and bias gradients by ``scale``."""
        for p in self._state(layer).module.parameters(recurse=False):
            if p.grad is not None:
                p.grad.mul_(scale)

    def precondition_all(
        self, lr: float = 1.0, layers: Iterable[str] | None = None, group: Any = None
    ) -> PreconditionReport:
        """Precondition ``layers`` (default all), then KL-clip them together if configured.

        ``group``: sum ``⟨G̃, G⟩`` over it first (e.g. over pipeline stages) so every rank clips
        by the same factor.
        """
        names = list(self._layers) if layers is None else list(layers)
        vg_sum = sum(self.precondition(name) for name in names)
        if group is not None:
            total = torch.tensor([vg_sum], dtype=torch.float64)
            dist.all_reduce(total, group=group)
            vg_sum = float(total.item())
        scale = 1.0
        if self.config.kl_clip is not None:
            scale = kl_clip_scale(vg_sum, self.config.kl_clip, lr)
            if scale < 1.0:
                for name in names:
                    self.rescale(name, scale)
        return PreconditionReport(vg_sum, scale)

    # ----------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict[str, Any]:
        """Running factors, built factors, pending and committed inverses, captures still waiting
        for their curvature, and health, per layer."""
        return {
            name: {
                "ema": dict(st.ema),
                "pending": dict(st.pending),
                "active": dict(st.active),
                "built": {f: asdict(b) for f, b in st.built.items()},
                "captures": {f: {mb: list(ts) for mb, ts in store.items()} for f, store in st.captures.items()},
                "health": asdict(st.health),
            }
            for name, st in self._layers.items()
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output; layer names and factor sizes must match."""
        if set(state) != set(self._layers):
            raise ValueError(
                f"K-FAC layers differ: checkpoint {sorted(state)} vs model {sorted(self._layers)}"
            )
        for name, entry in state.items():
            st = self._state(name)
            device = st.module.weight.device

            def load(t: Tensor, factor: Factor) -> Tensor:
                n = st.info.size(factor)
                if tuple(t.shape) != (n, n):
                    raise ValueError(f"layer {name!r}: {factor} has shape {tuple(t.shape)}, want {(n, n)}")
                return t.to(device=device, dtype=st.dtype).clone()

            st.ema = {f: load(t, f) for f, t in entry["ema"].items()}
            st.pending = {f: load(t, f) for f, t in entry["pending"].items()}
            st.active = {f: load(t, f) for f, t in entry["active"].items()}
            st.built = {
                f: BuiltFactor(load(b["total"], f), int(b["rows"]), bool(b["sealed"]))
                for f, b in entry["built"].items()
            }
            st.health = Health(**entry["health"])
            st.captures = {f: {mb: [t.to(device) for t in ts] for mb, ts in store.items()} for f, store in entry.get("captures", {"A": {}, "B": {}}).items()}

    # ----------------------------------------------------------------- internals
    def _state(self, layer: str) -> LayerState:
        try:
            return self._layers[layer]
        except KeyError:
            raise KeyError(f"{layer!r} is not a K-FAC layer") from None

    def _built(self, layer: str, factor: Factor) -> BuiltFactor:
        built = self._state(layer).built.get(_checked(factor))
        if built is None:
            raise RuntimeError(f"layer {layer!r}: no curvature accumulated for factor {factor}")
        return built

    def _seal(self, built: BuiltFactor, factor: Factor) -> None:
        """Apply the B scaling ``λ²`` (λ = grad_scale or the local row count) exactly once."""
        if built.sealed:
            return
        if factor == "B":
            lam = self.config.grad_scale if self.config.grad_scale is not None else built.rows
            built.total.mul_(float(lam) ** 2)
        built.sealed = True

    @staticmethod
    def _warn(layer: str, message: str) -> None:
        warnings.warn(f"K-FAC layer {layer!r}: {message}", KFACNumericsWarning, stacklevel=3)


def _checked(factor: Factor) -> Factor:
    if factor not in FACTORS:
        raise ValueError(f"factor must be 'A' or 'B', got {factor!r}")
    return factor
