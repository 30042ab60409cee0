"""KV layouts in miniature, random layers and chunks, and reference copies written element by
element (the transfer tests compare kvtrio's copies with these)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from kvtrio.transfer import KVLayout

__all__ = [
    "BLOCK_IDS",
    "DTYPES",
    "NUM_BLOCKS",
    "Array",
    "as_bytes",
    "empty_chunk",
    "head_vector",
    "make_layout",
    "random_chunk",
    "random_layers",
    "reference_gather",
    "reference_scatter",
]

Array = npt.NDArray[Any]

NUM_BLOCKS = 7
# (layout dtype, array dtype the engine hands over): bfloat16 and fp8 come as same-size ints.
DTYPES = {1: ("float8_e4m3fn", np.uint8), 2: ("bfloat16", np.uint16), 4: ("float32", np.float32)}
BLOCK_IDS = {
    "single": [3],
    "unsorted-gaps": [5, 0, 2],
    "all-reversed": [6, 5, 4, 3, 2, 1, 0],
    "contiguous": [1, 2],
}


def make_layout(
    kind: str, element_size: int = 2, block_size: int = 4, *, heads: int = 2, head_dim: int = 3
) -> KVLayout:
    return KVLayout(
        kind=kind,
        num_layers=2,
        num_blocks=NUM_BLOCKS,
        block_size=block_size,
        num_heads=1 if kind == "mla" else heads,
        head_dim=head_dim + 2 if kind == "mla" else head_dim,
        dtype=DTYPES[element_size][0],
    )


def random_layers(layout: KVLayout, seed: int = 0, dtype: Any = None) -> list[Array]:
    """Layers of random bytes (NaN patterns included: everything is compared as bytes)."""
    rng = np.random.default_rng(seed)
    dtype = np.dtype(dtype or DTYPES[layout.element_size][1])
    nbytes = int(np.prod(layout.layer_shape)) * dtype.itemsize
    return [
        rng.integers(0, 256, nbytes, dtype=np.uint8).view(dtype).reshape(layout.layer_shape)
        for _ in range(layout.num_layers)
    ]


def random_chunk(layout: KVLayout, blocks: int, seed: int = 1) -> Array:
    nbytes = layout.chunk_nbytes(blocks * layout.block_size)
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def empty_chunk(layout: KVLayout, blocks: int) -> Array:
    return np.zeros(layout.chunk_nbytes(blocks * layout.block_size), np.uint8)


def as_bytes(arrays: Sequence[Array]) -> list[bytes]:
    return [a.tobytes() for a in arrays]


def head_vector(
    layout: KVLayout, layer: Array, k: int, block: int, offset: int, head: int
) -> Array:
    """The head_dim elements of one head of one token, read by the layout's own axis order."""
    if layout.kind == "flash_attn":  # (2, blocks, block_size, heads, dim)
        return layer[k, block, offset, head, :]
    if layout.kind == "flash_infer":  # (blocks, 2, block_size, heads, dim)
        return layer[block, k, offset, head, :]
    if layout.kind == "mla":  # (blocks, block_size, dim)
        assert k == 0
        assert head == 0
        return layer[block, offset, :]
    if layout.kind == "vllm_cpu":  # (blocks, heads, 2, block_size, dim); K as [dim, block_size]
        if k == 0:
            return layer[block, head, 0].reshape(layout.head_dim, layout.block_size)[:, offset]
        return layer[block, head, 1, offset, :]
    return layer[k, block, head, offset, :]  # cpu: (2, blocks, heads, block_size, dim)


def reference_gather(layout: KVLayout, layers: Sequence[Array], ids: Sequence[int]) -> Array:
    dim = layout.head_dim
    chunk = np.zeros(layout.chunk_shape(len(ids) * layout.block_size), layers[0].dtype)
    for layer_no, layer in enumerate(layers):
        for k in range(layout.kv):
            for i, block in enumerate(ids):
                if block == -1:  # no engine block (a partial chunk's tail): zeros
                    continue
                for offset in range(layout.block_size):
                    token = i * layout.block_size + offset
                    for head in range(layout.num_heads):
                        vector = head_vector(layout, layer, k, block, offset, head)
                        chunk[layer_no, k, token, head * dim : (head + 1) * dim] = vector
    return chunk


def reference_scatter(
    layout: KVLayout, layers: Sequence[Array], ids: Sequence[int], chunk: Array
) -> None:
    dim = layout.head_dim
    chunk = chunk.view(layers[0].dtype).reshape(layout.chunk_shape(len(ids) * layout.block_size))
    for layer_no, layer in enumerate(layers):
        for k in range(layout.kv):
            for i, block in enumerate(ids):
                if block == -1:  # no engine block (a partial chunk's tail): zeros
                    continue
                for offset in range(layout.block_size):
                    token = i * layout.block_size + offset
                    for head in range(layout.num_heads):
                        vector = head_vector(layout, layer, k, block, offset, head)
                        vector[...] = chunk[layer_no, k, token, head * dim : (head + 1) * dim]
