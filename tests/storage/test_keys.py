"""Chunk keys: the documented algorithm, incremental chaining, namespaces, profiles."""

from __future__ import annotations

import hashlib
import struct

import pytest

from kvtrio.storage import (
    HASH_SCHEME_TOKENS,
    ModelProfile,
    block_chunk_hashes,
    namespace,
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
