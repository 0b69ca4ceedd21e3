"""SOAP's torch side as the runtime, profiler and reference read it (`MethodParts`)."""

from pipefisher.methods.interface import MethodParts
from pipefisher.methods.soap.front import SoapStep
from pipefisher.methods.soap.ops import SoapRuntime, SoapTimer, matrix_names, tied_skip
from pipefisher.methods.soap.reference import ReferenceSoap

PARTS = MethodParts(
    runtime=SoapRuntime,
    timer=SoapTimer,
    layer_names=matrix_names,
    skip=lambda model: tied_skip(model.tied_parameters()),
    reference=ReferenceSoap,
    preconditioned=lambda config, module, skip: matrix_names(module, skip),
    optimizer=lambda config, param_groups: SoapStep(param_groups, lr=config.optimizer_settings.lr),
)
