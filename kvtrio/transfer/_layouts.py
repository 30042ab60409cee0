"""Layout descriptors: the shape of an engine's paged KV cache, and of the canonical chunk.

An engine keeps one KV tensor per layer, cut into blocks of ``block_size`` tokens; the order of
the axes depends on the attention backend (the *kind*):

==============  ===================================================
``flash_attn``  ``(2, num_blocks, block_size, num_heads, head_dim)``
``flash_infer`` ``(num_blocks, 2, block_size, num_heads, head_dim)``
``mla``         ``(num_blocks, block_size, head_dim)`` (one latent "head", no separate V)
``cpu``         ``(2, num_blocks, num_heads, block_size, head_dim)`` (vLLM's CPU backend
                up to 0.31)
``vllm_cpu``    ``(num_blocks, num_heads, 2, block_size, head_dim)`` (vLLM's CPU backend
                from 0.32: its connectors see ``[num_blocks, heads, block_size, 2 * head_dim]``
                views; per block and head its kernels keep K first, *transposed*
                (``[head_dim, block_size]``), then V as ``[block_size, head_dim]``: checked
                against vllm-cpu 0.32.0's ``vec`` and ``vec16`` kernels)
==============  ===================================================

L1 stores every chunk in one **canonical format**, whatever the kind: a C-contiguous array of
shape ``(num_layers, kv, chunk_tokens, num_heads * head_dim)`` whose element ``[l, k, t, h *
head_dim + d]`` is layer ``l``, K (``k = 0``) or V (``k = 1``), head ``h``, dim ``d`` of the
chunk's token ``t``. Token ``t`` lives in engine block ``block_ids[t // block_size]`` at offset
``t % block_size``. Engines whose layouts have equal :meth:`KVLayout.canonical` descriptions can
therefore share chunks. This module only describes shapes; the copies are in :mod:`._cpu`.
"""

from __future__ import annotations

import functools
from types import MappingProxyType
from typing import Any

import attrs

from ._kinds import LAYOUTS, LayoutKind, layout_kind

__all__ = ["DTYPE_SIZES", "LAYOUT_KINDS", "ChunkFormat", "KVLayout"]

DTYPE_SIZES: MappingProxyType[str, int] = MappingProxyType(
    {
        "float16": 2,
        "bfloat16": 2,
        "float32": 4,
        "float8_e4m3fn": 1,
        "float8_e5m2": 1,
        "uint8": 1,
        "int8": 1,
    }
)
"""Bytes per element of every KV dtype kvtrio knows (names as torch spells them)."""

LAYOUT_KINDS: tuple[str, ...] = tuple(LAYOUTS)
"""The per-layer KV tensor layouts kvtrio can copy from and to (:data:`._kinds.LAYOUTS`)."""


def _check_kind(_instance: Any, _attribute: Any, value: Any) -> None:
    layout_kind(value)


def _check_dtype(_instance: Any, _attribute: Any, value: Any) -> None:
    if value not in DTYPE_SIZES:
        raise ValueError(f"unknown KV dtype {value!r}: expected one of {', '.join(DTYPE_SIZES)}")


def _check_positive(_instance: Any, attribute: attrs.Attribute[int], value: Any) -> None:
    if type(value) is not int or value < 1:
        raise ValueError(f"{attribute.name} must be a positive int, got {value!r}")


@attrs.frozen
class ChunkFormat:
    """The canonical chunk format of a model shape: what two engines must agree on to share.

    A chunk of ``chunk_tokens`` tokens is a C-contiguous array of shape ``(num_layers, kv,
    chunk_tokens, row_elements)`` of ``dtype``. Hashable; compare with ``==``.
    """

    num_layers: int
    kv: int
    row_elements: int
    dtype: str


@attrs.frozen
class KVLayout:
    """The layout of one engine rank's paged KV cache: one tensor per layer of :attr:`layer_shape`.

    Raises ``ValueError`` on construction if a field is invalid (unknown kind or dtype, a size
    that is not a positive int, or ``num_heads != 1`` for ``mla``).
    """

    kind: str = attrs.field(validator=_check_kind)
    """One of :data:`LAYOUT_KINDS`."""
    num_layers: int = attrs.field(validator=_check_positive)
    num_blocks: int = attrs.field(validator=_check_positive)
    block_size: int = attrs.field(validator=_check_positive)
    """Tokens per engine block."""
    num_heads: int = attrs.field(validator=_check_positive)
    """KV heads on this rank; 1 for ``mla``."""
    head_dim: int = attrs.field(validator=_check_positive)
    """Elements per head; for ``mla`` the latent dim (kv_lora_rank + rope dim)."""
    dtype: str = attrs.field(validator=_check_dtype)
    """Element type, one of :data:`DTYPE_SIZES` (arrays may hold it as a same-size integer)."""

    def __attrs_post_init__(self) -> None:
        if self.kind_entry.latent and self.num_heads != 1:
            raise ValueError(
                f"an {self.kind} layout has one latent head: num_heads must be 1, got "
                f"{self.num_heads} (put the latent dim in head_dim)"
            )

    @functools.cached_property
    def kind_entry(self) -> LayoutKind:
        """The registry entry of :attr:`kind`."""
        return LAYOUTS[self.kind]

    @property
    def element_size(self) -> int:
        """Bytes per element."""
        return DTYPE_SIZES[self.dtype]

    @property
    def kv(self) -> int:
        """2 (separate K and V tensors) or 1 (``mla``: one latent cache)."""
        return 1 if self.kind_entry.latent else 2

    @property
    def row_elements(self) -> int:
        """Elements per token, per layer and per K/V: ``num_heads * head_dim``."""
        return self.num_heads * self.head_dim

    @functools.cached_property
    def layer_shape(self) -> tuple[int, ...]:
        """The shape of each layer's KV tensor."""
        return self.kind_entry.layer_shape(
            self.num_blocks, self.block_size, self.num_heads, self.head_dim
        )

    @functools.cached_property
    def head_major(self) -> bool:
        """Whether a block keeps each head's tokens together (``[head, token, dim]``), unlike
        the token-major canonical chunk: then only ``head_dim`` elements are contiguous in both."""
        return self.kind_entry.head_major

    @property
    def layer_nbytes(self) -> int:
        """Bytes of each layer's KV tensor."""
        return self.num_blocks * self.block_size * self.kv * self.row_elements * self.element_size

    def chunk_shape(self, chunk_tokens: int) -> tuple[int, int, int, int]:
        """Shape of a canonical chunk of ``chunk_tokens`` tokens: ``(layers, kv, tokens, row)``.

        ``chunk_tokens`` must be a positive multiple of ``block_size`` (only whole blocks are
        copied); ``ValueError`` otherwise.
        """
        if type(chunk_tokens) is not int or chunk_tokens < 1 or chunk_tokens % self.block_size:
            raise ValueError(
                f"chunk_tokens must be a positive multiple of the block size {self.block_size}, "
                f"got {chunk_tokens!r}"
            )
        return (self.num_layers, self.kv, chunk_tokens, self.row_elements)

    def chunk_nbytes(self, chunk_tokens: int) -> int:
        """Bytes of a canonical chunk of ``chunk_tokens`` tokens (see :meth:`chunk_shape`)."""
        layers, kv, tokens, row = self.chunk_shape(chunk_tokens)
        return layers * kv * tokens * row * self.element_size

    def canonical(self) -> ChunkFormat:
        """The canonical chunk format of this layout.

        Independent of ``kind``, ``num_blocks`` and ``block_size``: engines whose layouts have
        equal canonical formats lay out a chunk's bytes identically and can share chunks.
        """
        return ChunkFormat(
            num_layers=self.num_layers, kv=self.kv, row_elements=self.row_elements, dtype=self.dtype
        )
