"""A curvature method's memory model of one layer (`CurvatureLayer`: each built-in method's
``pipefisher.methods.<m>.memory``), and the per-(stage, layer) maps of its refresh's bytes that
`pipefisher.planning.memory.cycle` takes. Pure Python: no torch."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

#: a layer of a stage: (stage index, layer name)
LayerKey = tuple[int, str]
#: bytes of the refresh op of (stage index, layer name, part) while it runs
RefreshWork = Callable[[int, str, int], int]


class CurvatureLayer(Protocol):
    """A curvature method's memory model of one layer."""

    name: str

    def state_bytes(self, element_bytes: int, keeps_results: bool) -> int:
        """Bytes held for the layer after a committed refresh, statistics of `element_bytes` each;
        `keeps_results`: the rank keeps the layer's refresh results (inverses, roots)."""

    @property
    def gradient_elements(self) -> int:
        """Elements of the layer's preconditioned gradient (what a gradient worker broadcasts)."""

    def refresh_copy_bytes(self, element_bytes: int) -> int:
        """Bytes a rank holds beside `state_bytes` from the layer's first refresh work of a cycle
        (its first curvature, refresh or exchange op there) to the cycle's commit."""

    def refresh_work_bytes(self, element_bytes: int, part: int) -> int:
        """Bytes the refresh op of the layer's `part` (`Op.part`: 0 for A, 1 for B) allocates and
        frees while it runs (its temporaries)."""

    def help_bytes(self, element_bytes: int) -> int:
        """Bytes a rank that helps with the layer holds for it (`pipefisher.planning.memory.helped`)."""

    def help_result_bytes(self, element_bytes: int) -> int:
        """Bytes the layer's own rank holds beside its state while another rank helps with it."""


def stage_layers(curvature_layers: Sequence[Sequence[CurvatureLayer]]) -> dict[LayerKey, CurvatureLayer]:
    """Every layer of every stage (index = stage) by (stage, name)."""
    return {(stage, layer.name): layer for stage, layers in enumerate(curvature_layers) for layer in layers}


def refresh_copies(layers: Mapping[LayerKey, CurvatureLayer], element_bytes: int = 4) -> dict[LayerKey, int]:
    """Per layer, `CurvatureLayer.refresh_copy_bytes` (where it holds any)."""
    found = {key: layer.refresh_copy_bytes(element_bytes) for key, layer in layers.items()}
    return {key: held for key, held in found.items() if held}


def refresh_work(layers: Mapping[LayerKey, CurvatureLayer], element_bytes: int = 4) -> RefreshWork:
    """`CurvatureLayer.refresh_work_bytes` of a refresh op by (stage, layer name, part); 0 for a
    layer not in `layers`."""

    def work(stage: int, name: str, part: int) -> int:
        layer = layers.get((stage, name))
        return 0 if layer is None else layer.refresh_work_bytes(element_bytes, part)

    return work
