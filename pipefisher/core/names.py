"""Closed sets of names that the run file, the planner, the runtime and the command line share:
each one `Literal` type, and the tuple of its names derived from it (`typing.get_args`), so a
name is spelled once. Pure Python."""

from __future__ import annotations

import typing
from typing import Literal

#: the first-order optimizers (optimizer.name, and a curvature method's `first_order` rule)
FirstOrder = Literal["sgd", "adamw", "lamb"]
FIRST_ORDER: tuple[FirstOrder, ...] = typing.get_args(FirstOrder)

#: the precisions of a run (run.precision): fp32, or bf16/fp16 autocast
Precision = Literal["fp32", "bf16", "fp16"]
PRECISIONS: tuple[Precision, ...] = typing.get_args(Precision)

#: the torch.distributed backends a run may ask for (run.backend; auto picks nccl or gloo)
Backend = Literal["auto", "gloo", "nccl"]
BACKENDS: tuple[Backend, ...] = typing.get_args(Backend)

#: the modes of model.recompute: what the backward recomputes of the forward
Recompute = Literal["none", "selective", "blocks"]
RECOMPUTE_MODES: tuple[Recompute, ...] = typing.get_args(Recompute)
