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


def test_nothing_is_kept_or_announced_for_a_tenant_nobody_subscribes_to() -> None:
    """Issue 32, item 5: with no subscriber, stores' names are not kept (they grew the server
    by ~35 KiB per chunk of 64-byte hashes at block_size 1, with no subscriber at all)."""
    published: list[tuple[str, KVEvent]] = []
    a = Announcer(lambda t, e: published.append((t, e)), 64, subscribed=lambda t: False)
    a.announce_space(SPACE, "acme")
    for n in range(100):
        a.names([key(n)], [bytes(64)] * 64, block_size=1)
        a.ready(key(n), None)
    assert (len(a), a.names_size("acme"), published) == (0, 0, [])


def test_names_are_bounded_in_bytes_per_tenant() -> None:
    """Issue 32, item 5: 64-byte hashes at block_size 1 (64 a chunk here) for 4,000 chunks
    stay within the tenant's bound in bytes, as Python allocates them (tracemalloc); the
    chunks announced first are announced removed when their names are forgotten."""
    import tracemalloc

    published: list[tuple[str, KVEvent]] = []
    bound = 1 << 20
    a = Announcer(lambda t, e: published.append((t, e)), 64, names_bytes=bound)
    a.announce_space(SPACE, "acme")
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for n in range(4000):
            a.names([key(n)], [n.to_bytes(64, "big")] * 64, block_size=1)
            a.ready(key(n), None)
            published.clear()  # (the events themselves are the publisher's, bounded there)
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert a.names_size("acme") <= bound
    assert grown <= 1.5 * bound, f"{grown} bytes for a bound of {bound}"
    assert 0 < len(a) < 4000
    a.removed(key(0))  # forgotten: nothing to say
    assert published == []
    a.names([key(5000)], [bytes(64)] * 64, block_size=1)
    a.ready(key(5000), None)
    removed = [e for _, e in published if isinstance(e, BlockRemoved)]
    assert removed  # the oldest names made room, announced removed
    assert all(e.medium == "CPU" for e in removed)


def test_a_tenant_nobody_wants_any_more_is_forgotten_and_cleared() -> None:
    from kvtrio.protocol import AllBlocksCleared

    wanted = {"acme": True}
    published: list[tuple[str, KVEvent]] = []
    a = Announcer(lambda t, e: published.append((t, e)), 64, subscribed=wanted.__getitem__)
    a.announce_space(SPACE, "acme")
    a.names([key(1)], (10, 11, 12, 13), block_size=16)
    a.ready(key(1), None)
    wanted["acme"] = False
    a.ready(key(2), None)
    assert published[-1] == ("acme", AllBlocksCleared())
    assert (len(a), a.names_size("acme")) == (0, 0)
