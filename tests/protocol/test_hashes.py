"""Chunk hashes (the wire's names of a prompt's chunks): the documented algorithm, chaining."""

from __future__ import annotations

import hashlib
import struct

import pytest

import kvtrio.storage
from kvtrio.protocol import (
    HASH_SCHEME_TOKENS,
    block_chunk_hashes,
    block_hash_scheme,
    token_chunk_hashes,
)


def reference_token_hashes(tokens: list[int], chunk_size: int) -> list[bytes]:
    """docs/protocol.md, token mode, written out independently."""
    previous = hashlib.sha256(b"kvtrio/tokens/v1").digest()[:16]
    hashes = []
    for i in range(len(tokens) // chunk_size):
        chunk = tokens[i * chunk_size : (i + 1) * chunk_size]
        previous = hashlib.sha256(previous + struct.pack(f"<{chunk_size}I", *chunk)).digest()[:16]
        hashes.append(previous)
    return hashes


def test_the_token_scheme_has_its_documented_wire_name() -> None:
    """The one literal of the suite: every other test names the scheme by this constant."""
    assert HASH_SCHEME_TOKENS == "tokens/sha256-128/v1"  # docs/protocol.md, token mode


def test_token_chain_matches_the_documented_algorithm() -> None:
    tokens = list(range(1000, 1000 + 256 * 3 + 17))
    assert token_chunk_hashes(tokens, 256) == reference_token_hashes(tokens, 256)


def test_token_chain_depends_on_every_token_it_covers() -> None:
    """The keys are a pure function of the prompt: no state remembers an earlier prompt."""
    tokens = list(range(2000))
    whole = token_chunk_hashes(tokens, 64)
    assert token_chunk_hashes(tokens[:700], 64) == whole[: 700 // 64]
    changed = list(tokens)
    changed[650] = 7
    other = token_chunk_hashes(changed, 64)
    assert other[:10] == whole[:10]
    assert all(a != b for a, b in zip(other[10:], whole[10:], strict=True))


def test_prefix_property() -> None:
    a = token_chunk_hashes(list(range(64)), 16)
    b = token_chunk_hashes(list(range(48)) + [7] * 16, 16)
    assert a[:3] == b[:3]
    assert a[3] != b[3]


def test_bad_tokens() -> None:
    with pytest.raises(OverflowError):
        token_chunk_hashes([1, -1, 2, 3], 4)
    with pytest.raises(TypeError):
        token_chunk_hashes([1, "2", 3, 4], 4)  # type: ignore[list-item]


def test_block_hash_chain_names_chunks_by_their_last_block() -> None:
    blocks = [bytes([i]) * 32 for i in range(10)]
    assert len(block_chunk_hashes(blocks[:5], blocks_per_chunk=4)) == 1
    expected = [hashlib.sha256(b"kvtrio/blocks/v1" + blocks[i]).digest()[:16] for i in (3, 7)]
    assert block_chunk_hashes(blocks, blocks_per_chunk=4) == expected


def test_storage_still_exports_the_hash_functions() -> None:
    """They lived in kvtrio.storage.keys until issue 14; plugins may import them from there."""
    assert kvtrio.storage.token_chunk_hashes is token_chunk_hashes
    assert kvtrio.storage.block_chunk_hashes is block_chunk_hashes
    assert kvtrio.storage.block_hash_scheme("x") == block_hash_scheme("x") == "blocks/x/v1"


def test_the_partial_chunk_follows_the_documented_algorithm() -> None:
    """docs/protocol.md: the whole blocks after the last full chunk, named apart."""
    from kvtrio.protocol import prompt_chunks

    tokens = list(range(1000, 1000 + 256 * 2 + 3 * 32 + 5))
    chunks = prompt_chunks(256, 32, token_ids=tokens)
    full = reference_token_hashes(tokens, 256)
    tail = tokens[512 : 512 + 96]
    expected = hashlib.sha256(
        b"kvtrio/tokens/partial/v1" + full[-1] + struct.pack("<96I", *tail)
    ).digest()[:16]
    assert chunks.hashes == (*full, expected)
    assert (chunks.full, chunks.tail_blocks, chunks.tokens) == (2, 3, 608)
    assert [chunks.covered(n) for n in range(4)] == [0, 256, 512, 608]
    assert [chunks.blocks_in(i) for i in range(3)] == [8, 8, 3]
    # Another number of whole blocks, or none, or a prompt shorter than a chunk.
    assert prompt_chunks(256, 32, token_ids=tokens[:-40]).hashes[-1] != expected
    assert prompt_chunks(256, 32, token_ids=tokens[:540]).hashes == tuple(full)
    short = prompt_chunks(256, 32, token_ids=tokens[:70])
    root = hashlib.sha256(b"kvtrio/tokens/v1").digest()[:16]
    assert short.hashes == (
        hashlib.sha256(
            b"kvtrio/tokens/partial/v1" + root + struct.pack("<64I", *tokens[:64])
        ).digest()[:16],
    )
    assert prompt_chunks(256, 32, token_ids=tokens, tail=False).hashes == tuple(full)
    assert chunks.limited(2).hashes == tuple(full)
    assert chunks.limited(2).tail_blocks == 0


def test_the_partial_chunk_in_hash_mode_is_named_by_its_last_block() -> None:
    from kvtrio.protocol import prompt_chunks

    blocks = [bytes([i]) * 16 for i in range(8 * 2 + 5)]
    chunks = prompt_chunks(256, 32, block_hashes=blocks)
    assert chunks.hashes[:2] == tuple(block_chunk_hashes(blocks, 8))
    assert (
        chunks.hashes[2] == hashlib.sha256(b"kvtrio/blocks/partial/v1" + blocks[-1]).digest()[:16]
    )
    assert chunks.tail_blocks == 5
    with pytest.raises(ValueError, match="multiple"):
        prompt_chunks(250, 32, token_ids=[1])
