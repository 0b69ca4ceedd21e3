"""Shampoo's torch side as the runtime, profiler and reference read it (`MethodParts`)."""

from pipefisher.methods.interface import MethodParts, tied_copies
from pipefisher.methods.shampoo.runtime import ShampooRuntime, ShampooTimer, matrix_names
from pipefisher.methods.shampoo.reference import ReferenceShampoo
from pipefisher.methods.shampoo.state import owned_parameters

PARTS = MethodParts(
    runtime=ShampooRuntime,
    timer=ShampooTimer,
    layer_names=matrix_names,
    skip=tied_copies,
    reference=ReferenceShampoo,
    preconditioned=lambda config, module, skip: list(owned_parameters(module, skip, config.shampoo.matrices_only)),
)
