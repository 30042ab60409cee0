"""KV events' encoding (vLLM's ``KVEventBatch``; decoded by vLLM's own classes in
``tests/integration/vllm/test_events.py``) and the store's ``block_hashes`` field."""

from __future__ import annotations

import msgpack
import pytest

from kvtrio.errors import ProtocolError
from kvtrio.protocol import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Store,
    decode_batch,
    decode_request,
    decode_seq,
    encode_batch,
    encode_request,
    encode_seq,
    event_block_hash,
    events_topic,
    replay_endpoint,
)


def test_a_batch_is_vllms_array_of_tagged_maps() -> None:
    events = [
        BlockStored((1, 2**64 - 1), None, (), 16, "CPU"),
        BlockRemoved((b"ab",), "disk"),
        AllBlocksCleared(),
    ]
    raw = msgpack.unpackb(encode_batch(1.5, events))
    assert raw[0] == 1.5
    assert raw[2] is None  # data_parallel_rank
    assert raw[1][0] == {
        "type": "BlockStored",
        "block_hashes": [1, 2**64 - 1],
        "parent_block_hash": None,
        "token_ids": [],
        "block_size": 16,
        "lora_id": None,
        "medium": "CPU",
        "lora_name": None,
    }
    assert raw[1][1] == {"type": "BlockRemoved", "block_hashes": [b"ab"], "medium": "disk"}
    assert raw[1][2] == {"type": "AllBlocksCleared"}
    assert decode_batch(encode_batch(1.5, events)).events == tuple(events)


def test_decoding_refuses_what_is_no_batch() -> None:
    with pytest.raises(ValueError, match="KVEventBatch"):
        decode_batch(msgpack.packb({"ts": 1}))
    with pytest.raises(ValueError, match="unknown event type"):
        decode_batch(msgpack.packb([0.0, [{"type": "Nope"}]]))


def test_topics_sequences_and_replay_endpoints() -> None:
    assert events_topic("acme") == b"kvtrio/acme/"
    assert events_topic("") == b"kvtrio//"
    assert decode_seq(encode_seq(7)) == 7
    assert decode_seq((-1).to_bytes(8, "big", signed=True)) == -1
    assert replay_endpoint("tcp://127.0.0.1:5580") == "tcp://127.0.0.1:5581"
    assert replay_endpoint("tcp://127.0.0.1:0") == "tcp://127.0.0.1:0"
    assert replay_endpoint("ipc:///run/ev") == "ipc:///run/ev.replay"


def test_event_block_hashes_as_vllm_converts_them() -> None:
    digest = bytes(range(32))
    assert event_block_hash(digest) == int.from_bytes(digest[-8:], "big")
    assert event_block_hash(digest, as_int=False) == digest


def test_a_store_carries_block_hashes_within_bounds() -> None:
    store = Store("r", 0, 256, (b"x" * 16,), block_hashes=(1, b"ab", 2**64 - 1))
    assert decode_request("store", encode_request(1, store)[1]) == store
    for bad in ((-1,), (b"x" * 65,), ("s",)):  # (2**64 does not even pack)
        body = encode_request(1, Store("r", 0, 256, (b"x" * 16,), block_hashes=bad))[1]  # type: ignore[arg-type]
        with pytest.raises(ProtocolError, match="block hashes"):
            decode_request("store", body)


def test_a_stored_event_with_packed_tokens_is_the_map_of_its_wire() -> None:
    """The packed path (the server's: tokens spliced in, the rest packed as two arrays whose
    headers are cut off) gives the map ``wire()`` gives, every optional field included, in the
    same order, and decodes back to the event."""
    from kvtrio.protocol import PackedTokens, msgpack_uint32s, pack_tokens

    tokens = PackedTokens.of(msgpack_uint32s(pack_tokens(range(32))))
    few = BlockStored((7,), 6, tokens, 32, "CPU", locality="LOCAL")
    every = BlockStored(
        (1, 2), b"p", tokens, 16, "STORAGE", None, "adapter", (("adapter", ("mm", 3)), None),
        0, "full_attention", 128, "REMOTE", "s3",
    )  # fmt: skip
    for event in (few, every):
        raw = msgpack.unpackb(encode_batch(2.0, [event]), strict_map_key=False)
        plain = {**event.wire(), "token_ids": list(range(32))}
        assert list(raw[1][0].items()) == list(plain.items())
        assert decode_batch(encode_batch(2.0, [event])).events == (event,)
