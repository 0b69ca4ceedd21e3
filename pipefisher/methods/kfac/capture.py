"""K-FAC's capture of a layer's input ``a`` and output gradient ``e`` per micro-batch: the shared
one (`pipefisher.methods.capture`), recording both parts into each `LayerState`."""

from __future__ import annotations

from pipefisher.methods.capture import capture

__all__ = ["capture"]
