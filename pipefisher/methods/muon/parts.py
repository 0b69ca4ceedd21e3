"""Muon's torch side as the runtime, profiler and reference read it (`MethodParts`)."""

from pipefisher.methods.interface import MethodParts
from pipefisher.methods.muon.runtime import MuonRuntime, MuonTimer, first_order_globs, matrix_names
from pipefisher.methods.muon.optimizer import MuonStep
from pipefisher.methods.muon.reference import ReferenceMuon

PARTS = MethodParts(
    runtime=MuonRuntime,
    timer=MuonTimer,
    layer_names=matrix_names,
    skip=first_order_globs,
    reference=ReferenceMuon,
    preconditioned=lambda config, module, skip: matrix_names(module, skip),
    optimizer=lambda config, param_groups: MuonStep(param_groups, lr=config.optimizer_settings.lr),
)
