"""Copying KV cache between an engine's paged tensors and canonical L1 chunks.

:class:`KVLayout` describes an engine's per-layer KV tensors and the canonical chunk format every
layout maps to; :func:`gather` and :func:`scatter` copy between the two on the CPU (synchronous,
for worker threads). Callers pass numpy arrays; nothing here imports torch.
"""

from ._cpu import gather, scatter
from ._layouts import DTYPE_SIZES, LAYOUT_KINDS, ChunkFormat, KVLayout

__all__ = ["DTYPE_SIZES", "LAYOUT_KINDS", "ChunkFormat", "KVLayout", "gather", "scatter"]
