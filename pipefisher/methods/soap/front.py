"""Single-process SOAP for users, and the step that applies SOAP's direction.

Typical loop (SOAP steps the matrices; give the other parameters a first-order rule, e.g. AdamW)::

    soap = SOAP(model, lr=3e-3, weight_decay=0.01, precondition_frequency=10)
    others = torch.optim.AdamW(soap.others(model), lr=3e-3)
    for x, y in data:
        soap.zero_grad(); others.zero_grad()
        loss_fn(model(x), y).backward()
        soap.step(); others.step()
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, cast

import torch
from torch import nn

from pipefisher.methods.blocks import FACTORS, MatrixInfo
from pipefisher.methods.dtypes import dtype_name
from pipefisher.methods.settings import StatisticsDtype
from pipefisher.methods.soap.engine import SoapEngine
from pipefisher.methods.soap.health import SoapHealth
from pipefisher.methods.soap.method import SoapConfig
from pipefisher.optim.decoupled import DecoupledStep


class SoapStep(DecoupledStep):
    """The step after SOAP's direction (in ``.grad``): ``p <- (p - lr · d)(1 - lr · weight_decay)``,
    pytorch_optimizer's order. A parameter's first step is skipped, weight decay included: SOAP's
    first call on a matrix takes its eigenbases and gives no direction (`SoapEngine.precondition_all`;
    both run on the same steps). Its state per parameter is that count of steps."""

    def __init__(self, params: Iterable[Any], lr: float = 3e-3, weight_decay: float = 0.0) -> None:
        super().__init__(params, lr, weight_decay, decay_first=False, skip_first=True)


class SOAP:
    """SOAP of every matrix of ``model`` (see :class:`SoapEngine` for the maths and the choice of
    matrices; ``skip``: globs of names left out), refreshed as `pytorch_optimizer.SOAP` does: the
    first step takes the first eigenbases and no step, then after every ``precondition_frequency``
    -th step one power-iteration step from the statistics of that step."""

    def __init__(
        self,
        model: nn.Module,
        lr: float = 3e-3,
        betas: tuple[float, float] = (0.95, 0.95),
        statistics_beta: float | None = None,
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        precondition_frequency: int = 10,
        block_size: int = 1024,
        skip: Iterable[str] = (),
        dtype: torch.dtype = torch.float32,
        statistics_dtype: torch.dtype = torch.float64,
    ) -> None:
        if precondition_frequency < 1:
            raise ValueError(f"precondition_frequency must be >= 1, got {precondition_frequency}")
        settings = SoapConfig(
            beta1=betas[0],
            beta2=betas[1],
            statistics_beta=statistics_beta or 0.0,
            epsilon=eps,
            block_size=block_size,
            statistics_dtype=cast(StatisticsDtype, dtype_name(statistics_dtype)),  # the section checks it
        )
        self.engine = SoapEngine(model, settings, skip, dtype=dtype)
        self.optimizer = SoapStep(self.engine.parameters(), lr, weight_decay)
        self.frequency = precondition_frequency
        self.steps = 0

    def matrices(self) -> list[MatrixInfo]:
        """The matrices SOAP steps, with their block structure."""
        return self.engine.matrices()

    def others(self, model: nn.Module) -> list[nn.Parameter]:
        """The trainable parameters of ``model`` SOAP does not step (for a first-order rule)."""
        mine = {id(p) for p in self.engine.parameters()}
        return [p for p in model.parameters() if p.requires_grad and id(p) not in mine]

    def health(self) -> dict[str, SoapHealth]:
        """Per-matrix numerics counters (one host read)."""
        return self.engine.health()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none)

    def step(self) -> None:
        """Direction, step and statistics of every matrix; the eigenbases' refresh when due."""
        self.engine.precondition_all()
        self.optimizer.step()
        self.steps += 1
        if self.steps > 1 and (self.steps - 1) % self.frequency == 0:
            self.refresh()

    def refresh(self) -> None:
        """New eigenbases of every matrix from its current statistics, in use at once; warns about
        numerical trouble (one host read)."""
        self.engine.snapshot()
        for info in self.engine.matrices():
            for factor in FACTORS:
                self.engine.refresh(info.name, factor)
        self.engine.commit()
        self.engine.check_health()

    def state_dict(self) -> dict[str, Any]:
        return {"engine": self.engine.state_dict(), "optimizer": self.optimizer.state_dict(), "steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.engine.load_state_dict(state["engine"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.steps = int(state["steps"])
