"""Chunk keys: the documented algorithm, incremental chaining, namespaces, profiles."""

from __future__ import annotations

import hashlib
import struct

import pytest

from kvtrio.storage import HASH_SCHEME_TOKENS, ChunkChain, ModelProfile, namespace


def reference_token_hashes(tokens: list[int], chunk_size: int) -> list[bytes]:
    """docs/protocol.md, token mode, written out independently."""
    previous = hashlib.sha256(b"kvtrio/tokens/v1").digest()[:16]
    hashes = []
    for i in range(len(tokens) // chunk_size):
        chunk = tokens[i * chunk_size : (i + 1) * chunk_size]
        previous = hashlib.sha256(previous + struct.pack(f"<{chunk_size}I", *chunk)).digest()[:16]
        hashes.append(previous)
    return hashes


def test_token_chain_matches_the_documented_algorithm() -> None:
    tokens = list(range(1000, 1000 + 256 * 3 + 17))
    chain = ChunkChain(256)
    chain.extend_tokens(tokens)
    assert chain.hashes == reference_token_hashes(tokens, 256)
    assert chain.tokens_seen == len(tokens)


def test_token_chain_is_incremental_and_skips_what_it_has_seen() -> None:
    tokens = list(range(2000))
    whole = ChunkChain(64)
    whole.extend_tokens(tokens)
    pieces = ChunkChain(64)
    pieces.extend_tokens(tokens[:100])
    pieces.extend_tokens(tokens[:700])  # resent from the start
    pieces.extend_tokens(tokens[700:1500], start=700)
    pieces.extend_tokens(tokens[1400:], start=1400)  # overlapping
    assert pieces.hashes == whole.hashes
    with pytest.raises(ValueError, match="only 2000 are known"):
        pieces.extend_tokens([1, 2], start=2100)


def test_prefix_property() -> None:
    a, b = ChunkChain(16), ChunkChain(16)
    a.extend_tokens(list(range(64)))
    b.extend_tokens(list(range(48)) + [7] * 16)
    assert a.hashes[:3] == b.hashes[:3]
    assert a.hashes[3] != b.hashes[3]


def test_bad_tokens() -> None:
    chain = ChunkChain(4)
    with pytest.raises(OverflowError):
        chain.extend_tokens([1, -1, 2, 3])
    with pytest.raises(TypeError):
        chain.extend_tokens([1, "2", 3, 4])  # type: ignore[list-item]


def test_block_hash_chain_names_chunks_by_their_last_block() -> None:
    blocks = [bytes([i]) * 32 for i in range(10)]
    chain = ChunkChain(64)
    chain.extend_block_hashes(blocks[:5], blocks_per_chunk=4)
    assert len(chain.hashes) == 1
    chain.extend_block_hashes(blocks, blocks_per_chunk=4)
    expected = [hashlib.sha256(b"kvtrio/blocks/v1" + blocks[i]).digest()[:16] for i in (3, 7)]
    assert chain.hashes == expected


PROFILE = ModelProfile(HASH_SCHEME_TOKENS, 0, 32, 2, 1024, "float16", False)


def test_namespaces_separate_everything_that_matters() -> None:
    base = namespace("m", "", PROFILE, 2, 0)
    assert len(base) == 16
    assert base == namespace("m", "", PROFILE, 2, 0)
    others = [
        namespace("m2", "", PROFILE, 2, 0),
        namespace("m", "tenant", PROFILE, 2, 0),
        namespace("m", "", PROFILE, 4, 0),
        namespace("m", "", PROFILE, 2, 1),
        namespace(
            "m", "", ModelProfile(HASH_SCHEME_TOKENS, 0, 32, 2, 1024, "bfloat16", False), 2, 0
        ),
    ]
    assert base not in others
    assert len(set(others)) == len(others)
    shared = ModelProfile(HASH_SCHEME_TOKENS, 0, 32, 1, 576, "float16", True)
    assert namespace("m", "", shared, 2, 0) == namespace("m", "", shared, 2, 1)


def test_profile_differences_say_what_differs() -> None:
    other = ModelProfile("blocks/sha256/v1", 16, 32, 2, 1024, "bfloat16", False)
    assert PROFILE.differences(other) == [
        "hash_scheme: 'tokens/sha256-128/v1' vs 'blocks/sha256/v1'",
        "block_size: 0 vs 16",
        "dtype: 'float16' vs 'bfloat16'",
    ]
    assert PROFILE.differences(PROFILE) == []
    assert PROFILE.digest() != other.digest()
