"""Shampoo's torch side as the runtime, profiler and reference read it (`MethodParts`)."""

from pipefisher.methods.interface import MethodParts
from pipefisher.methods.shampoo.ops import ShampooRuntime, ShampooTimer, matrix_names, tied_skip
from pipefisher.methods.shampoo.reference import ReferenceShampoo

PARTS = MethodParts(
    runtime=ShampooRuntime,
    timer=ShampooTimer,
    layer_names=matrix_names,
    skip=lambda model: tied_skip(model.tied_parameters()),
    reference=ReferenceShampoo,
)
