"""K-FAC's torch side as the runtime, profiler and reference read it (`MethodParts`)."""

from pipefisher.methods.interface import MethodParts
from pipefisher.methods.kfac.layer import preconditioned_parameters, select_layers
from pipefisher.methods.kfac.runtime import KfacRuntime, KfacTimer
from pipefisher.methods.kfac.reference import ReferenceKfac

PARTS = MethodParts(
    runtime=KfacRuntime,
    timer=KfacTimer,
    layer_names=lambda module, skip: list(select_layers(module, skip)),
    skip=lambda model: model.first_order_linears(),
    reference=ReferenceKfac,
    preconditioned=lambda config, module, skip: preconditioned_parameters(module, skip),
)
