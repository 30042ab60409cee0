"""One lookup for every KV cache group (:mod:`kvtrio.client._grouped`): what it asks for and
how a server's answer (leading hashes held) becomes the hit every group serves."""

from __future__ import annotations

import pytest

from kvtrio.client._grouped import grouped_chunks

CHUNK, BLOCK = 64, 16


def hashes(group: int, blocks: int) -> list[bytes]:
    return [bytes([group, b]) * 8 for b in range(blocks)]


def test_groups_are_asked_position_by_position_and_windows_only_at_the_end() -> None:
    full, window = hashes(0, 20), hashes(1, 20)  # 5 chunks of 4 blocks
    chunks = grouped_chunks(CHUNK, BLOCK, [(full, 0), (window, 4 * CHUNK - 1)])
    # positions 0-2: the full group only; 3 and 4: both (the window's last 65 tokens)
    assert len(chunks.hashes) == 5 + 2
    assert chunks.covered(len(chunks.hashes)) == 5 * CHUNK
    assert chunks.covered(3) == 3 * CHUNK  # position 3 is not whole
    assert chunks.covered(4) == 3 * CHUNK
    assert chunks.covered(5) == 4 * CHUNK
    assert chunks.covered(0) == 0


def test_every_group_holds_a_prefix_hit() -> None:
    chunks = grouped_chunks(CHUNK, BLOCK, [(hashes(0, 8), 0), (hashes(1, 8), 0)])
    assert chunks.hashes[:2] == (
        grouped_chunks(CHUNK, BLOCK, [(hashes(0, 8), 0)]).hashes[0],
        grouped_chunks(CHUNK, BLOCK, [(hashes(1, 8), 0)]).hashes[0],
    )
    assert [chunks.covered(n) for n in range(5)] == [0, 0, CHUNK, CHUNK, 2 * CHUNK]


def test_a_state_group_makes_a_hit_all_or_nothing() -> None:
    chunks = grouped_chunks(CHUNK, BLOCK, [(hashes(0, 10), 0)], state=hashes(2, 10))
    # 2 full chunks, the partial chunk of 2 blocks, then the state at token 160
    assert len(chunks.hashes) == 4
    assert chunks.covered(4) == 160
    assert [chunks.covered(n) for n in range(4)] == [0, 0, 0, 0]
    assert chunks.limited(3).hashes == ()  # beyond the server's bounds: no state, no hit


def test_a_limited_lookup_keeps_whole_positions() -> None:
    chunks = grouped_chunks(CHUNK, BLOCK, [(hashes(0, 20), 0), (hashes(1, 20), 4 * CHUNK)])
    limited = chunks.limited(5)
    assert len(limited.hashes) == 4  # two whole positions of both groups
    assert limited.covered(4) == 2 * CHUNK


def test_a_lookup_needs_a_group() -> None:
    with pytest.raises(ValueError, match="at least one group"):
        grouped_chunks(CHUNK, BLOCK, [])
