"""What a worker's stores and retrieves carry to name their chunks in the server's KV events
(issue 35): the engine's block hashes and the blocks' tokens, for exactly their blocks."""

from __future__ import annotations

from kvtrio.client._copies import Span
from kvtrio.protocol import MAX_EVENT_TOKENS, PackedTokens, msgpack_uint32s, pack_tokens


def span(**fields: object) -> Span:
    tokens = list(range(1000, 1000 + 40))  # 10 blocks of 4, chunks of 8 tokens (2 blocks)
    return Span(
        "r", 1, tuple(bytes([i]) * 16 for i in range(1, 5)), b"p" * 16, 8, 64, 2,
        list(range(10)), stop_block=9, event_hashes=tuple(range(2, 10)), event_first=2,
        prompt_tokens=tokens, **fields,  # type: ignore[arg-type]
    )  # fmt: skip


def test_a_store_batch_carries_its_blocks_names_and_tokens() -> None:
    store = span().store(range(1, 3))  # chunks 2 and 3: blocks 4…7
    assert store.block_hashes == (4, 5, 6, 7)
    assert store.token_ids == pack_tokens(range(1016, 1032))


def test_a_retrieve_carries_its_chunks_names_up_to_the_last_block_moved() -> None:
    retrieve = span().retrieve(1)  # chunks 2…4, blocks 4…8 (stop_block 9)
    assert retrieve.block_hashes == (4, 5, 6, 7, 8)
    assert retrieve.token_ids == pack_tokens(range(1016, 1036))


def test_packed_tokens_are_the_ids() -> None:
    ids = [0, 1, 2**32 - 1, 70_000]
    packed = PackedTokens.of(msgpack_uint32s(pack_tokens(ids)))
    assert list(packed) == ids
    assert len(packed) == 4
    assert MAX_EVENT_TOKENS * 4 < 1 << 20
