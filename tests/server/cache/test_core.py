"""The cache core driven directly: no server, no sockets, no event loop (issue 36).

A real L1 (tenant arenas over a shared-memory file) and the core's own tables; the tests give
the core a caller and a request and read its answer as data: the slots, the L1 hit, what goes
to L2. Time is a plain clock the test moves.
"""

from __future__ import annotations

import random
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvtrio.config import ServerConfig
from kvtrio.errors import ErrorCode, RequestError
from kvtrio.protocol import (
    HASH_SCHEME_TOKENS,
    Commit,
    LayoutSpec,
    Lookup,
    Register,
    Retrieve,
    Slot,
    Store,
    token_chunk_hashes,
)
from kvtrio.server._tenants import TenantArenas
from kvtrio.server.cache._core import CacheCore, Client, L2Write, LookupStep
from kvtrio.server.cache._registry import Registration
from kvtrio.shm import SharedArena
from kvtrio.storage import Entry, L1Cache

CHUNK = 64
LAYOUT = LayoutSpec("flash_attn", 2, 64, 16, 2, 16, "float16")  # 16 KiB chunks
CHUNK_BYTES = 2 * 2 * CHUNK * 2 * 16 * 2
WORKER = Client("worker-session")
SCHEDULER = Client("scheduler-session")


class Clock:
    """The core's clock, moved by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class NoCopy:
    """The copy path the core sees of a registration (it only asks who copies)."""

    copies_on_server = False

    def close(self) -> None:
        pass


class Cache:
    """A core over an L1 of ``chunks`` chunks, one registered worker, and the worker's and
    the scheduler's steps as an engine takes them (store + commit, lookup + retrieve +
    release), each answered with data."""

    def __init__(self, directory: Path, chunks: int, **config: Any) -> None:
        self.arena = SharedArena.create(chunks * CHUNK_BYTES, directory=str(directory))
        self.arenas = TenantArenas(self.arena, lambda size, base: L1Cache(size, base=base))
        self.clock = Clock()
        self.config = ServerConfig(chunk_size=CHUNK, **config)
        self.core = CacheCore(self.config, self.arenas, self.clock)
        self.registration = self.register(WORKER, "w")

    def register(self, caller: Client, engine: str, tenant: str = "") -> Registration:
        register = Register(engine, "m", 1, 0, LAYOUT, HASH_SCHEME_TOKENS, tenant=tenant)
        self.core.enter(caller)
        registration = self.core.registry.register(caller.id, register, NoCopy())  # type: ignore[arg-type]
        self.arenas.bind(registration.space, self.arenas.for_tenant(tenant))
        return registration

    def close(self) -> None:
        self.arenas.close()
        self.arena.close()

    # ----------------------------------------------------------------- worker steps

    def store(
        self, request: str, hashes: list[bytes], caller: Client = WORKER
    ) -> tuple[list[Slot], list[Entry], list[bytes]]:
        core = self.core
        registration = core.registration(caller.id)
        op = Store(request, 0, len(hashes) * CHUNK, tuple(hashes))
        key, checked, chunks = core.chunks(registration, op)
        core.admit_leases(caller, len(chunks), registration.chunk_bytes)
        slots: list[Slot] = []
        reserved: list[Entry] = []
        present: list[bytes] = []
        expires = self.clock() + self.config.reservation_ttl
        core.reserve(caller.id, registration, key, chunks, checked, None, expires, slots,
                     reserved, present)  # fmt: skip
        return slots, reserved, present

    def write(self, slots: list[Slot], hashes: list[bytes]) -> None:
        """The worker's copy: each written slot holds its chunk hash, repeated."""
        for slot in slots:
            if slot.status == "write":
                self.arena.view(slot.offset, slot.nbytes)[:] = fill(hashes[slot.chunk])

    def commit(self, request: str, hashes: list[bytes], caller: Client = WORKER) -> list[L2Write]:
        core = self.core
        registration = core.registration(caller.id)
        key = core.worker_request(registration, Commit(request).request)
        writes: list[L2Write] = []
        for chunk_hash in hashes:
            core.end_write(caller.id, key, registration.space + chunk_hash, "commit",
                           registration.fingerprint, writes)  # fmt: skip
        return writes

    def put(self, request: str, hashes: list[bytes]) -> list[L2Write]:
        slots, _, _ = self.store(request, hashes)
        self.write(slots, hashes)
        return self.commit(request, hashes)

    def lookup(
        self, request: str, hashes: list[bytes], caller: Client = SCHEDULER, engine: str = "w"
    ) -> LookupStep | None:
        start = self.core.lookup(caller, Lookup(request, "m", 1, tuple(hashes), engine=engine))
        if start is None:
            return None
        return self.core.pin_first(caller, Lookup(request, "m", 1, tuple(hashes)), start, l2=False)

    def retrieve(self, request: str, hashes: list[bytes], caller: Client = WORKER) -> list[Slot]:
        core = self.core
        registration = core.registration(caller.id)
        op = Retrieve(request, 0, len(hashes) * CHUNK, tuple(hashes))
        key, checked, chunks = core.chunks(registration, op)
        keys = [registration.space + h for h in checked]
        core.admit_leases(caller, len(keys), registration.chunk_bytes)
        core.quotas.admit_pins(keys, registration.chunk_bytes)
        return core.pin_reads(caller.id, key, chunks, keys)

    def release(self, request: str, hashes: list[bytes], caller: Client = WORKER) -> int:
        core = self.core
        registration = core.registration(caller.id)
        key = core.worker_request(registration, request)
        return core.end_reads(caller.id, key, [registration.space + h for h in hashes])

    def end_request(self, request: str, engine: str = "w") -> int:
        from kvtrio.server.cache._keys import request_key

        return self.core.end_lookup(request_key(engine, "m", "", request))

    def pins(self) -> int:
        return self.core.l1.stats().pins


def fill(chunk_hash: bytes) -> np.ndarray:
    return np.frombuffer(chunk_hash * (CHUNK_BYTES // len(chunk_hash)), dtype=np.uint8)


def prompt(*values: int) -> list[bytes]:
    """Chunk hashes of a prompt whose chunk ``i`` is made of value ``values[i]``."""
    tokens = [v * 10_000 + i * CHUNK + j for i, v in enumerate(values) for j in range(CHUNK)]
    return token_chunk_hashes(tokens, CHUNK)


@pytest.fixture
def cache(tmp_path: Path) -> Iterator[Cache]:
    made = Cache(tmp_path, chunks=8)
    try:
        yield made
    finally:
        made.close()


def test_the_core_imports_neither_trio_nor_zmq() -> None:
    code = (
        "import sys, kvtrio.server.cache._core\n"
        "print(sorted(m for m in ('trio', 'zmq') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_a_lookup_before_any_registration_of_its_engine_is_a_plain_miss(cache: Cache) -> None:
    assert cache.lookup("r", prompt(1, 2), engine="nobody") is None
    step = cache.lookup("r", prompt(1, 2))
    assert step is not None
    assert step.hit == 0
    assert step.done
    assert cache.pins() == 0


def test_a_commit_returns_its_writes_for_l2_and_a_lookup_pins_the_hits(cache: Cache) -> None:
    hashes = prompt(1, 2, 3)
    slots, reserved, present = cache.store("r", hashes)
    assert [s.status for s in slots] == ["write"] * 3
    assert len(reserved) == 3
    assert not present
    cache.write(slots, hashes)
    writes = cache.commit("r", hashes)
    space = cache.registration.space
    assert writes == [L2Write(space + h, cache.registration.fingerprint, "") for h in hashes]
    assert cache.core.leases.live == 0  # the reservations ended with the commit

    step = cache.lookup("q", hashes[:2] + prompt(9))
    assert step is not None
    assert (step.hit, step.done) == (2, True)
    assert cache.pins() == 2

    read = cache.retrieve("q", hashes[:2])
    assert [s.status for s in read] == ["read", "read"]
    for slot in read:  # each read slot holds its own chunk's bytes
        assert (
            bytes(cache.arena.view(slot.offset, slot.nbytes)) == fill(hashes[slot.chunk]).tobytes()
        )
    assert cache.pins() == 2  # the lookup's pins were consumed by the read pins
    assert cache.release("q", hashes[:2]) == 2
    assert cache.pins() == 0
    assert cache.core.leases.live == 0


def test_a_chunk_stored_twice_is_present_and_named_for_an_l2_rewrite(cache: Cache) -> None:
    hashes = prompt(4)
    cache.put("r", hashes)
    slots, reserved, present = cache.store("r2", hashes)
    assert [s.status for s in slots] == ["present"]
    assert not reserved
    assert present == [cache.registration.space + hashes[0]]


def test_a_commit_without_a_live_reservation_writes_nothing(cache: Cache) -> None:
    hashes = prompt(5)
    assert cache.commit("r", hashes) == []
    cache.store("r", hashes)
    cache.clock.now += cache.config.reservation_ttl + 1
    expired, _ = cache.core.expire(cache.clock.now)
    assert expired == 1
    assert cache.commit("r", hashes) == []  # expired: rejected, never visible
    step = cache.lookup("q", hashes)
    assert step is not None
    assert step.hit == 0


def test_a_new_lookup_of_a_request_replaces_the_pins_of_the_previous_one(cache: Cache) -> None:
    hashes = prompt(1, 2)
    cache.put("r", hashes)
    cache.lookup("q", hashes)
    cache.lookup("q", hashes)
    assert cache.pins() == 2
    assert cache.end_request("q") == 2
    assert cache.pins() == 0


def test_expired_pins_are_undone_by_the_reaper_round(cache: Cache) -> None:
    hashes = prompt(1, 2)
    cache.put("r", hashes)
    cache.lookup("q", hashes)
    expired, when = cache.core.expire(cache.clock.now)
    assert expired == 0
    assert when is not None
    assert when > cache.clock.now
    cache.clock.now = when
    assert cache.core.expire(cache.clock.now)[0] == 2
    assert cache.pins() == 0
    assert cache.core.leases.live == 0


def test_a_session_end_releases_what_it_holds(cache: Cache) -> None:
    hashes = prompt(1, 2, 3)
    cache.put("r", hashes)
    cache.lookup("q", hashes)
    cache.store("s", prompt(6, 7))
    assert cache.core.release_slice(SCHEDULER.id, quarantine=False) == 3
    assert cache.core.release_slice(WORKER.id, quarantine=True) == 2
    cache.core.leave(SCHEDULER.id)
    assert cache.pins() == 0
    assert cache.core.leases.live == 0
    assert SCHEDULER.id not in cache.core.users


def test_a_chunk_is_read_once_per_worker_and_request_until_released(cache: Cache) -> None:
    """A chunk named twice in a retrieve, or retrieved again before its release, is
    ``failed`` the second time (the engine recomputes it). Was: a second pin on the one lease,
    which the first copy's release dropped with it (the slot could be rewritten under the
    second copy), and pins piled on one lease beyond every quota (thousands per retrieve)."""
    a = prompt(1, 2)
    cache.put("s", a)
    assert [s.status for s in cache.retrieve("r", a + a)] == ["read", "read", "failed", "failed"]
    assert [s.status for s in cache.retrieve("r", a)] == ["failed", "failed"]
    assert [s.status for s in cache.retrieve("r2", a)] == ["read", "read"]  # another request
    assert cache.pins() == 4
    assert cache.release("r", a) == 2
    assert cache.pins() == 2
    assert [s.status for s in cache.retrieve("r", a)] == ["read", "read"]  # released: again
    assert cache.release("r", a) + cache.release("r2", a) == 4
    assert cache.pins() == 0


@pytest.mark.parametrize("end", ["expiry", "session end"])
def test_a_read_pin_ended_unreleased_is_held_as_long_as_a_reservation_is_quarantined(
    tmp_path: Path, end: str
) -> None:
    """A worker whose read pin expired, or whose session went silent, may be slow, not dead
    (the reason unfinished reservations are quarantined): its slot stays this chunk's for
    ``reservation_ttl`` more, then the reaper frees it. An explicit release, or the session's
    own unregistration, frees it at once."""
    cache = Cache(tmp_path, chunks=2, lease_share=1.0)
    try:
        a = prompt(1)
        cache.put("s", a)
        (slot,) = cache.retrieve("r", a)
        if end == "expiry":
            cache.clock.now += cache.config.pin_ttl
            assert cache.core.expire(cache.clock.now)[0] == 1
        else:
            assert cache.core.release_slice(WORKER.id, quarantine=True) == 1
        assert cache.core.leases.live == 0
        assert cache.pins() == 1  # held: the late copy still reads chunk a
        others = prompt(2, 3)
        slots, _, _ = cache.store("t", others)
        assert [s.status for s in slots] == ["write", "failed"]
        cache.write(slots, others)
        cache.commit("t", others[:1])
        assert (cache.arena.view(slot.offset, slot.nbytes) == fill(a[0])).all()
        _, when = cache.core.expire(cache.clock.now)
        assert when == cache.clock.now + cache.config.reservation_ttl
        cache.clock.now = when
        cache.core.expire(cache.clock.now)
        assert cache.pins() == 0
        assert [s.status for s in cache.retrieve("r2", a)] == ["read"]
        assert cache.core.release_slice(WORKER.id, quarantine=False) == 1
        assert cache.pins() == 0  # released by the client: at once
    finally:
        cache.close()


def test_request_keys_of_different_requests_differ_whatever_their_names_hold() -> None:
    from kvtrio.server.cache._keys import request_key

    keys = {
        request_key("a\x00b", "c", "", "r"),
        request_key("a", "b\x00c", "", "r"),
        request_key("a", "b", "c\x00", "r"),
        request_key("a", "b", "c", "\x00r"),
        request_key("a", "b", "", "c\x00r"),
    }
    assert len(keys) == 5


def test_the_session_quota_refuses_before_anything_is_held(tmp_path: Path) -> None:
    cache = Cache(tmp_path, chunks=8, max_leases_per_session=2)
    try:
        with pytest.raises(RequestError) as info:
            cache.store("r", prompt(1, 2, 3))
        assert info.value.code is ErrorCode.QUOTA_EXCEEDED
        assert cache.core.leases.live == 0
        assert cache.core.quotas.refused == 1
    finally:
        cache.close()


def test_a_client_keys_share_counts_all_its_sessions_and_no_other_key(tmp_path: Path) -> None:
    cache = Cache(tmp_path, chunks=8, lease_share_per_key=0.5)  # 4 chunks per key
    try:
        cache.put("r", prompt(1, 2, 3, 4, 5, 6))
        a1, a2, b = Client("a1", "key-a"), Client("a2", "key-a"), Client("b", "key-b")
        assert cache.lookup("q1", prompt(1, 2, 3), caller=a1).hit == 3  # type: ignore[union-attr]
        with pytest.raises(RequestError) as info:  # a1's 3 + a2's 2 > 4
            cache.lookup("q2", prompt(1, 2), caller=a2)
        assert info.value.code is ErrorCode.QUOTA_EXCEEDED
        assert cache.lookup("q3", prompt(1, 2), caller=b).hit == 2  # type: ignore[union-attr]
        cache.core.release_slice(a1.id, quarantine=False)
        cache.core.leave(a1.id)
        assert cache.lookup("q2", prompt(1, 2), caller=a2).hit == 2  # type: ignore[union-attr]
    finally:
        cache.close()


def test_the_request_limit_answers_busy(tmp_path: Path) -> None:
    cache = Cache(tmp_path, chunks=8, max_requests=1)
    try:
        cache.put("r", prompt(1))
        cache.lookup("q1", prompt(1))
        with pytest.raises(RequestError) as info:
            cache.lookup("q2", prompt(1))
        assert info.value.code is ErrorCode.BUSY
        refused = Client("refused", "key")
        with pytest.raises(RequestError):
            cache.lookup("q3", prompt(1), caller=refused)
        # Was: known to the core before its refusal, and its session, never watched for it,
        # never left (one entry per refused session, forever).
        assert refused.id not in cache.core.users
    finally:
        cache.close()


def test_l1_evicts_unpinned_chunks_and_never_pinned_ones(tmp_path: Path) -> None:
    cache = Cache(tmp_path, chunks=4, lease_share=1.0)
    try:
        old = prompt(1, 2)
        cache.put("r", old)
        cache.put("r", prompt(3, 4, 5, 6))  # L1 holds 4: the old prompt is evicted
        step = cache.lookup("q", old)
        assert step is not None
        assert step.hit == 0
        assert cache.core.l1.stats().evictions >= 2
        pinned = prompt(3, 4, 5, 6)
        assert cache.lookup("q", pinned).hit == 4  # type: ignore[union-attr]
        slots, _, _ = cache.store("s", prompt(7))
        assert [s.status for s in slots] == ["failed"]  # all pinned: no room, nothing evicted
        assert cache.lookup("q", pinned).hit == 4  # type: ignore[union-attr]
    finally:
        cache.close()


@pytest.mark.parametrize("seed", range(5))
def test_a_random_workload_keeps_the_model_based_tests_invariants(
    tmp_path: Path, seed: int
) -> None:
    """The model-based test's properties (``tests/e2e/test_model_based.py``), on the core: a
    read slot holds its own chunk's bytes; a hit never exceeds the longest stored prefix;
    once every request and session has ended, no pin and no lease is left."""
    rng = random.Random(seed)
    cache = Cache(tmp_path, chunks=6, lease_share=1.0)
    stored: set[tuple[int, ...]] = set()  # prefixes committed at some point
    checked = 0
    try:
        for _ in range(400):
            values = tuple(rng.randrange(3) for _ in range(rng.randrange(1, 5)))
            hashes = prompt(*values)
            request = rng.choice(("r0", "r1", "r2"))
            action = rng.random()
            refused: list[ErrorCode] = []
            try:
                if action < 0.4:
                    slots, _, _ = cache.store(request, hashes)
                    cache.write(slots, hashes)
                    written = [h for s, h in zip(slots, hashes, strict=True) if s.status == "write"]
                    cache.commit(request, written)
                    stored.update(values[: i + 1] for i in range(len(values)))
                elif action < 0.9:
                    step = cache.lookup(request, hashes)
                    assert step is not None
                    assert step.hit == 0 or values[: step.hit] in stored
                    read = cache.retrieve(request, hashes[: step.hit])
                    for slot in read:
                        if slot.status == "read":
                            got = bytes(cache.arena.view(slot.offset, slot.nbytes))
                            assert got == fill(hashes[slot.chunk]).tobytes()
                            checked += 1
                    cache.release(request, hashes[: step.hit])
                    cache.end_request(request)
                else:
                    cache.clock.now += rng.choice((1.0, cache.config.pin_ttl + 1))
                    cache.core.expire(cache.clock.now)
            except RequestError as exc:
                refused.append(exc.code)
            assert set(refused) <= {ErrorCode.QUOTA_EXCEEDED, ErrorCode.BUSY}
        for owner in (WORKER.id, SCHEDULER.id):
            while cache.core.release_slice(owner, quarantine=False):
                pass
        assert cache.pins() == 0
        assert cache.core.leases.live == 0
        assert cache.core.l1.stats().writing == 0
        assert checked > 50  # the workload did read hits
    finally:
        cache.close()
