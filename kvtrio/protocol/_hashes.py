"""Chunk hashes: how a client names the chunks of a prompt on the wire.

A chunk is ``chunk_size`` consecutive tokens; only full chunks are cached. Its *chunk hash*
names it and, through a prefix chain, everything before it:

* token mode: ``h[-1] = SHA-256("kvtrio/tokens/v1")[:16]`` and
  ``h[i] = SHA-256(h[i-1] ‖ tokens of chunk i as little-endian uint32)[:16]``;
* hash mode: the engine sends its own prefix-chained block hashes; the chunk ends at block
  ``(i + 1) * blocks_per_chunk - 1`` and ``h[i] = SHA-256("kvtrio/blocks/v1" ‖ that block's
  hash)[:16]``.

Since protocol version 2 the *client* computes the chunk hashes (they travel in every lookup,
store and retrieve, and the hash scheme in every registration), so they belong to the protocol;
the server adds the namespace of the sender's registration (:mod:`kvtrio.storage.keys`).

SHA-256 (truncated to 128 bits) rather than a faster non-cryptographic hash: on this machine it
costs 1.7 µs per chunk against 6 µs for packing the chunk's 256 token ids, and a shared cache
must not let a crafted prompt collide with someone else's prefix (vLLM moved its prefix-cache
hash to SHA-256 for the same reason). The exact algorithm is in ``docs/protocol.md``.

**The tail.** A prompt rarely ends on a chunk boundary, and the engine must compute only its
last token: the whole engine blocks after the prompt's last full chunk form its *partial chunk*,
named apart from any full chunk (``SHA-256("kvtrio/tokens/partial/v1" ‖ h[i-1] ‖ its tokens)``,
or ``SHA-256("kvtrio/blocks/partial/v1" ‖ its last block's hash)`` in hash mode). It is stored
like a chunk, in the same format (its blocks first, the rest of the chunk zeros), so a hit can
reach the prompt's last whole block instead of its last full chunk. :class:`PromptChunks` is
what a client looks up, stores and retrieves for one prompt.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

import attrs

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "HASH_SCHEME_TOKENS",
    "PromptChunks",
    "as_block_hashes",
    "block_chunk_hashes",
    "block_hash_scheme",
    "chunk_hashes",
    "prompt_chunks",
    "token_chunk_hashes",
]

DEFAULT_CHUNK_SIZE = 256
"""Tokens per chunk of a server not told otherwise (``hello`` says what a server uses)."""

HASH_SCHEME_TOKENS = "tokens/sha256-128/v1"
"""The hash scheme of token mode."""

_TOKEN_ROOT = hashlib.sha256(b"kvtrio/tokens/v1").digest()[:16]
_BLOCK_PREFIX = b"kvtrio/blocks/v1"
_TOKEN_PARTIAL = b"kvtrio/tokens/partial/v1"
_BLOCK_PARTIAL = b"kvtrio/blocks/partial/v1"


def block_hash_scheme(engine_hash: str) -> str:
    """The hash scheme of hash mode with the engine's block hash function ``engine_hash``."""
    return f"blocks/{engine_hash}/v1"


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


def block_chunk_hashes(block_hashes: Sequence[bytes | int], blocks_per_chunk: int) -> list[bytes]:
    """The chunk hashes of every full chunk, from the engine's prefix-chained block hashes
    (hash mode): chunk ``i`` is named by the hash of its last block."""
    full = len(block_hashes) // blocks_per_chunk
    return _named(block_hashes[blocks_per_chunk - 1 : full * blocks_per_chunk : blocks_per_chunk])


def _named(ends: Sequence[bytes | int]) -> list[bytes]:
    """The chunk hashes of chunks whose last blocks have the engine hashes ``ends``: only
    those are read (a 128-chunk prompt of 16-token blocks has 2048 block hashes, 128 ends)."""
    sha256 = hashlib.sha256
    return [sha256(_BLOCK_PREFIX + h).digest()[:16] for h in as_block_hashes(ends)]


def as_block_hashes(hashes: Sequence[bytes | int]) -> tuple[bytes, ...]:
    """Engine block hashes as bytes: ints (older vLLM, trace ids) become 16-byte little-endian
    two's complement."""
    return tuple(
        h if isinstance(h, bytes) else int(h).to_bytes(16, "little", signed=True) for h in hashes
    )


@attrs.frozen
class PromptChunks:
    """The chunks of one prompt as a client names them: its full chunks, then its partial
    chunk (the whole blocks after the last full chunk) when it has one."""

    hashes: tuple[bytes, ...]
    """Chunk hashes, in prompt order; the last one is the partial chunk's if ``tail_blocks``."""
    chunk_size: int
    block_size: int
    tail_blocks: int = 0
    """Engine blocks in the partial chunk (0: every chunk is full)."""

    @property
    def full(self) -> int:
        """The number of full chunks."""
        return len(self.hashes) - (1 if self.tail_blocks else 0)

    @property
    def tokens(self) -> int:
        """The tokens all the chunks cover."""
        return self.covered(len(self.hashes))

    def covered(self, chunks: int) -> int:
        """The tokens the first ``chunks`` chunks cover (a lookup's hit in tokens)."""
        chunks = max(0, min(chunks, len(self.hashes)))
        if chunks > self.full:
            return self.full * self.chunk_size + self.tail_blocks * self.block_size
        return chunks * self.chunk_size

    def blocks_in(self, chunk: int) -> int:
        """Engine blocks chunk ``chunk`` holds (the partial chunk fewer than a full one)."""
        return (
            self.tail_blocks
            if chunk == self.full and self.tail_blocks
            else (self.chunk_size // self.block_size)
        )

    def limited(self, chunks: int) -> PromptChunks:
        """The first ``chunks`` chunks (a lookup within the server's bounds)."""
        if chunks >= len(self.hashes):
            return self
        return PromptChunks(self.hashes[: max(0, chunks)], self.chunk_size, self.block_size)


def prompt_chunks(
    chunk_size: int,
    block_size: int,
    *,
    token_ids: Sequence[int] | None = None,
    block_hashes: Sequence[bytes | int] | None = None,
    tail: bool = True,
) -> PromptChunks:
    """The chunks of a prompt, from its engine block hashes (hash mode, preferred when given)
    or its token ids; with ``tail``, its partial chunk too (whole blocks of ``block_size``
    tokens after the last full chunk, when there is at least one).

    Raises ``ValueError`` when neither is given or the chunk size is not a multiple of the
    block size, ``TypeError``/``OverflowError`` for token ids that are not integers in
    ``[0, 2**32)``.
    """
    if block_size <= 0 or chunk_size % block_size:
        raise ValueError(f"chunk size {chunk_size} is not a multiple of block size {block_size}")
    per_chunk = chunk_size // block_size
    if block_hashes is not None:
        hashes = block_chunk_hashes(block_hashes, per_chunk)
        tail_blocks = len(block_hashes) - len(hashes) * per_chunk if tail else 0
        if tail_blocks:
            (last,) = as_block_hashes([block_hashes[len(hashes) * per_chunk + tail_blocks - 1]])
            hashes.append(hashlib.sha256(_BLOCK_PARTIAL + last).digest()[:16])
        return PromptChunks(tuple(hashes), chunk_size, block_size, tail_blocks)
    if token_ids is None:
        raise ValueError("the prompt's token ids or block hashes are needed")
    hashes = token_chunk_hashes(token_ids, chunk_size)
    full_end = len(hashes) * chunk_size
    tail_blocks = (len(token_ids) - full_end) // block_size if tail else 0
    if tail_blocks:
        digest = hashlib.sha256(_TOKEN_PARTIAL)
        digest.update(hashes[-1] if hashes else _TOKEN_ROOT)
        digest.update(array("I", token_ids[full_end : full_end + tail_blocks * block_size]))
        hashes.append(digest.digest()[:16])
    return PromptChunks(tuple(hashes), chunk_size, block_size, tail_blocks)


def chunk_hashes(
    chunk_size: int,
    block_size: int,
    *,
    token_ids: Sequence[int] | None = None,
    block_hashes: Sequence[bytes | int] | None = None,
    end: int | None = None,
) -> list[bytes]:
    """The chunk hashes of the full chunks of the prompt's first ``end`` tokens (all of it by
    default), from its engine block hashes (hash mode, preferred when given) or its token ids.

    Raises ``ValueError`` when neither is given, ``TypeError``/``OverflowError`` for token ids
    that are not integers in ``[0, 2**32)``.
    """
    if block_hashes is not None:
        blocks = as_block_hashes(block_hashes if end is None else block_hashes[: end // block_size])
        return block_chunk_hashes(blocks, max(1, chunk_size // block_size))
    if token_ids is not None:
        return token_chunk_hashes(token_ids if end is None else token_ids[:end], chunk_size)
    raise ValueError("the prompt's token ids or block hashes are needed")
