"""Eviction policies: the L1's books hold under every policy, pinned chunks stay, prompts leave
tail first, orphans go first, the registry and the evaluator's conventions."""

from __future__ import annotations

import random

import pytest

from kvtrio.storage import (
    DEFAULT_EVICTION,
    EVICTION_POLICIES,
    LRU,
    Entry,
    L1Cache,
    make_policy,
)

PREFIX_AWARE = [name for name in EVICTION_POLICIES if name != "lru"]


def store_prompt(l1: L1Cache, keys: list[bytes]) -> None:
    """Store a prompt's chunks head first, each with its parent, as the server does."""
    for index, key in enumerate(keys):
        entry = l1.reserve(key, 1, parent=keys[index - 1] if index else None)
        if isinstance(entry, Entry):
            l1.commit(key)


def prompt(name: str, n: int) -> list[bytes]:
    return [f"{name}{i}".encode() for i in range(n)]


@pytest.mark.parametrize("name", list(EVICTION_POLICIES))
def test_random_operations_keep_the_books_straight_under_every_policy(name: str) -> None:
    rng = random.Random(name)
    l1 = L1Cache(24, policy=make_policy(name), alignment=1)
    pinned: dict[bytes, int] = {}
    prompts = [prompt(f"p{p}-", rng.randrange(1, 10)) for p in range(12)]
    for _ in range(3000):
        keys = rng.choice(prompts)
        action = rng.random()
        if action < 0.4:
            store_prompt(l1, keys[: rng.randrange(1, len(keys) + 1)])
        elif action < 0.6:
            hit = l1.prefix(keys)
            for key in keys[:hit]:
                l1.pin(key)
                pinned[key] = pinned.get(key, 0) + 1
        elif action < 0.65:
            l1.discard(rng.choice(keys))
        elif pinned:
            victim = rng.choice(list(pinned))
            l1.unpin(victim)
            pinned[victim] -= 1
            if not pinned[victim]:
                del pinned[victim]
        for key in pinned:
            assert l1.get(key) is not None, "a pinned entry disappeared"
        stats = l1.stats()
        assert stats.pinned_entries == len(pinned)
        assert len(l1._policy) == stats.ready - stats.pinned_entries  # evictable, exactly
    assert l1.evictions > 0


@pytest.mark.parametrize("name", PREFIX_AWARE)
def test_prompts_leave_tail_first_so_what_stays_is_reachable(name: str) -> None:
    """Stored head first, a prompt must not lose its head before its tail (issue 11: LRU left
    19 of 63 objects reachable)."""
    l1 = L1Cache(40, policy=make_policy(name), alignment=1)
    prompts = [prompt(f"p{p}-", 16) for p in range(8)]
    for keys in prompts:
        store_prompt(l1, keys)
    stored = sum(l1.get(key) is not None for keys in prompts for key in keys)
    reachable = sum(l1.prefix(keys) for keys in prompts)
    assert stored == 40
    assert reachable == stored


def test_plain_lru_still_evicts_heads_first_for_comparison() -> None:
    l1 = L1Cache(40, policy=LRU(), alignment=1)
    prompts = [prompt(f"p{p}-", 16) for p in range(8)]
    for keys in prompts:
        store_prompt(l1, keys)
    assert sum(l1.prefix(keys) for keys in prompts) < 40


@pytest.mark.parametrize("name", PREFIX_AWARE)
def test_the_kids_of_a_dropped_chunk_go_before_anything_else(name: str) -> None:
    l1 = L1Cache(12, policy=make_policy(name), alignment=1)
    old, doomed = prompt("old", 4), prompt("doomed", 4)
    store_prompt(l1, old)
    store_prompt(l1, doomed)
    for _ in range(3):
        assert l1.prefix(doomed) == 4  # popular: any history-based policy would keep it
    l1.pin(doomed[2])  # a held kid is orphaned when released
    assert l1.discard(doomed[0])  # found corrupt: the rest of the prompt can never hit
    l1.unpin(doomed[2])
    store_prompt(l1, prompt("new", 8))  # 5 slots are free: 3 evictions
    assert [l1.get(k) is not None for k in doomed[1:]] == [False, False, False]
    assert l1.prefix(old) == 4


def test_held_chunks_keep_their_history() -> None:
    """A hit is pinned while it is read: on release it must not count as a new chunk."""
    policy = make_policy("arc")
    l1 = L1Cache(8, policy=policy, alignment=1)
    hot = prompt("hot", 2)
    store_prompt(l1, hot)
    assert l1.prefix(hot) == 2
    for key in hot:
        l1.pin(key)
    store_prompt(l1, prompt("scan", 6))
    for key in hot:
        l1.unpin(key)
    store_prompt(l1, prompt("scan2-", 6))  # a scan of one-off chunks
    assert l1.prefix(hot) == 2


def test_registry_names_and_errors() -> None:
    assert DEFAULT_EVICTION in EVICTION_POLICIES
    assert "lru" in EVICTION_POLICIES
    assert len(EVICTION_POLICIES) >= 4
    with pytest.raises(ValueError, match=r"unknown eviction policy 'nope'.*lru"):
        make_policy("nope")
    assert make_policy("lru") is not make_policy("lru")


def test_the_server_option_names_a_policy() -> None:
    from kvtrio.config import config_summary, load_config
    from kvtrio.errors import ConfigError

    assert load_config(environ={}).eviction == DEFAULT_EVICTION
    assert load_config({"eviction": "lru"}, environ={}).eviction == "lru"
    assert load_config(environ={"KVTRIO_EVICTION": "s3fifo"}).eviction == "s3fifo"
    with pytest.raises(ConfigError, match="eviction"):
        load_config({"eviction": "fifo"}, environ={})
    assert config_summary(load_config({"eviction": "lru"}, environ={}))["eviction"] == "lru"


@pytest.mark.parametrize("name", PREFIX_AWARE)
def test_ranks_committing_interleaved_still_leave_tail_first(name: str) -> None:
    """With two ranks, chunks (and released pins) arrive interleaved: a0 b0 a1 b1 ..."""
    l1 = L1Cache(40, policy=make_policy(name), alignment=1)
    prompts = [(prompt(f"a{p}-", 12), prompt(f"b{p}-", 12)) for p in range(6)]
    for rank_a, rank_b in prompts:
        for index in range(12):
            for keys in (rank_a, rank_b):
                parent = keys[index - 1] if index else None
                if isinstance(l1.reserve(keys[index], 1, parent=parent), Entry):
                    l1.commit(keys[index])
    stored = sum(l1.get(k) is not None for pair in prompts for keys in pair for k in keys)
    assert stored == 40
    assert sum(l1.prefix(keys) for pair in prompts for keys in pair) == stored


def test_the_reuse_policy_keeps_a_prompt_reused_at_a_regular_gap_through_one_off_prompts() -> None:
    """A 4-chunk prompt asked every 6 one-off prompts of 4 chunks (24 chunks between its uses)
    in a 20-chunk cache: LRU has always dropped it by its next use; the reuse policy has
    learned that one-off prompts do not come back and the prompt does (its own gap), and
    keeps it."""
    hot = prompt("hot", 4)
    hits = {}
    for name in ("lru", "arc", "reuse"):
        l1 = L1Cache(20, policy=make_policy(name), alignment=1)
        hits[name] = 0
        for round_ in range(60):
            hits[name] += l1.prefix(hot)
            store_prompt(l1, hot)
            for one in range(6):
                store_prompt(l1, prompt(f"once{round_}-{one}-", 4))
    assert hits["lru"] == 0
    assert hits["reuse"] >= 4 * 50  # (all but the first rounds, while it learns)


def test_the_reuse_policy_evicts_the_chunk_predicted_to_be_used_last() -> None:
    """Two reused chunks of the same class: the one whose own gap between uses is long goes
    before the one used often, though it was used more recently."""
    policy = make_policy("reuse")
    policy.add(b"often")
    policy.add(b"rarely")
    for _ in range(3):  # often: used every 2 accesses
        policy.touch(b"often")
        policy.add(b"x")
        policy.discard(b"x")
    for step in range(40):
        policy.add(f"filler{step}".encode())
        policy.discard(f"filler{step}".encode())
    policy.touch(b"often")
    policy.touch(b"rarely")  # used once, 46 accesses after its first
    assert next(policy.victims()) == b"rarely"


def test_the_reuse_policy_keeps_an_orphan_among_the_orphans_when_it_gets_a_successor() -> None:
    policy = make_policy("reuse")
    policy.add(b"a")
    policy.add(b"b", b"a")
    policy.add(b"x")
    policy.discard(b"a")  # b is an orphan now
    policy.add(b"c", b"b")  # b gets a successor: it is no longer a leaf, still an orphan
    assert next(policy.victims()) == b"b"
