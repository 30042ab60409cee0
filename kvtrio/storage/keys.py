"""Chunk keys: what names a chunk of KV cache, and in which namespace it lives.

A chunk is ``chunk_size`` consecutive tokens; only full chunks are cached. Its *chunk hash*
names it and, through a prefix chain, everything before it:

* token mode: ``h[-1] = SHA-256("kvtrio/tokens/v1")[:16]`` and
  ``h[i] = SHA-256(h[i-1] ‖ tokens of chunk i as little-endian uint32)[:16]``;
* hash mode: the engine sends its own prefix-chained block hashes; the chunk ends at block
  ``(i + 1) * blocks_per_chunk - 1`` and ``h[i] = SHA-256("kvtrio/blocks/v1" ‖ that block's
  hash)[:16]``.

An object key is ``namespace ‖ chunk hash`` (32 bytes). The namespace separates models, KV
formats, hash schemes, world sizes, ranks and tenants (see :func:`namespace`), so two engines
share an object exactly when they would compute the same KV for it.

SHA-256 (truncated to 128 bits) rather than a faster non-cryptographic hash: on this machine it
costs 1.7 µs per chunk against 6 µs for packing the chunk's 256 token ids, and a shared cache
must not let a crafted prompt collide with someone else's prefix (vLLM moved its prefix-cache
hash to SHA-256 for the same reason). The exact algorithm is in ``docs/protocol.md``.

Since protocol version 2 the *client* computes the chunk hashes (they travel in every lookup,
store and retrieve) and the server only adds the namespace of the sender's registration, so the
keys of an operation always come from the prompt of that operation.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

import attrs
import msgpack

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

HASH_SCHEME_TOKENS = "tokens/sha256-128/v1"
"""The hash scheme of token mode."""
KEY_SIZE = 32
"""Bytes in an object key: 16 of namespace, 16 of chunk hash."""

_TOKEN_ROOT = hashlib.sha256(b"kvtrio/tokens/v1").digest()[:16]
_BLOCK_PREFIX = b"kvtrio/blocks/v1"


def block_hash_scheme(engine_hash: str) -> str:
    """The hash scheme of hash mode with the engine's block hash function ``engine_hash``."""
    return f"blocks/{engine_hash}/v1"


def _sha128(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()[:16]


def token_chunk_hashes(tokens: Sequence[int], chunk_size: int) -> list[bytes]:
    """The chunk hashes of every full chunk of the prompt ``tokens`` (token mode).

    A pure function of the tokens: the same prompt always gives the same keys, a different
    prompt different ones from its first differing chunk on. Raises ``OverflowError`` /
    ``TypeError`` for token ids that are not integers in ``[0, 2**32)``.
    """
    full = len(tokens) // chunk_size
    end = full * chunk_size
    # Each chunk's tokens hashed straight from the packed array: no copy of the prompt's bytes
    # and none per chunk (128 chunks: 480 µs against 900 µs with slices and concatenations).
    data = memoryview(array("I", tokens if len(tokens) == end else tokens[:end]))
    sha256 = hashlib.sha256
    previous = _TOKEN_ROOT
    hashes = []
    for start in range(0, end, chunk_size):
        digest = sha256(previous)
        digest.update(data[start : start + chunk_size])
        previous = digest.digest()[:16]
        hashes.append(previous)
    return hashes


def block_chunk_hashes(block_hashes: Sequence[bytes], blocks_per_chunk: int) -> list[bytes]:
    """The chunk hashes of every full chunk, from the engine's prefix-chained block hashes
    (hash mode): chunk ``i`` is named by the hash of its last block."""
    return [
        _sha128(_BLOCK_PREFIX + block_hashes[(i + 1) * blocks_per_chunk - 1])
        for i in range(len(block_hashes) // blocks_per_chunk)
    ]


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
    owner = -1 if profile.shared_across_ranks else rank
    packed = msgpack.packb(["kvtrio/ns/v1", model, tenant, profile.digest(), world_size, owner])
    return _sha128(packed)


def object_key(space: bytes, chunk_hash: bytes) -> bytes:
    return space + chunk_hash
