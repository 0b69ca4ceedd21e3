"""SOAP's torch side as the runtime, profiler and reference read it (`MethodParts`)."""

from pipefisher.methods.interface import MethodParts, tied_copies
from pipefisher.methods.soap.front import SoapStep
from pipefisher.methods.soap.runtime import SoapRuntime, SoapTimer, matrix_names
from pipefisher.methods.soap.reference import ReferenceSoap

PARTS = MethodParts(
    runtime=SoapRuntime,
    timer=SoapTimer,
    layer_names=matrix_names,
    skip=tied_copies,
    reference=ReferenceSoap,
    preconditioned=lambda config, module, skip: matrix_names(module, skip),
    optimizer=lambda config, param_groups: SoapStep(param_groups, lr=config.optimizer_settings.lr),
)
