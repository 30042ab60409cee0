"""What the server announces (``server/_announce.py``), without sockets."""

from __future__ import annotations

from kvtrio.protocol import BlockRemoved, BlockStored, KVEvent, Store, pack_tokens
from kvtrio.server._announce import Announcer, Tier, l2_tiers

SPACE = b"s" * 16


def key(n: int) -> bytes:
    return SPACE + n.to_bytes(16, "big")


def announcer() -> tuple[Announcer, list[tuple[str, KVEvent]]]:
    published: list[tuple[str, KVEvent]] = []
    a = Announcer(
        lambda tenant, event: published.append((tenant, event)),
        chunk_size=64,
        tiers=l2_tiers(["disk"]),
    )
    a.announce_space(SPACE, "acme")
    return a, published


def cpu(hashes: tuple[int | bytes, ...], parent: int | bytes | None, size: int) -> BlockStored:
    return BlockStored(hashes, parent, (), size, "CPU", locality="LOCAL")


def disk(hashes: tuple[int | bytes, ...], parent: int | bytes | None, size: int) -> BlockStored:
    return BlockStored(hashes, parent, (), size, "STORAGE", locality="LOCAL", ownership="disk")


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
        ("acme", cpu((10, 11, 12, 13), None, 16)),
        ("acme", cpu((20, 21, 22), 13, 16)),
        ("acme", disk((20, 21, 22), 13, 16)),
        ("acme", BlockRemoved((20, 21, 22), "CPU", locality="LOCAL")),
    ]


def test_unnamed_chunks_use_the_chunk_hash_and_other_ranks_are_silent() -> None:
    a, published = announcer()
    a.ready(key(5), key(4))
    a.ready(b"o" * 16 + b"x" * 16, None)  # a namespace no rank 0 registered
    a.seen([key(5), key(6)], 1, "disk")  # found the first, missed the next
    assert published == [
        ("acme", cpu((key(5)[16:],), key(4)[16:], 64)),
        ("acme", disk((key(5)[16:],), key(4)[16:], 64)),
    ]
    a.seen([key(5)], 0, "disk")  # now missed there
    removed = BlockRemoved((key(5)[16:],), "STORAGE", locality="LOCAL", ownership="disk")
    assert published[-1] == ("acme", removed)


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


def test_stores_carry_tokens_extra_keys_lora_and_group_to_the_events() -> None:
    """Issue 35, item 1: what a router that keys blocks itself needs (llm-d: token_ids,
    parent_block_hash, extra_keys, lora_name) and vLLM 0.33's group fields."""
    a, published = announcer()
    tokens = tuple(range(100, 164))  # two chunks of 32 tokens... at block_size 16: 4 blocks
    store = Store(
        "r", 0, 128, (), token_ids=pack_tokens(range(100, 228)), lora_name="ad",
        extra_keys=(("ad", ("mm", 0)), None, None, ("ad",), None, None, None, None),
        group_idx=1, kv_cache_spec_kind="full_attention",
    )  # fmt: skip
    a.names([key(1), key(2)], tuple(range(10, 18)), 16, store)
    a.ready(key(1), None)
    a.ready(key(2), key(1))
    first, second = (e for _, e in published)
    assert isinstance(first, BlockStored)
    assert isinstance(second, BlockStored)
    assert first.token_ids == tokens
    assert second.token_ids == tuple(range(164, 228))
    assert first.extra_keys == (("ad", ("mm", 0)), None, None, ("ad",))
    assert second.parent_block_hash == 13
    assert (second.lora_name, second.group_idx, second.kv_cache_spec_kind) == (
        "ad", 1, "full_attention",
    )  # fmt: skip
    # Tokens that are not the blocks' are left out (never another prompt's).
    a.names([key(3)], (30, 31, 32, 33), 16, Store("s", 0, 64, (), token_ids=pack_tokens((1, 2, 3))))
    a.ready(key(3), None)
    assert published[-1][1].token_ids == ()  # type: ignore[union-attr]


def test_token_mode_chunks_carry_their_tokens() -> None:
    a, published = announcer()
    a.names([key(1), key(2)], (), 16, Store("r", 0, 128, (), token_ids=pack_tokens(range(128))))
    a.ready(key(2), key(1))
    assert published == [
        ("acme", BlockStored((key(2)[16:],), key(1)[16:], tuple(range(64, 128)), 64, "CPU",
                             locality="LOCAL")),
    ]  # fmt: skip


def test_one_medium_per_vllm_name_and_a_chunk_found_in_l2_is_renamed_by_a_store() -> None:
    """Issue 35, item 2: two disks of a cascade are one ``STORAGE`` medium: stored when the
    first holds a chunk, removed when the last lost it. A chunk found in L2 by its chunk hash
    alone (after a restart) is announced again under the names a later store carries."""
    published: list[tuple[str, KVEvent]] = []
    tiers = l2_tiers(["disk", "disk", "redis"], ())
    assert tiers["disk#2"] == Tier("STORAGE", "LOCAL", "disk#2")
    a = Announcer(lambda t, e: published.append((t, e)), 64, tiers=tiers)
    a.announce_space(SPACE, "acme")
    a.seen([key(1)], 1, "disk#1")
    a.seen([key(1)], 1, "disk#2")
    a.seen([key(1)], 0, "disk#1")  # still on disk#2: nothing to say
    assert [type(e).__name__ for _, e in published] == ["BlockStored"]
    a.names([key(1)], (7, 8, 9, 10), 16, Store("r", 0, 64, (), token_ids=pack_tokens(range(64))))
    assert published[1] == ("acme", BlockRemoved((key(1)[16:],), "STORAGE", None, "LOCAL",
                                                 "disk#2"))  # fmt: skip
    renamed = published[2][1]
    assert isinstance(renamed, BlockStored)
    assert (renamed.block_hashes, renamed.token_ids) == ((7, 8, 9, 10), tuple(range(64)))
    assert list(a.snapshot("acme")) == [renamed]
    a.seen([key(1)], 0, "disk#2")
    assert published[-1][1] == BlockRemoved((7, 8, 9, 10), "STORAGE", None, "LOCAL", "disk#2")
    assert list(a.snapshot("acme")) == []


def test_shared_stores_elsewhere_are_remote() -> None:
    from kvtrio._backend_spec import BackendSpec

    specs = (BackendSpec("redis", {"url": "redis://10.0.0.5:6379"}),
             BackendSpec("s3", {"endpoint": "http://127.0.0.1:8333"}))  # fmt: skip
    tiers = l2_tiers(["redis", "s3"], specs)
    assert tiers["redis"] == Tier("STORAGE", "REMOTE", "redis")
    assert tiers["s3"] == Tier("STORAGE", "LOCAL", "s3")
