"""What the server announces (``server/_announce.py``), without sockets."""

from __future__ import annotations

from kvtrio.protocol import BlockRemoved, BlockStored, KVEvent
from kvtrio.server._announce import Announcer

SPACE = b"s" * 16


def key(n: int) -> bytes:
    return SPACE + n.to_bytes(16, "big")


def announcer() -> tuple[Announcer, list[tuple[str, KVEvent]]]:
    published: list[tuple[str, KVEvent]] = []
    a = Announcer(lambda tenant, event: published.append((tenant, event)), chunk_size=64)
    a.announce_space(SPACE, "acme")
    return a, published


def test_named_chunks_once_per_tier_and_removed_per_tier() -> None:
    a, published = announcer()
    a.names([key(1), key(2)], (10, 11, 12, 13, 20, 21, 22), block_size=16)
    a.ready(key(1), None)
    a.ready(key(2), key(1))
    a.stored(key(2), "disk")
    a.stored(key(2), "disk")  # once per tier
    a.removed(key(2))  # left L1, still on disk
    a.removed(key(3))  # never announced: nothing
    assert published == [
        ("acme", BlockStored((10, 11, 12, 13), None, (), 16, "CPU")),
        ("acme", BlockStored((20, 21, 22), 13, (), 16, "CPU")),
        ("acme", BlockStored((20, 21, 22), 13, (), 16, "disk")),
        ("acme", BlockRemoved((20, 21, 22), "CPU")),
    ]


def test_unnamed_chunks_use_the_chunk_hash_and_other_ranks_are_silent() -> None:
    a, published = announcer()
    a.ready(key(5), key(4))
    a.ready(b"o" * 16 + b"x" * 16, None)  # a namespace no rank 0 registered
    a.seen([key(5), key(6)], 1, "disk")  # found the first, missed the next
    assert published == [
        ("acme", BlockStored((key(5)[16:],), key(4)[16:], (), 64, "CPU")),
        ("acme", BlockStored((key(5)[16:],), key(4)[16:], (), 64, "disk")),
    ]
    a.seen([key(5)], 0, "disk")  # now missed there
    assert published[-1] == ("acme", BlockRemoved((key(5)[16:],), "disk"))
