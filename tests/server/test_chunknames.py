"""The names kept beside a chunk in the L2 (``server/_chunknames.py``) and what the announcer
does with them (issue 35: a restarted server announces an earlier one's chunks under them)."""

from __future__ import annotations

import msgpack
import pytest

from kvtrio.protocol import BlockStored, KVEvent, Store, encode_request, pack_tokens
from kvtrio.server._announce import Announcer, l2_tiers
from kvtrio.server._chunknames import decode_names

SPACE = b"s" * 16


def key(n: int) -> bytes:
    return SPACE + n.to_bytes(16, "big")


def announcer(
    subscribed: bool = True,
) -> tuple[Announcer, list[tuple[str, KVEvent]], list[tuple[bytes, int]]]:
    published: list[tuple[str, KVEvent]] = []
    recalls: list[tuple[bytes, int]] = []
    a = Announcer(
        lambda tenant, event: published.append((tenant, event)),
        chunk_size=64,
        subscribed=lambda tenant: subscribed,
        tiers=l2_tiers(["disk"]),
        recall=lambda space, limit: recalls.append((space, limit)) is None,
    )
    a.announce_space(SPACE, "acme")
    return a, published, recalls


def test_a_chunks_names_come_back_from_their_record_as_they_were_announced() -> None:
    a, published, _ = announcer()
    store = Store(
        "r", 0, 128, (), token_ids=pack_tokens(range(100, 228)), lora_name="ad",
        extra_keys=(("ad", ("mm", 0)), None, None, ("ad",), None, None, None, ("x", 7)),
        group_idx=1, kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=128,
    )  # fmt: skip
    a.names([key(1), key(2)], (10, 11, 12, 13, 20, 21, 22, 23), 16, store)
    a.ready(key(1), None)
    a.ready(key(2), key(1))
    a.stored(key(2), "disk")
    record = a.names_of(key(2))
    assert record is not None
    assert a.names_of(key(9)) is None  # (never announced)
    # A restarted server: nothing announced, then the disk's record of key(2).
    b, after, _ = announcer()
    b.recovered(key(2), "disk", record.encode())
    assert after == [published[-1]]
    stored = after[0][1]
    assert isinstance(stored, BlockStored)
    assert (stored.parent_block_hash, stored.medium) == (13, "STORAGE")
    assert tuple(stored.token_ids) == tuple(range(164, 228))
    assert b.names_size("acme") > 0
    b.stored(key(2), "disk")  # (found by a lookup later: already announced)
    assert len(after) == 1


def test_unnamed_chunks_keep_no_record() -> None:
    a, _, _ = announcer()
    a.stored(key(1), "disk")  # (known by its chunk hash alone)
    assert a.names_of(key(1)) is None


def _record(*, size: int = 16, parent: object = None, **store: object) -> bytes:
    fields: dict[str, object] = {"block_hashes": (1, 2, 3, 4), "token_ids": pack_tokens(range(64))}
    fields.update(store)
    body = encode_request(0, Store("", 0, 64, **fields))[1]  # type: ignore[arg-type]
    return msgpack.packb((1, size, parent, body))  # type: ignore[no-any-return]


def test_a_valid_record_decodes() -> None:
    names = decode_names(_record(parent=9), "acme", 64)
    assert names is not None
    assert (names.hashes, names.block_size, names.parent_hash) == ((1, 2, 3, 4), 16, 9)


@pytest.mark.parametrize(
    "record",
    [
        b"",
        b"\xc1",  # not msgpack
        msgpack.packb((2, 16, None, b"")),  # another version
        msgpack.packb((1, 16, None)),  # short
        _record(size=0),
        _record(size=48),  # does not divide the chunk
        _record(size=128),  # beyond the chunk
        _record(parent=-1),
        _record(parent=1.5),
        _record(parent=b"p" * 65),
        _record(parent="text"),
        _record(block_hashes=()),
        _record(block_hashes=(1, 2, 3, 4, 5)),  # more blocks than a chunk has
        _record(token_ids=pack_tokens(range(63))),  # not the blocks' tokens
        _record(extra_keys=(None,)),  # not one per block
        _record(lora_name="x" * 100_000),  # beyond the protocol's bound
        msgpack.packb((1, 16, None, b"\x91\xc0")),  # a body that is no store
        msgpack.packb((1, 16, None, "text")),
    ],
)
def test_a_record_that_is_not_whole_and_valid_is_left_out(record: bytes) -> None:
    assert decode_names(record, "acme", 64) is None
    a, published, _ = announcer()
    a.recovered(key(1), "disk", record)
    assert published == []


def test_the_l2_is_recalled_once_while_someone_wants_its_names() -> None:
    a, _, recalls = announcer()
    assert recalls == [(SPACE, 32 << 20)]  # (half the tenant's bytes of names: see _recall)
    a.announce_space(SPACE, "acme")  # (a worker registering again)
    a.subscriber("acme")
    assert len(recalls) == 1
    quiet, _, none = announcer(subscribed=False)
    quiet.subscriber(None)
    assert none == []
