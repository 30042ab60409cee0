"""The CPU copy path: gather engine blocks into a canonical chunk, scatter a chunk into blocks.

Both functions are plain synchronous numpy copies, one pass over the bytes, single-threaded;
numpy releases the GIL while it copies, so callers run them in worker threads
(``trio.to_thread.run_sync``) and the event loop keeps going. They never block on anything else.

How the copy works: a C-contiguous layer tensor is viewed as a 2-D array of *rows*, where a row
is the longest run of bytes that is contiguous both in the engine tensor and in the canonical
chunk, and the chunk's bytes for that layer are the same rows in a different order:

* ``flash_attn``, ``flash_infer``, ``mla``: a row is one block of K (or V), ``block_size *
  num_heads * head_dim`` elements, since within a block both formats are token-major;
* ``cpu``: a block is head-major (``[head, token, dim]``) while the chunk is token-major, so a
  row is one head of one token, ``head_dim`` elements.

``vllm_cpu`` has no such rows: vLLM's CPU kernels keep K transposed (``[dim, token]`` per block
and head), so nothing longer than one element is contiguous in both. It is copied by the optional
C helper (register-tile transposes of each head's K through a stage in L1, SSE2 or AVX2, at
memcpy speed), and otherwise by the blockwise path with separate K and V views (about half of
memcpy).

The optional C helper (:mod:`._cpu_native`, built on first use when there is a C compiler) does
the copies of C-contiguous layers of every kind: the same rows, moved with plain vector moves
instead of glibc's ``memcpy``, which numpy calls and which some relative alignments of source and
destination slow down ten-fold on AMD EPYC. numpy does them when the helper is unavailable.

A gather is then one ``np.take`` of rows per layer (a ``memmove`` per row, straight into the
output buffer) and a scatter one indexed assignment per layer. The *blockwise* path views a layer
of any strides as ``(kv, blocks, tokens, heads, dim)`` and copies block by block (gather) or with
one indexed assignment (scatter): it serves layers that are not C-contiguous, and head-major
gathers with big blocks, where it beats many short rows. Everything is copied as raw bytes
(bfloat16 and fp8 arrive as same-size integers; values are never converted).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from ._cpu_native import cpu_helper
from ._layouts import KVLayout

__all__ = ["gather", "scatter", "scatter_parts"]

Array = npt.NDArray[Any]
IndexArray = npt.NDArray[np.intp]

_UINT_OF_SIZE: dict[int, type[np.unsignedinteger[Any]]] = {
    1: np.uint8,
    2: np.uint16,
    4: np.uint32,
}

_BLOCKWISE_GATHER_BYTES = 128 << 10
"""Head-major blocks (K and V) at least this big are gathered block by block, not row by row.

Rows of the head-major layouts are only ``head_dim`` elements long and ``np.take``'s per-row cost
shows with big blocks: with 8 heads × 128, fp16, one strided ``np.copyto`` per block is ~4%
faster at 32 tokens per block (128 KiB) and ~8% at 128 tokens, but ~3% slower at 16 tokens
(64 KiB), where the per-call cost catches up.
"""


def gather(
    layout: KVLayout,
    layers: Sequence[Array],
    block_ids: Sequence[int] | npt.NDArray[np.integer[Any]],
    out: Array,
) -> None:
    """Copy blocks ``block_ids`` of every layer into ``out``, in the canonical chunk format.

    ``layers`` holds one array per layer of shape ``layout.layer_shape`` and any dtype of
    ``layout.element_size`` bytes. ``out`` is a C-contiguous, writeable buffer of exactly
    ``layout.chunk_nbytes(len(block_ids) * layout.block_size)`` bytes: a 1-D ``uint8`` array (a
    slot of the shared-memory arena, typically) or an array of ``layout.chunk_shape(...)``. Block
    ids may come in any order, with gaps. Raises ``ValueError`` saying what is wrong with an
    argument; nothing is written then.

    Synchronous: meant to run in a worker thread (numpy releases the GIL while it copies).
    """
    ids = _check_block_ids(layout, block_ids, unique=False)
    _check_layers(layout, layers, writeable=False)
    chunk = _chunk_rows(layout, out, len(ids), name="out", writeable=True)
    if _native(layout, layers, ids, chunk, gather=True):
        return
    by_rows = layout.kind != "vllm_cpu" and (
        not layout.head_major or _block_nbytes(layout) < _BLOCKWISE_GATHER_BYTES
    )
    rows: IndexArray | None = None
    for layer, dst in zip(layers, chunk, strict=True):
        if by_rows and layer.flags.c_contiguous:
            if rows is None:
                rows = _row_index(layout, ids)
            # mode="wrap" skips numpy's defensive copy of `out` (ids are checked above).
            np.take(_layer_rows(layout, layer), rows, axis=0, out=dst, mode="wrap")
        else:
            _gather_blockwise(layout, layer, ids, dst)


def scatter(
    layout: KVLayout,
    layers: Sequence[Array],
    block_ids: Sequence[int] | npt.NDArray[np.integer[Any]],
    src: Array,
) -> None:
    """Copy the canonical chunk ``src`` into blocks ``block_ids`` of every layer.

    The inverse of :func:`gather`, with the same arguments; here the layers must be writeable
    and the block ids distinct. Blocks not named are left untouched. Raises ``ValueError``
    saying what is wrong with an argument; nothing is written then.

    Synchronous: meant to run in a worker thread (numpy releases the GIL while it copies).
    """
    ids = _check_block_ids(layout, block_ids, unique=True)
    _check_layers(layout, layers, writeable=True)
    chunk = _chunk_rows(layout, src, len(ids), name="src", writeable=False)
    if _native(layout, layers, ids, chunk, gather=False):
        return
    rows: IndexArray | None = None
    for layer, data in zip(layers, chunk, strict=True):
        if layer.flags.c_contiguous and layout.kind != "vllm_cpu":
            if rows is None:
                rows = _row_index(layout, ids)
            _layer_rows(layout, layer)[rows] = data
        else:
            _scatter_blockwise(layout, layer, ids, data)


def scatter_parts(
    layout: KVLayout,
    layers: Sequence[Array],
    parts: Sequence[tuple[Sequence[int] | npt.NDArray[np.integer[Any]], Array, int]],
) -> None:
    """Scatter several chunks, or parts of chunks: part ``(block_ids, src, first)`` copies
    blocks ``[first, first + len(block_ids))`` of the canonical chunk ``src`` (of any whole
    number of blocks, a buffer as :func:`scatter` takes) into blocks ``block_ids``.

    The same bytes as a :func:`scatter` per part of a contiguous copy of its blocks, without
    that copy; ``vllm_cpu`` layers with the C helper are copied in one call that releases the
    GIL once for all the parts (a retrieve's eight 11 MiB chunks took ~2 ms of GIL hand-offs
    and a 10 MiB extra copy for its partial last chunk the other way). Block ids must be
    distinct across all the parts. ``ValueError`` saying what is wrong with an argument;
    nothing is written then. Synchronous, as :func:`scatter`.
    """
    _check_layers(layout, layers, writeable=True)
    block_bytes = layout.chunk_nbytes(layout.block_size)
    checked: list[tuple[IndexArray, Array, int, int]] = []
    for block_ids, src, first in parts:
        ids = _check_block_ids(layout, block_ids, unique=False)
        span = src.nbytes // block_bytes if isinstance(src, np.ndarray) else 0
        if span < 1 or not 0 <= first <= span - ids.size:
            raise ValueError(
                f"a part of blocks [{first}, {first + ids.size}) does not fit its chunk of "
                f"{span} block(s)"
            )
        _chunk_rows(layout, src, span, name="src", writeable=False)
        checked.append((ids, src, first, span))
    if not checked:
        return
    _check_block_ids(layout, np.concatenate([ids for ids, *_ in checked]), unique=True)
    helper = cpu_helper()
    if helper is not None and layout.kind == "vllm_cpu":
        helper.vllm_cpu_parts(layout, layers, [(i, s.reshape(-1), f, n) for i, s, f, n in checked],
                              gather=False)  # fmt: skip
        return
    for ids, src, first, span in checked:
        if first or ids.size != span:  # a contiguous copy of the part's blocks
            rows = src.reshape(-1).view(np.uint8).reshape(layout.num_layers, layout.kv, -1)
            size = layout.block_size * layout.row_elements * layout.element_size
            src = np.ascontiguousarray(rows[:, :, first * size : (first + ids.size) * size])
        scatter(layout, layers, ids, src.reshape(-1))


def _native(
    layout: KVLayout, layers: Sequence[Array], ids: IndexArray, chunk: Array, *, gather: bool
) -> bool:
    """Copy with the C helper if it is available and applies; whether it did."""
    helper = cpu_helper()
    if helper is None:
        return False
    if layout.kind == "vllm_cpu":
        helper.vllm_cpu(layout, layers, ids, chunk, gather)
        return True
    if not all(layer.flags.c_contiguous for layer in layers):
        return False
    helper.rows(layers, _row_index(layout, ids), _row_bytes(layout), chunk, gather)
    return True


# --------------------------------------------------------------------------- rows


def _row_bytes(layout: KVLayout) -> int:
    """Bytes of a row: the unit that is contiguous in both the layer and the chunk."""
    if layout.head_major:
        return layout.head_dim * layout.element_size
    return layout.block_size * layout.row_elements * layout.element_size


def _block_nbytes(layout: KVLayout) -> int:
    """Bytes of one block, K and V."""
    return layout.kv * layout.block_size * layout.row_elements * layout.element_size


def _layer_rows(layout: KVLayout, layer: Array) -> Array:
    """A C-contiguous layer as a 2-D ``uint8`` array of rows (a view, never a copy)."""
    return layer.view(np.uint8).reshape(-1, _row_bytes(layout))


def _row_index(layout: KVLayout, ids: IndexArray) -> IndexArray:
    """The layer rows that make up the chunk of blocks ``ids``, in the chunk's order."""
    blocks = layout.num_blocks
    if layout.kind == "mla":  # layer rows: (block); chunk rows: (i)
        return ids
    k = np.arange(2, dtype=np.intp)[:, None]
    if layout.kind == "flash_attn":  # layer rows: (k, block); chunk rows: (k, i)
        return (k * blocks + ids).ravel()
    if layout.kind == "flash_infer":  # layer rows: (block, k); chunk rows: (k, i)
        return (ids * 2 + k).ravel()
    heads, size = layout.num_heads, layout.block_size
    head = np.arange(heads, dtype=np.intp)
    token = np.arange(size, dtype=np.intp)[:, None]
    # cpu: layer rows (k, block, head, t); chunk rows (k, i, t, head).
    first = (k * blocks + ids)[:, :, None, None] * heads
    return ((first + head) * size + token).ravel()


# --------------------------------------------------------------------------- blockwise


def _engine_views(layout: KVLayout, layer: Array) -> list[Array]:
    """Any-strided layer as one ``(num_blocks, block_size, heads, head_dim)`` view per K/V."""
    raw: Array = layer.view(_UINT_OF_SIZE[layout.element_size])
    if layout.kind == "flash_attn":
        return list(raw)
    if layout.kind == "mla":
        return [raw[:, :, None, :]]
    if layout.kind == "flash_infer":
        return [raw[:, 0], raw[:, 1]]
    if layout.kind == "cpu":
        return [np.transpose(raw[k], (0, 2, 1, 3)) for k in range(2)]
    # vllm_cpu: per block and head, K as [dim, token], then V as [token, dim]. The K view
    # reinterprets a (token, dim) region, which _check_layers made sure is contiguous.
    blocks, heads, _, size, dim = layout.layer_shape
    item = raw.itemsize
    key = np.lib.stride_tricks.as_strided(
        raw[:, :, 0],
        shape=(blocks, size, heads, dim),
        strides=(raw.strides[0], item, raw.strides[1], size * item),
    )
    return [key, np.transpose(raw[:, :, 1], (0, 2, 1, 3))]


def _chunk_view(layout: KVLayout, data: Array, blocks: int) -> Array:
    """One layer's rows of a chunk as a ``(kv, blocks, block_size, heads, head_dim)`` view."""
    shape = (layout.kv, blocks, layout.block_size, layout.num_heads, layout.head_dim)
    return data.view(_UINT_OF_SIZE[layout.element_size]).reshape(shape)


def _gather_blockwise(layout: KVLayout, layer: Array, ids: IndexArray, dst: Array) -> None:
    chunk = _chunk_view(layout, dst, len(ids))
    for k, engine in enumerate(_engine_views(layout, layer)):
        for i, block in enumerate(ids.tolist()):
            np.copyto(chunk[k, i], engine[block])


def _scatter_blockwise(layout: KVLayout, layer: Array, ids: IndexArray, data: Array) -> None:
    chunk = _chunk_view(layout, data, len(ids))
    for k, engine in enumerate(_engine_views(layout, layer)):
        engine[ids] = chunk[k]


# --------------------------------------------------------------------------- validation


def _check_block_ids(
    layout: KVLayout, block_ids: Sequence[int] | npt.NDArray[np.integer[Any]], *, unique: bool
) -> IndexArray:
    """``block_ids`` as a 1-D ``intp`` array, or ``ValueError``."""
    ids = np.asarray(block_ids)
    if ids.ndim != 1:
        raise ValueError(f"block_ids must be a 1-D sequence of ints, got shape {ids.shape}")
    if ids.size == 0:
        raise ValueError("block_ids is empty: a chunk has at least one block")
    if ids.dtype.kind not in "iu":
        raise ValueError(f"block_ids must be integers, got dtype {ids.dtype}")
    bad = ids[(ids < 0) | (ids >= layout.num_blocks)]
    if bad.size:
        raise ValueError(
            f"block ids out of range (expected 0 ≤ id < num_blocks = {layout.num_blocks}): "
            f"{_some(bad)}"
        )
    if unique and len(set(ids.tolist())) != ids.size:  # a set: np.unique costs ~15-40 µs
        values, counts = np.unique(ids, return_counts=True)
        if values.size != ids.size:
            raise ValueError(
                f"block_ids must be distinct for a scatter; repeated: {_some(values[counts > 1])}"
            )
    return ids.astype(np.intp, copy=False)


def _check_layers(layout: KVLayout, layers: Sequence[Array], *, writeable: bool) -> None:
    """``ValueError`` unless ``layers`` are ``layout.num_layers`` numpy arrays of the layout's
    shape and element size (writeable ones if ``writeable``; ``vllm_cpu``: each block and head's
    K and V contiguous)."""
    if len(layers) != layout.num_layers:
        raise ValueError(f"expected {layout.num_layers} layer arrays, got {len(layers)}")
    # Hoisted: this runs for every layer of every copy (a 30-layer copy of 11 MiB takes ~1.4 ms).
    shape, size = layout.layer_shape, layout.element_size
    inner = (layout.head_dim * size, size) if layout.kind == "vllm_cpu" else None
    for i, layer in enumerate(layers):
        if not isinstance(layer, np.ndarray):
            raise ValueError(f"layer {i}: expected a numpy array, got {type(layer).__name__}")
        if layer.shape != shape:
            raise ValueError(
                f"layer {i}: expected shape {shape} ({layout.kind} layout), got {layer.shape}"
            )
        dtype = layer.dtype
        if dtype.itemsize != size or dtype.hasobject:
            raise ValueError(
                f"layer {i}: expected {size}-byte elements ({layout.dtype}), "
                f"got dtype {dtype} ({dtype.itemsize} bytes)"
            )
        if writeable and not layer.flags.writeable:
            raise ValueError(f"layer {i}: the array is read-only")
        if inner is not None and layer.strides[3:] != inner:
            raise ValueError(
                f"layer {i}: a vllm_cpu layer must keep the K and the V of each block and head "
                f"contiguous (its K is stored transposed), got strides {layer.strides}"
            )


def _chunk_rows(layout: KVLayout, buf: Array, blocks: int, *, name: str, writeable: bool) -> Array:
    """The chunk buffer as ``(num_layers, rows, row_bytes)`` ``uint8``, or ``ValueError``."""
    tokens = blocks * layout.block_size
    shape, nbytes = layout.chunk_shape(tokens), layout.chunk_nbytes(tokens)
    expected = f"a 1-D uint8 buffer of {nbytes} bytes or an array of shape {shape}"
    if not isinstance(buf, np.ndarray):
        raise ValueError(f"{name} must be {expected}, got {type(buf).__name__}")
    if buf.ndim == 1 and buf.dtype == np.uint8:
        if buf.size != nbytes:
            raise ValueError(
                f"{name} has {buf.size} bytes, expected {nbytes} for {blocks} block(s) of "
                f"{layout.block_size} tokens (chunk shape {shape}, {layout.dtype})"
            )
    elif buf.shape == shape:
        if buf.dtype.itemsize != layout.element_size or buf.dtype.hasobject:
            raise ValueError(
                f"{name}: expected {layout.element_size}-byte elements ({layout.dtype}), "
                f"got dtype {buf.dtype} ({buf.dtype.itemsize} bytes)"
            )
    else:
        raise ValueError(f"{name} must be {expected}, got a {buf.dtype} array of shape {buf.shape}")
    if not buf.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous (got strides {buf.strides})")
    if writeable and not buf.flags.writeable:
        raise ValueError(f"{name} is read-only")
    return buf.reshape(-1).view(np.uint8).reshape(layout.num_layers, -1, _row_bytes(layout))


def _some(values: Array, limit: int = 8) -> str:
    """The first ``limit`` values, for an error message."""
    shown = ", ".join(str(v) for v in values[:limit].tolist())
    return shown + (f", … ({values.size} in all)" if values.size > limit else "")
