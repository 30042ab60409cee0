"""Chunk keys: in which namespace a chunk lives, and the object key that names it there.

The client names the chunks of a prompt by their *chunk hashes* (:mod:`kvtrio.protocol`, which
travel on the wire; re-exported here, where they lived until issue 14). An object key is
``namespace ‖ chunk hash`` (32 bytes). The namespace separates models, KV formats, hash
schemes, world sizes, ranks and tenants (see :func:`namespace`), so two engines share an
object exactly when they would compute the same KV for it. The server adds the namespace of the
sender's registration, so the keys of an operation always come from the prompt of that
operation.
"""

from __future__ import annotations

import hashlib

import attrs
import msgpack

from ..protocol import (
    HASH_SCHEME_TOKENS,
    block_chunk_hashes,
    block_hash_scheme,
    token_chunk_hashes,
)

__all__ = [
    "HASH_SCHEME_TOKENS",
    "KEY_SIZE",
    "ModelProfile",
    "block_chunk_hashes",
    "block_hash_scheme",
    "namespace",
    "object_key",
    "token_chunk_hashes",
]

KEY_SIZE = 32
"""Bytes in an object key: 16 of namespace, 16 of chunk hash."""


def _sha128(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()[:16]


@attrs.frozen
class ModelProfile:
    """What must agree between all engines sharing a model's cached chunks.

    The fingerprint of a registration. Engines of one model whose profiles differ would compute
    different keys or read each other's bytes wrongly, so the server refuses the second one and
    :meth:`differences` says why.
    """

    hash_scheme: str
    block_size: int
    """Engine block size; part of the profile only in hash mode (0 in token mode)."""
    num_layers: int
    kv: int
    """2 (separate K and V) or 1 (MLA latent cache)."""
    row_elements: int
    """Elements per token per layer and per K/V: heads × head dim (the latent dim for MLA)."""
    dtype: str
    shared_across_ranks: bool
    """All ranks hold the same KV (MLA): one object per chunk, read by every rank."""

    def digest(self) -> bytes:
        return _sha128(msgpack.packb(attrs.astuple(self)))

    def differences(self, other: ModelProfile) -> list[str]:
        """Human-readable ``field: mine vs theirs`` for every field that differs."""
        return [
            f"{a.name}: {getattr(self, a.name)!r} vs {getattr(other, a.name)!r}"
            for a in attrs.fields(ModelProfile)
            if getattr(self, a.name) != getattr(other, a.name)
        ]


def namespace(model: str, tenant: str, profile: ModelProfile, world_size: int, rank: int) -> bytes:
    """The 16-byte namespace of rank ``rank``'s objects (ranks share one when the profile says
    so)."""
    ranks = -1 if profile.shared_across_ranks else rank  # -1: every rank's
    packed = msgpack.packb(["kvtrio/ns/v1", model, tenant, profile.digest(), world_size, ranks])
    return _sha128(packed)


def object_key(space: bytes, chunk_hash: bytes) -> bytes:
    return space + chunk_hash
