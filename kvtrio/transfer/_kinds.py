"""Layout kinds: one registry entry per attention backend's per-layer KV tensor.

Everything kvtrio derives from a kind comes from its :class:`LayoutKind` entry in
:data:`LAYOUTS`: the layer shape, K/V or latent, head-major or token-major, whether the CUDA
kernels copy it (their five-axis geometry) and, in the client, which axes of an engine tensor
hold the block count, the heads and the head dim. A new kind is one entry here; only a kind
without a common strided view of K and V (``vllm_cpu``) also needs a copy of its own in
:mod:`._cpu` (and the engine-shape guess of ``client/_tensors.py`` if it should be inferred).
"""

from __future__ import annotations

from types import MappingProxyType

import attrs

__all__ = ["LAYOUTS", "Axes", "LayoutKind", "layout_kind"]

Axes = tuple[int | None, int, int, int | None, int]
"""The axis of the layer tensor that holds (kv, block, token, head, dim); None: absent."""


@attrs.frozen
class LayoutKind:
    """One layout kind: its name and where its layer tensor keeps each of the five axes."""

    name: str
    axes: Axes
    strided: bool = True
    """K and V are strided views of the five axes (the CUDA kernels and the host library copy
    such kinds); False for a kind that stores one of them otherwise (``vllm_cpu``: K
    transposed within a block and head)."""

    @property
    def latent(self) -> bool:
        """One latent cache instead of K and V, with one "head" (MLA)."""
        return self.axes[0] is None

    @property
    def head_major(self) -> bool:
        """A block keeps each head's tokens together (``[head, token, dim]``)."""
        head = self.axes[3]
        return head is not None and head < self.axes[2]

    @property
    def ndim(self) -> int:
        return sum(axis is not None for axis in self.axes)

    def layer_shape(self, blocks: int, block_size: int, heads: int, dim: int) -> tuple[int, ...]:
        """The shape of one layer's tensor."""
        shape = [0] * self.ndim
        for axis, size in zip(self.axes, (2, blocks, block_size, heads, dim), strict=True):
            if axis is not None:
                shape[axis] = size
        return tuple(shape)

    def sizes(self, shape: tuple[int, ...]) -> tuple[int, int, int]:
        """``(num_blocks, num_heads, head_dim)`` of a layer tensor of ``shape`` (one head for
        a latent kind); ``ValueError`` if ``shape`` has the wrong number of axes."""
        if len(shape) != self.ndim:
            raise ValueError(f"a tensor of shape {shape} cannot have layout {self.name!r}")
        _, block, _, head, dim = self.axes
        return shape[block], 1 if head is None else shape[head], shape[dim]


LAYOUTS: MappingProxyType[str, LayoutKind] = MappingProxyType(
    {
        kind.name: kind
        for kind in (
            LayoutKind("flash_attn", (0, 1, 2, 3, 4)),  # (2, blocks, block_size, heads, dim)
            LayoutKind("flash_infer", (1, 0, 2, 3, 4)),  # (blocks, 2, block_size, heads, dim)
            LayoutKind("mla", (None, 0, 1, None, 2)),  # (blocks, block_size, dim)
            LayoutKind("cpu", (0, 1, 3, 2, 4)),  # (2, blocks, heads, block_size, dim)
            # (blocks, heads, 2, block_size, dim), K transposed per block and head
            LayoutKind("vllm_cpu", (2, 0, 3, 1, 4), strided=False),
        )
    }
)
"""Every layout kind kvtrio copies, by name (see ``_layouts.py`` for what each one is)."""


def layout_kind(name: str) -> LayoutKind:
    """The entry of ``name``; ``ValueError`` for an unknown kind."""
    kind = LAYOUTS.get(name)
    if kind is None:
        raise ValueError(f"unknown layout kind {name!r}: expected one of {', '.join(LAYOUTS)}")
    return kind
