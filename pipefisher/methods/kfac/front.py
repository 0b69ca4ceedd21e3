"""Single-process K-FAC for users and as the reference the pipeline executor is checked against.

Typical step::

    with kfac.capture():
        loss = loss_fn(model(x), y)
        loss.backward()
    if step % refresh == 0:
        kfac.update_curvature()
        kfac.update_inverses()
    kfac.precondition(lr)
    optimizer.step()
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from torch import Tensor, nn

from pipefisher.methods.kfac.engine import KFACEngine
from pipefisher.methods.kfac.layer import FACTORS, Health, LayerInfo
from pipefisher.methods.kfac.method import Approximation, InverseMethod, KfacConfig
from pipefisher.methods.kfac.settings import PreconditionReport


class KFAC:
    """K-FAC preconditioner for the linear layers (``nn.Linear``, ``Conv1D``) of ``model`` (see :class:`KfacConfig` and :class:`KFACEngine`).

    ``skip``: glob patterns of module names kept first-order. ``process_group``: factors are
    all-reduced over it before inversion (data parallelism); None = no communication.
    """

    def __init__(
        self,
        model: nn.Module,
        damping: float = 1e-3,
        factor_decay: float = 0.95,
        inverse: InverseMethod = "cholesky",
        approximation: Approximation = "expand",
        kl_clip: float | None = None,
        skip: Iterable[str] = (),
        max_factor_dim: int = 8192,
        grad_scale: float | None = None,
        process_group: Any = None,
    ) -> None:
        config = KfacConfig(damping=damping, factor_decay=factor_decay, inverse=inverse, approximation=approximation)
        self.engine = KFACEngine(
            model, config, skip, grad_scale=grad_scale, kl_clip=kl_clip, max_factor_dim=max_factor_dim
        )
        self.process_group = process_group
        self._next_micro_batch = 0

    def layers(self) -> list[LayerInfo]:
        """K-FAC layers with their factor sizes."""
        return self.engine.layers()

    def health(self) -> dict[str, Health]:
        """Per-layer numerics counters."""
        return self.engine.health()

    @contextmanager
    def capture(self, loss_scale: Tensor | float | None = None) -> Iterator[None]:
        """Record ``a`` and ``e`` of one forward/backward run inside the block.

        Several captures before :meth:`update_curvature` (gradient accumulation) are combined;
        the default B scaling then assumes the accumulated loss is the mean over all their rows.
        ``loss_scale``: the backward is of the loss times it (fp16 loss scaling; None: unscaled).
        """
        micro_batch = self._next_micro_batch
        self._next_micro_batch += 1
        with self.engine.capture(micro_batch, loss_scale):
            yield

    def update_curvature(self) -> None:
        """Accumulate every pending capture into the factors being built and free it."""
        for info in self.engine.layers():
            for factor in FACTORS:
                for micro_batch in self.engine.captured(info.name, factor):
                    self.engine.curvature(info.name, factor, micro_batch)

    def update_inverses(self) -> None:
        """Sync, fold into the EMA, invert and commit every factor with new curvature, then warn
        about numerical trouble (:meth:`KFACEngine.check_health`, one host read)."""
        for info in self.engine.layers():
            for factor in FACTORS:
                if self.engine.built_rows(info.name, factor):
                    self.engine.sync(info.name, factor, self.process_group)
                    self.engine.invert(info.name, factor)
            self.engine.commit(info.name)
        self.engine.check_health()

    def precondition(self, lr: float = 1.0) -> PreconditionReport:
        """Precondition every K-FAC layer's ``.grad`` in place (then KL-clip); call before
        ``optimizer.step()``. ``lr`` is only used by the KL clip."""
        return self.engine.precondition_all(lr)

    def state_dict(self) -> dict[str, Any]:
        """Factors, inverses and counters (see :meth:`KFACEngine.state_dict`)."""
        return {"layers": self.engine.state_dict(), "next_micro_batch": self._next_micro_batch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output into a KFAC over an equally shaped model."""
        self.engine.load_state_dict(state["layers"])
        self._next_micro_batch = int(state["next_micro_batch"])
