"""Per-layer K-FAC operations, callable one at a time in any dependency-respecting order.

Life of one refresh, per layer and factor ``f`` in {"A", "B"}:
``capture(mb)`` (forward/backward) -> ``curvature(layer, f, mb)`` for every micro-batch -> the
replicas sum ``sync_tensors(layer, f)`` (``sync`` does it blocking) -> ``invert(layer, f)`` ->
(the inverse goes from the replica that computed it, ``shared_inverse``, to the others,
``inverse_buffer`` + ``receive_inverse``) -> ``commit(layer)``; ``precondition_all`` uses the
committed inverses every step (the executor and :class:`pipefisher.methods.kfac.KFAC` alike).

Host reads: none of these calls reads a tensor value on the host (on a GPU each read would stall
the queue), whatever the number of layers. Numerical trouble becomes 0-dim device bools, states
are updated by device-side selection (:func:`prefer_ok`) and health counters are incremented on
the device. Only inspection reads: ``check_health`` (one read for the whole engine), ``health``,
``factor``, ``inverse``, ``skipped_inversions``. The exception is the error check inside
``torch.linalg.eigh`` on CUDA (see :func:`damped_inverse`).

Scaling (why B does not depend on micro-batch count or size):
- ``A = (1/R) Σ_r a_r a_rᵀ`` over the R rows (tokens) of the step, with a trailing 1 in ``a_r`` when the layer
  has a bias.
- The captured ``e_r`` is the gradient of the step loss w.r.t. the layer output row r. If the step loss is the
  mean of per-row losses over all R rows (each of M micro-batch losses is its mean scaled by ``R_m / R``, i.e.
  ``1/M`` for equal micro-batches), the per-row loss gradient is ``λ e_r`` with ``λ = R``. Then ``B = (1/R)
  Σ_r (λ e_r)(λ e_r)ᵀ``: the mean over rows of per-example gradient outer products. ``λ`` defaults to this
  replica's row count of the factor (taken before the replica sum; ``share_rows`` needs it set); set the
  engine's ``grad_scale`` for other loss scalings (e.g. ``1`` for a summed loss). Under fp16 loss scaling pass
  the scale to ``capture``: the ``e`` rows are divided by it before their outer products. With
  ``approximation: reduce`` a row is a sequence (`pipefisher.methods.kfac.factors`).
"""

from __future__ import annotations

import warnings
from collections.abc import Hashable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from pipefisher.methods.counters import read_counters
from pipefisher.methods import capture as _capture
from pipefisher.methods.kfac import checkpoint as _checkpoint
from pipefisher.methods.kfac import health as _health
from pipefisher.methods.kfac.factors import accumulate_covariance, condensed_record, curvature_rows, damped_inverse
from pipefisher.methods.kfac.factors import damping_too_small, fold_ema, kl_clip_scale
from pipefisher.methods.kfac.method import KfacConfig
from pipefisher.methods.kfac.settings import KFACNumericsWarning, PreconditionReport, check_engine_settings
from pipefisher.methods.kfac.layer import FACTORS, BuiltFactor, Factor, Flagged, Health, LayerInfo, LayerState
from pipefisher.methods.kfac.layer import known_factor, prefer_ok, select_layers, valid
from pipefisher.methods.kfac.step import precondition_layers
from pipefisher.runtime.primitives.sharding import local


class KFACEngine:
    """K-FAC state of the selected linear layers (``nn.Linear``, ``Conv1D``) of ``model`` and the operations on it:
    the run-file section ``config`` with ``grad_scale``, ``kl_clip`` (`check_engine_settings`) and
    ``max_factor_dim`` (larger layers stay first-order)."""

    def __init__(
        self,
        model: nn.Module,
        config: KfacConfig | None = None,
        skip: Iterable[str] = (),
        *,
        grad_scale: float | None = None,
        kl_clip: float | None = None,
        max_factor_dim: int = 8192,
    ) -> None:
        self.config = check_engine_settings(config or KfacConfig(), grad_scale, kl_clip)
        self.grad_scale, self.kl_clip = grad_scale, kl_clip
        self._layers = select_layers(model, skip, max_factor_dim)
        self._anchor = next(model.parameters(), None)  # where engine-wide tensors live
        self._reported: dict[tuple[str, Factor], tuple[int, ...]] = {}

    # ----------------------------------------------------------------- inspection (host reads)
    def layers(self) -> list[LayerInfo]:
        """K-FAC layers in module order with their factor sizes (for the planner)."""
        return [st.info for st in self._layers.values()]

    def health(self) -> dict[str, Health]:
        """Per-layer numerics counters as host values (one host read for all layers)."""
        values = self._read_counters()
        return {name: _health.total(values[name, f] for f in FACTORS if (name, f) in values) for name in self._layers}

    def check_health(self) -> None:
        """Warn once per layer, factor and counter that rose since the previous check (one host
        read for the whole engine); :meth:`health` has the counts."""
        values = self._read_counters()
        cfg = self.config
        for (name, factor), now in values.items():
            before = self._reported.get((name, factor), (0,) * len(now))
            for counter, n, b in zip(_health.COUNTERS, now, before):
                if n > b:
                    text = _health.message(counter, factor, cfg.inverse, cfg.damping, self._layers[name].dtype)
                    warnings.warn(f"K-FAC layer {name!r}: {text}", KFACNumericsWarning, stacklevel=2)
        self._reported = values

    @property
    def skipped_inversions(self) -> int:
        """Total inversions that kept a previous inverse, over all layers (one host read)."""
        return sum(h.skipped for h in self.health().values())

    def captured(self, layer: str, factor: Factor) -> list[Hashable]:
        """Micro-batch ids with a capture of ``factor``'s input waiting for curvature."""
        return list(self.layer_state(layer).captures[factor])

    def captured_bytes(self, layer: str, factor: Factor, micro_batch: Hashable) -> int:
        """Bytes of the tensors held for ``micro_batch``'s capture of ``factor`` (as stored: A
        without a bias column; 0 when none); layers fed one input each count the tensor they share."""
        tensors = self.layer_state(layer).captures[known_factor(factor)].get(micro_batch, [])
        return sum(map(_capture.held_bytes, tensors))

    def built_rows(self, layer: str, factor: Factor) -> int:
        """This replica's rows accumulated into the factor being built (0 when none)."""
        return getattr(self.layer_state(layer).built.get(factor), "rows", 0)

    def factor(self, layer: str, factor: Factor) -> Tensor | None:
        """The running (EMA) factor, or None before its first finite one (reads a flag)."""
        return valid(self.layer_state(layer).ema.get(factor))

    def inverse(self, layer: str, factor: Factor) -> Tensor | None:
        """The committed damped inverse used by precondition, or None (identity; reads a flag)."""
        return valid(self.layer_state(layer).active.get(factor))

    # ----------------------------------------------------------------- operations (no host reads)
    @contextmanager
    def capture(self, micro_batch: Hashable = 0, loss_scale: Tensor | float | None = None) -> Iterator[None]:
        """Record ``a`` and ``e`` of every K-FAC layer for forwards run inside the block (with
        ``reduce``: their means per sequence, `condensed_record`). ``loss_scale``: the backward
        is of the loss times it (fp16 loss scaling); a number or a 0-dim tensor, copied on the
        device so a later in-place update (``GradScaler.update``) does not change it.
        ``curvature`` divides the ``e`` rows by it."""
        scale = loss_scale.detach().clone() if isinstance(loss_scale, Tensor) else loss_scale
        condense = condensed_record if self.config.approximation == "reduce" else None
        with _capture.capture(self._layers, micro_batch, scale, condense=condense):
            yield

    def curvature(self, layer: str, factor: Factor, micro_batch: Hashable) -> None:
        """Accumulate ``xᵀx`` of one micro-batch's capture into the built factor and free it
        (``e`` rows divided by the micro-batch's loss scale, in the factor dtype)."""
        st = self.layer_state(layer)
        tensors = st.captures[known_factor(factor)].pop(micro_batch, None)
        if tensors is None:
            raise KeyError(f"layer {layer!r}: nothing captured for {factor}, micro-batch {micro_batch!r}")
        scale = st.loss_scales.pop(micro_batch, None) if factor == "B" else None
        built = st.built.get(factor)
        if built is None:
            size = st.info.size(factor)
            built = st.built[factor] = BuiltFactor(torch.zeros(size, size, dtype=st.dtype, device=st.weight.device))
        if built.sealed:
            raise RuntimeError(f"layer {layer!r}: factor {factor} was synced; invert it first")
        ones = factor == "A" and st.info.has_bias
        index, count = st.row_shares.get(factor, (0, 1))
        for t in tensors:
            rows, tokens = curvature_rows(t, factor, self.config.approximation, built.total.dtype)
            rows = rows.tensor_split(count)[index]
            if scale is not None:
                rows = rows.to(built.total.dtype) / scale
            accumulate_covariance(built.total, rows, ones)
            built.rows += rows.shape[0] * tokens

    def share_rows(self, layer: str, factor: Factor, index: int, count: int) -> None:
        """Build ``factor`` from share ``index`` of ``count`` of each capture's rows (the sharers sum :meth:`sync_tensors`)."""
        if factor == "B" and self.grad_scale is None:  # λ would be this share's row count
            raise ValueError("grad_scale: B's scale is the whole step's row count; set it to share B's rows")
        self.layer_state(layer).row_shares[known_factor(factor)] = (index, count)

    def release(self, layer: str, micro_batch: Hashable | None = None) -> None:
        """Drop captures of ``layer`` (one micro-batch, or all) without taking curvature."""
        st = self.layer_state(layer)
        stores: list[dict[Hashable, Any]] = [*st.captures.values(), st.loss_scales]
        for store in stores:
            if micro_batch is None:
                store.clear()
            else:
                store.pop(micro_batch, None)

    def sync_tensors(self, layer: str, factor: Factor) -> tuple[Tensor, Tensor]:
        """Seal the built factor and return the device tensors the caller sums in place over the
        replicas before ``invert``: the (n, n) total and its float64 (1,) row count.

        Sum them once per refresh, every replica in the same order (e.g. async all-reduces,
        waited for before ``invert``). No curvature for this factor after.
        """
        built = self._built(layer, factor)
        return built.total, self._seal(built, factor)

    def sync(self, layer: str, factor: Factor, group: Any = None) -> None:
        """Blocking all-reduce (sum) of :meth:`sync_tensors` over ``group``; no-op for None.

        Pass ``torch.distributed.group.WORLD`` for all ranks. Every rank of ``group`` must call it.
        """
        if group is not None:
            for tensor in self.sync_tensors(layer, factor):
                dist.all_reduce(tensor, group=group)

    def invert(self, layer: str, factor: Factor, decompose: bool = True) -> None:
        """Finalise the built factor (mean over the synced rows, EMA) and compute its damped
        inverse into ``pending``, all on the device.

        A non-finite fresh factor leaves the EMA and pending inverse unchanged; a failed or
        non-finite inverse leaves the pending one unchanged (so commit keeps the previous). With
        ``decompose=False`` only the moving average is updated (a replica whose inverse is
        computed elsewhere and shared keeps the same running factor). Counted on the device;
        :meth:`check_health` warns.
        """
        st = self.layer_state(layer)
        built = self._built(layer, factor)
        del st.built[factor]
        count = self._seal(built, factor)
        fresh = built.total / count.to(built.total.dtype).clamp(min=1)
        del built  # the built factor and the fresh one are freed before the decomposition's copies
        finite = torch.isfinite(fresh).all()
        ema = self._fold(st, factor, fresh, finite)
        del fresh
        counters = st.counters.setdefault(factor, _health.zero_counters(ema.device))
        if not decompose:
            _health.count(counters, nonfinite_factor=~finite)
            return
        cfg = self.config
        inverse, ok = damped_inverse(ema, cfg.damping, cfg.inverse)
        too_small = damping_too_small(ema, cfg.damping)
        _health.count(
            counters, nonfinite_factor=~finite, failed_inverse=finite & ~ok, damping_too_small=finite & too_small
        )
        st.pending[factor] = prefer_ok(Flagged(inverse, finite & ok), st.pending.get(factor))

    @contextmanager
    def built_kept(self, layer: str, factor: Factor) -> Iterator[None]:
        """The factor being built, put back as it was after the block (a copy, sealed or not):
        the profiler times `invert`, which consumes it, more than once on the run's own rows."""
        built = self._built(layer, factor)
        saved = BuiltFactor(
            built.total.clone(), built.rows, built.sealed, None if built.count is None else built.count.clone()
        )
        try:
            yield
        finally:
            self.layer_state(layer).built[factor] = saved

    def shared_inverse(self, layer: str, factor: Factor) -> Tensor:
        """On the replica that inverted ``factor``: the (n, n) tensor to broadcast to the others,
        i.e. the inverse its commit would use (the pending one if that inversion succeeded,
        else the one in use, else the identity); selected on the device."""
        st = self.layer_state(layer)
        return self._next_active(st, known_factor(factor)).value.contiguous()

    def inverse_buffer(self, layer: str, factor: Factor) -> Tensor:
        """On the other replicas: an empty (n, n) tensor of the factor dtype and device to
        receive the broadcast of :meth:`shared_inverse` into."""
        st = self.layer_state(layer)
        n = st.info.size(known_factor(factor))
        return torch.empty(n, n, dtype=st.dtype, device=st.weight.device)

    def fresh_inverse(self, layer: str, factor: Factor) -> Tensor:
        """On a replica that inverted ``factor`` without keeping inverses in use: its pending
        inverse where that inversion succeeded, else NaN (a receiver that checks keeps its own)."""
        st = self.layer_state(layer)
        pending = st.pending.get(known_factor(factor))
        if pending is None:
            n = st.info.size(factor)
            return torch.full((n, n), float("nan"), dtype=st.dtype, device=st.weight.device)
        return torch.where(pending.ok, pending.value, torch.full_like(pending.value, float("nan"))).contiguous()

    def receive_inverse(self, layer: str, factor: Factor, tensor: Tensor, checked: bool = False) -> None:
        """Store a received inverse (after the broadcast completed) as ``factor``'s pending
        inverse, marked successful (`checked`: successful where it is finite, see
        :meth:`fresh_inverse`)."""
        st = self.layer_state(layer)
        ok = torch.isfinite(tensor).all() if checked else torch.ones((), dtype=torch.bool, device=tensor.device)
        st.pending[known_factor(factor)] = Flagged(tensor, ok)

    def discard_inverse(self, layer: str, factor: Factor) -> None:
        """Forget ``factor``'s pending inverse (a replica that computed it for others only)."""
        self.layer_state(layer).pending.pop(known_factor(factor), None)

    def gradients(self, layer: str) -> list[Tensor]:
        """The layer's weight and bias gradients (those that exist), in that order."""
        return [p.grad for p in self.layer_state(layer).module.parameters(recurse=False) if p.grad is not None]

    def commit(self, layer: str) -> None:
        """Make the inverses computed since the last commit the ones precondition uses, where
        their inversion succeeded (selected on the device)."""
        st = self.layer_state(layer)
        for factor in list(st.pending):
            st.active[factor] = self._next_active(st, factor)
        st.pending.clear()

    def precondition(self, layer: str) -> Tensor | None:
        """Replace the layer's weight (and bias) gradient G by ``B⁻¹ G A⁻¹`` with the committed
        inverses (an inverse never committed successfully is skipped: G unchanged bit for bit).

        Returns ``⟨G̃, G⟩`` as a 0-dim device tensor in the factor dtype when ``kl_clip`` is
        configured; None otherwise or when the layer has no gradient.
        """
        (vg,) = precondition_layers([self.layer_state(layer)], self.kl_clip is not None)
        return vg

    def rescale(self, layer: str, scale: Tensor | float) -> None:
        """Multiply the layer's weight and bias gradients by ``scale`` (a number or 0-dim tensor,
        the same on every replica): a sharded gradient's local shard (no communication)."""
        for p in self.layer_state(layer).module.parameters(recurse=False):
            if p.grad is not None:
                local(p.grad).mul_(scale)

    def precondition_all(
        self, lr: float = 1.0, layers: Iterable[str] | None = None, group: Any = None
    ) -> PreconditionReport:
        """Precondition ``layers`` (default all; same-shape layers stacked, one batched product
        each, `pipefisher.methods.kfac.step`), then KL-clip them together if configured. Under
        ZeRO-2/3 it reads each layer's reduced gradient whole (an all-gather over the replicas it
        is sharded over, every one calling it on the same layers) and keeps this rank's shard of
        the result; ``Σ⟨G̃, G⟩`` is then over whole gradients, the same on every such replica.

        ``group`` (with ``kl_clip`` only): all-reduce ``Σ⟨G̃, G⟩`` over it first (e.g. over
        pipeline stages) so every rank clips by the same factor; the tensor lives on the
        parameters' device.
        """
        names = list(self._layers) if layers is None else list(layers)
        found = precondition_layers([self.layer_state(name) for name in names], self.kl_clip is not None)
        vgs = [vg for vg in found if vg is not None]
        if self.kl_clip is None:
            return PreconditionReport(None, None)
        device = self._anchor.device if self._anchor is not None else torch.device("cpu")
        vg_sum = torch.zeros((), dtype=torch.float64, device=device)
        if vgs:
            vg_sum = torch.stack([vg.to(device, torch.float64) for vg in vgs]).sum()
        if group is not None:
            dist.all_reduce(vg_sum, group=group)
        scale = kl_clip_scale(vg_sum, self.kl_clip, lr)
        for name in names:
            self.rescale(name, scale)
        return PreconditionReport(vg_sum, scale)

    # ----------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict[str, Any]:
        """Per layer: running factors, built factors, pending and committed inverses (with their
        validity flags), captures still waiting for curvature (with loss scales), health counters."""
        return {name: _checkpoint.layer_state(st) for name, st in self._layers.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output; layer names and factor sizes must match. Counts
        restored are not warned about again by :meth:`check_health`."""
        if set(state) != set(self._layers):
            raise ValueError(f"K-FAC layers differ: checkpoint {sorted(state)} vs model {sorted(self._layers)}")
        for name, entry in state.items():
            _checkpoint.load_layer_state(self.layer_state(name), entry)
        self._reported = self._read_counters()

    # ----------------------------------------------------------------- internals
    def layer_state(self, layer: str) -> LayerState:
        """Everything the engine keeps for `layer` (KeyError naming a layer it does not have)."""
        try:
            return self._layers[layer]
        except KeyError:
            raise KeyError(f"{layer!r} is not a K-FAC layer") from None

    def _built(self, layer: str, factor: Factor) -> BuiltFactor:
        built = self.layer_state(layer).built.get(known_factor(factor))
        if built is None:
            raise RuntimeError(f"layer {layer!r}: no curvature accumulated for factor {factor}")
        return built

    def _seal(self, built: BuiltFactor, factor: Factor) -> Tensor:
        """Apply the B scaling ``λ²`` (λ = grad_scale or the local row count) exactly once and
        put the local row count on the device; returns that count."""
        if not built.sealed:
            if factor == "B":
                lam = self.grad_scale if self.grad_scale is not None else built.rows
                built.total.mul_(float(lam) ** 2)
            built.count = torch.full((1,), float(built.rows), dtype=torch.float64, device=built.total.device)
            built.sealed = True
        if built.count is None:
            raise ValueError(f"factor {factor}: sealed without its row count")
        return built.count

    def _fold(self, st: LayerState, factor: Factor, fresh: Tensor, finite: Tensor) -> Tensor:
        """Fold ``fresh`` into the running factor where it is finite (the first finite one is
        taken as is) and return the running factor (zeros before the first finite one)."""
        old = st.ema.get(factor)
        if old is None:
            old = Flagged(torch.zeros_like(fresh), torch.zeros_like(finite))
        folded = torch.where(old.ok, fold_ema(old.value, fresh, self.config.factor_decay), fresh)
        st.ema[factor] = prefer_ok(Flagged(folded, finite), old)
        return st.ema[factor].value

    def _next_active(self, st: LayerState, factor: Factor) -> Flagged:
        """What ``commit`` makes the active inverse: the pending one where it is ok, else the
        active one, else the identity (marked not ok, so precondition skips it)."""
        old = st.active.get(factor)
        if old is None:
            n = st.info.size(factor)
            eye = torch.eye(n, dtype=st.dtype, device=st.weight.device)
            old = Flagged(eye, torch.zeros((), dtype=torch.bool, device=eye.device))
        pending = st.pending.get(factor)
        return old if pending is None else prefer_ok(pending, old)

    def _read_counters(self) -> dict[tuple[str, Factor], tuple[int, ...]]:
        return read_counters({(name, f): c for name, st in self._layers.items() for f, c in st.counters.items()})
