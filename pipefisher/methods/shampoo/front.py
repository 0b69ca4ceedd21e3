"""Single-process Shampoo for users and as the reference the pipeline executor is checked against.

Typical loop (Shampoo edits ``.grad``; a plain SGD takes the step)::

    shampoo = Shampoo(model, block_size=1024, grafting="adam")
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for step, (x, y) in enumerate(data):
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        if step % refresh == 0:
            shampoo.update_statistics()
            shampoo.update_roots()
        shampoo.precondition()
        optimizer.step()
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from pipefisher.methods.blocks import FACTORS, MatrixInfo
from pipefisher.methods.dtypes import dtype_name
from pipefisher.methods.settings import StatisticsDtype
from pipefisher.methods.shampoo.engine import ShampooEngine
from pipefisher.methods.shampoo.health import ShampooHealth
from pipefisher.methods.shampoo.method import Grafting, RootMethod, ShampooConfig


class Shampoo:
    """Shampoo preconditioner of every trainable parameter of ``model`` (see
    :class:`ShampooConfig` for the hyper-parameters and :class:`ShampooEngine` for the maths).

    ``skip``: globs of parameter names that only take the grafting direction. ``process_group``:
    the captured gradients are summed over it (``all_reduce``, SUM) before the statistics are
    updated (data parallelism; every rank must call :meth:`update_statistics`); None = no
    communication.
    """

    def __init__(
        self,
        model: nn.Module,
        beta2: float = 1.0,
        epsilon: float = 1e-12,
        block_size: int = 1024,
        root: RootMethod = "eigen",
        grafting: Grafting = "adam",
        graft_beta2: float = 0.999,
        graft_epsilon: float = 1e-8,
        start_step: int = 0,
        dtype: torch.dtype = torch.float32,
        statistics_dtype: torch.dtype = torch.float64,
        skip: Iterable[str] = (),
        process_group: Any = None,
    ) -> None:
        settings = ShampooConfig(
            beta2=beta2,
            epsilon=epsilon,
            block_size=block_size,
            root=root,
            grafting=grafting,
            start_step=start_step,
            statistics_dtype=cast(StatisticsDtype, dtype_name(statistics_dtype)),  # the section checks it
        )
        self.engine = ShampooEngine(
            model, settings, skip, graft_beta2=graft_beta2, graft_epsilon=graft_epsilon, dtype=dtype
        )
        self.process_group = process_group

    def matrices(self) -> list[MatrixInfo]:
        """The preconditioned matrices with their block structure."""
        return self.engine.matrices()

    def health(self) -> dict[str, ShampooHealth]:
        """Per-matrix numerics counters (one host read)."""
        return self.engine.health()

    def update_statistics(self) -> None:
        """Fold every matrix's current ``.grad`` (summed over ``process_group``) into its statistics."""
        for info in self.engine.matrices():
            self.engine.capture(info.name)
            if self.process_group is not None:
                dist.all_reduce(
                    self.engine.captured_gradient(info.name), op=dist.ReduceOp.SUM, group=self.process_group
                )
            for factor in FACTORS:
                self.engine.update_statistics(info.name, factor)
            self.engine.release(info.name)

    def update_roots(self) -> None:
        """Compute every matrix's roots from its statistics and put them in use; warn about
        numerical trouble (:meth:`ShampooEngine.check_health`, one host read)."""
        for info in self.engine.matrices():
            for factor in FACTORS:
                self.engine.compute_root(info.name, factor)
        self.engine.commit()
        self.engine.check_health()

    def precondition(self) -> None:
        """Replace every parameter's ``.grad`` by its Shampoo (or grafting) direction; call before
        ``optimizer.step()``."""
        self.engine.precondition_all()

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume (see :meth:`ShampooEngine.state_dict`)."""
        return self.engine.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output into a Shampoo over an equally shaped model."""
        self.engine.load_state_dict(state)
