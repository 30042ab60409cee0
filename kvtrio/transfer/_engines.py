"""One gather/scatter interface for every copy engine: the CPU path and the CUDA engines.

A :class:`Transfer` copies one chunk between an engine's layers (whatever the engine holds them
as: numpy arrays for the CPU path, CUDA tensors for the CUDA engine) and a host buffer in the
canonical chunk format (an L1 slot). Calls are synchronous: they return when the bytes are in
place. ``tests/transfer/test_transfer_engines.py`` runs one suite against every engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from ._cpu import gather, scatter
from ._layouts import KVLayout

__all__ = ["CPU_TRANSFER", "CpuTransfer", "Transfer"]

BlockIds = Sequence[int] | npt.NDArray[np.integer[Any]]


class Transfer(Protocol):
    """Gather engine blocks into a host chunk buffer, scatter one back (see the module doc)."""

    name: str

    def gather(
        self, layout: KVLayout, layers: Sequence[Any], block_ids: BlockIds, out: npt.NDArray[Any]
    ) -> None:
        """Copy blocks ``block_ids`` of every layer into ``out`` (canonical format, host)."""

    def scatter(
        self, layout: KVLayout, layers: Sequence[Any], block_ids: BlockIds, src: npt.NDArray[Any]
    ) -> None:
        """Copy the canonical chunk ``src`` (host) into blocks ``block_ids`` of every layer."""


class CpuTransfer:
    """The CPU path: numpy copies in the calling thread (:func:`kvtrio.transfer.gather`)."""

    name = "cpu"

    def gather(
        self, layout: KVLayout, layers: Sequence[Any], block_ids: BlockIds, out: npt.NDArray[Any]
    ) -> None:
        gather(layout, layers, block_ids, out)

    def scatter(
        self, layout: KVLayout, layers: Sequence[Any], block_ids: BlockIds, src: npt.NDArray[Any]
    ) -> None:
        scatter(layout, layers, block_ids, src)


CPU_TRANSFER = CpuTransfer()
