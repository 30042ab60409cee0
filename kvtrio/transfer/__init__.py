"""Copying KV cache between an engine's paged tensors and canonical L1 chunks.

:class:`KVLayout` describes an engine's per-layer KV tensors and the canonical chunk format every
layout maps to; :func:`gather` and :func:`scatter` copy between the two on the CPU (synchronous,
for worker threads; :func:`scatter_parts` scatters several chunks, or parts of chunks, at once).
Callers pass numpy arrays; nothing here imports torch. :class:`Transfer` is the interface the CPU
path and the CUDA engine (:mod:`kvtrio.transfer.cuda`) share.
"""

from ._cpu import gather, scatter, scatter_parts
from ._cpu_native import cpu_helper
from ._engines import CPU_TRANSFER, CpuTransfer, Transfer
from ._kinds import LAYOUTS, LayoutKind, layout_kind
from ._layouts import DTYPE_SIZES, LAYOUT_KINDS, ChunkFormat, KVLayout

__all__ = [
    "CPU_TRANSFER",
    "DTYPE_SIZES",
    "LAYOUTS",
    "LAYOUT_KINDS",
    "ChunkFormat",
    "CpuTransfer",
    "KVLayout",
    "LayoutKind",
    "Transfer",
    "cpu_helper",
    "gather",
    "layout_kind",
    "scatter",
    "scatter_parts",
]
