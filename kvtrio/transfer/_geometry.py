"""The *geometry* of a layer: what the CUDA kernels and the host library know of an engine tensor.

Whatever its layout kind, a layer tensor is seen as a five-axis view ``(kv, block, token, head,
dim)`` with byte strides; the geometry is that view's sizes and strides as a tuple of
:data:`GEOMETRY_FIELDS` ints, in the order of ``KVT_G_*`` in ``cuda_ext/kvtrio_index.h``. The
C++ side derives everything else from it (runs, vector width, where each chunk byte lives), so
this module is the only place where layout kinds are turned into numbers for it.
"""

from __future__ import annotations

from collections.abc import Sequence

from ._kinds import LAYOUTS, Axes
from ._layouts import KVLayout

__all__ = [
    "GEOMETRY_FIELDS",
    "GPU_LAYOUT_KINDS",
    "KIND_AXES",
    "check_extent",
    "contiguous_strides",
    "geometry",
    "kind_axes",
    "view_strides",
]

GEOMETRY_FIELDS = 11
"""``KVT_G_FIELDS``: kv, block_size, heads, head_dim, element, num_blocks, then the byte strides
of kv, block, token, head and dim."""

KIND_AXES: dict[str, Axes] = {kind.name: kind.axes for kind in LAYOUTS.values() if kind.strided}
"""Axis of the layer tensor that holds (kv, block, token, head, dim) of each kind the kernels
copy: the strided kinds of :data:`._kinds.LAYOUTS` (``vllm_cpu`` keeps K transposed within a
block and head, so K and V have no common strided view: the CPU path copies it)."""

GPU_LAYOUT_KINDS = tuple(KIND_AXES)
"""Layout kinds the CUDA kernels (and the host library) copy."""


def kind_axes(kind: str) -> Axes:
    """:data:`KIND_AXES` of ``kind``; ``ValueError`` for a kind the CUDA kernels do not copy."""
    axes = KIND_AXES.get(kind)
    if axes is None:
        raise ValueError(
            f"{kind} layers cannot be copied by the CUDA kernels (they copy "
            f"{', '.join(GPU_LAYOUT_KINDS)}): {kind} is a CPU-only layout"
        )
    return axes


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """Element strides of a C-contiguous tensor of ``shape``."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def view_strides(layout: KVLayout, strides: Sequence[int]) -> tuple[int, int, int, int, int]:
    """Byte strides of the ``(kv, block, token, head, dim)`` view of a layer with element
    ``strides`` (in the layer tensor's own axis order). ``ValueError`` if they do not fit."""
    shape = layout.layer_shape
    if len(strides) != len(shape):
        raise ValueError(
            f"{len(strides)} strides for a {layout.kind} layer of {len(shape)} axes {shape}"
        )
    if any(type(s) is not int or s < 0 for s in strides):
        raise ValueError(f"strides must be non-negative ints, got {tuple(strides)}")
    axes = kind_axes(layout.kind)
    size = layout.element_size
    kv, block, token, head, dim = (0 if a is None else strides[a] * size for a in axes)
    return kv, block, token, head, dim


def geometry(layout: KVLayout, strides: Sequence[int] | None = None) -> tuple[int, ...]:
    """The geometry of layers of ``layout`` with element ``strides`` (C-contiguous if None)."""
    if strides is None:
        strides = contiguous_strides(layout.layer_shape)
    return (
        layout.kv,
        layout.block_size,
        layout.num_heads,
        layout.head_dim,
        layout.element_size,
        layout.num_blocks,
        *view_strides(layout, strides),
    )


def check_extent(
    layout: KVLayout, strides: Sequence[int], offset: int, available: int, name: str = "layer"
) -> None:
    """``ValueError`` unless a layer of ``layout`` with element ``strides``, starting ``offset``
    elements into memory of ``available`` bytes, lies inside it and has no two elements at one
    address (a scatter through aliased strides would be undefined)."""
    shape = layout.layer_shape
    size = layout.element_size
    if type(offset) is not int or offset < 0:
        raise ValueError(f"{name}: the offset must be a non-negative int, got {offset!r}")
    view_strides(layout, strides)  # validates count and types
    last = sum((n - 1) * s for n, s in zip(shape, strides, strict=True))
    end = (offset + last) * size + size
    if end > available:
        raise ValueError(
            f"{name}: shape {shape} with strides {tuple(strides)} at element offset {offset} "
            f"reaches byte {end}, beyond the {available} bytes of its memory"
        )
    # No aliasing: sorted by stride, each axis must step over everything the smaller ones span.
    span = 1
    for n, s in sorted(((n, s) for n, s in zip(shape, strides, strict=True) if n > 1),
                       key=lambda item: item[1]):  # fmt: skip
        if s < span:
            raise ValueError(
                f"{name}: strides {tuple(strides)} make elements of shape {shape} overlap"
            )
        span = s * n
