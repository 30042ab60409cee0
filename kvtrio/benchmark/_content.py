"""KV bytes derived from block identities, so that every retrieve can be checked byte for byte.

A block's bytes in one layer of one rank are a window of a fixed random pool, at an offset
derived from the block's identity, the rank and the layer. Writing and checking a request's
blocks are a gather from the pool and a compare: memory-bandwidth work, not hashing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from ..transfer import KVLayout

__all__ = ["BlockContent", "numpy_dtype"]

_POOL_BYTES = 1 << 22
_POISON = 0xA5


def numpy_dtype(name: str) -> np.dtype[Any]:
    return np.dtype(name)


def _block_views(layout: KVLayout, arrays: Sequence[np.ndarray[Any, Any]]) -> list[Any]:
    """Per layer, a ``(lead, num_blocks, bytes)`` byte view in which block ``b`` is ``[:, b]``.

    Every layout keeps its blocks on axis 0, or on axis 1 behind a K/V axis of 2."""
    lead = 2 if layout.kind_entry.axes[1] == 1 else 1
    return [a.view(np.uint8).reshape(lead, layout.num_blocks, -1) for a in arrays]


class BlockContent:
    """Writes and checks the KV bytes of blocks of one rank's cache."""

    def __init__(self, layout: KVLayout, arrays: Sequence[np.ndarray[Any, Any]], rank: int) -> None:
        self.layout = layout
        self.views = _block_views(layout, arrays)
        self.lead = self.views[0].shape[0]
        self.part = self.views[0].shape[2]
        self.window = self.lead * self.part
        """Bytes of one block in one layer."""
        self.block_bytes = self.window * layout.num_layers
        self.align = layout.element_size
        pool = np.random.default_rng(12345).integers(
            0, 256, _POOL_BYTES + self.window, dtype=np.uint8
        )
        self._windows = sliding_window_view(pool, self.window)
        self._salt = [
            np.uint64(((rank + 1) * 0x9E3779B97F4A7C15 + layer * 0xC2B2AE3D27D4EB4F) % 2**64)
            for layer in range(layout.num_layers)
        ]

    def _expected(self, identities: np.ndarray[Any, Any], layer: int) -> np.ndarray[Any, Any]:
        """``(lead, n, part)``: the bytes the blocks of these identities hold in ``layer``."""
        with np.errstate(over="ignore"):
            mixed = (identities ^ self._salt[layer]) * np.uint64(0xFF51AFD7ED558CCD)
            mixed ^= mixed >> np.uint64(33)
        slots = np.uint64(_POOL_BYTES // self.align)
        offsets = (mixed % slots).astype(np.int64) * self.align
        rows = self._windows[offsets]  # (n, window), a copy
        shaped: np.ndarray[Any, Any] = rows.reshape(len(identities), self.lead, self.part)
        return np.transpose(shaped, (1, 0, 2))

    def fill(self, blocks: np.ndarray[Any, Any], identities: np.ndarray[Any, Any]) -> None:
        """Write the KV of blocks with these identities (what a prefill would compute)."""
        if len(blocks):
            for layer, view in enumerate(self.views):
                view[:, blocks] = self._expected(identities, layer)

    def poison(self, blocks: np.ndarray[Any, Any]) -> None:
        """Overwrite blocks, so that a retrieve that did not write them cannot pass the check."""
        if len(blocks):
            for view in self.views:
                view[:, blocks] = _POISON

    def mismatches(self, blocks: np.ndarray[Any, Any], identities: np.ndarray[Any, Any]) -> int:
        """How many of the blocks do not hold exactly the KV of their identities."""
        if not len(blocks):
            return 0
        bad = np.zeros(len(blocks), dtype=bool)
        for layer, view in enumerate(self.views):
            got = view[:, blocks]
            bad |= (got != self._expected(identities, layer)).any(axis=(0, 2))
        return int(bad.sum())
