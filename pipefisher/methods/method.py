"""A curvature method as the rest of pipefisher sees it: its declaration. Pure Python: no torch.

Every method's work is expressed in the same op kinds (`pipefisher.planning.vocabulary`): its
`TaskRules` say which ops a layer has, by part index, and its `WorkLabels` what the method calls
them (K-FAC's parts are its "A factor" and "B factor", their refresh work an "inverse"), so the
packer, plans, the NCCL-order check, the simulator, reports and viz serve all methods alike.

A method's torch side (`MethodParts`, `pipefisher.methods.interface`) is named by a
"module:attribute" string and imported only when a run needs it, so planning stays torch-free.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field, replace
from typing import Any

from pipefisher.methods.flops import MatrixShape, TaskFlops
from pipefisher.planning.vocabulary import TaskRules, WorkLabels

__all__ = ["CurvatureMethod", "TaskRules", "WorkLabels"]


@dataclass(frozen=True)
class CurvatureMethod:
    """One curvature method: `name` (its `optimizer.name` and run-file section), `label` (its name
    in reports; its work's labels name it there unless they name it otherwise), its task rules
    (with its `WorkLabels`), `settings` (the dataclass of its run-file section, a
    `RefreshConfig`), `parts` ("module:attribute" of its `MethodParts`: runtime, task timer,
    layers, reference twin) and `flags`: keys of its section that get a short command-line flag
    `--<name>-<key>` beside the ones every method has (placement, refresh steps); `memory`:
    "module:attribute" of its torch-free memory model of a layer
    (`pipefisher.planning.memory.state.CurvatureLayer`; "" = not modelled); `flops`:
    "module:attribute" of its torch-free `pipefisher.methods.flops.FlopHook`, the flops of its
    tasks on one matrix ("" = unknown: `task_flops` gives none); `shards`: its runtime reads and
    writes the gradients it preconditions through `pipefisher.runtime.primitives.sharding`, so it
    runs on parameters sharded by optimizer.zero 2/3 (FSDP2)."""

    name: str
    label: str
    rules: TaskRules
    settings: type
    parts: str
    flags: tuple[str, ...] = ()
    memory: str = ""
    flops: str = ""
    shards: bool = False
    _loaded: dict[str, Any] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.rules.labels.method:
            labels = replace(self.rules.labels, method=self.label)
            object.__setattr__(self, "rules", replace(self.rules, labels=labels))

    def runtime_parts(self) -> Any:
        """Its `MethodParts`, imported on first use (this imports torch)."""
        return self._attribute("parts", self.parts)

    def task_flops(
        self, settings: Any, shape: MatrixShape, tokens: int, sequences: int | None = None
    ) -> dict[str, TaskFlops]:
        """The flops of each of its timed tasks on the matrix `shape` (time key -> `TaskFlops`,
        per execution as the profile times it) under its run-file section `settings`, with
        `tokens` rows per micro-batch in `sequences` (None: each token on its own); {} when it
        declares none (`flops` is "")."""
        if not self.flops:
            return {}
        return dict(self._attribute("flops", self.flops)(settings, shape, tokens, sequences or tokens))

    def _attribute(self, key: str, spec: str) -> Any:
        """The attribute "module:attribute" `spec` names, imported once (kept under `key`)."""
        if key not in self._loaded:
            module, _, attribute = spec.partition(":")
            self._loaded[key] = getattr(importlib.import_module(module), attribute)
        return self._loaded[key]
