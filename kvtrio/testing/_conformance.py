"""The test suite every L2 backend runs: ours and third parties'.

Use it from a backend package's tests (pytest with pytest-trio in trio mode)::

    from kvtrio.testing import BackendConformance

    class TestMyBackend(BackendConformance):
        @pytest.fixture
        async def backend(self):
            backend = MyBackend(MyBackend.Options(url=...))
            yield backend
            await backend.aclose()

Class attributes tune it: ``object_size`` (bytes per test object) and
``protects_locked_objects`` (False where the store may evict or delete a locked object anyway,
like Redis under memory pressure: then a load of it is simply a miss).

**Faults.** List in ``fault_kinds`` the faults your tests can cause, and implement
:meth:`BackendConformance.fault` (an async context manager: the fault holds inside it, is gone
after it). Cause them for real where you can (a read-only mount, a full small filesystem, Redis
``maxmemory``, a stopped server), inject them only where you cannot (``EIO``). The kinds:
``read_only``, ``full`` (``ENOSPC``, out of memory), ``eio``, ``dir_replaced`` (the storage
directory replaced by a file), ``unavailable`` (the service is down). During a fault every
operation must raise (any exception: the server turns each into a backend error) or answer a
miss / ``False`` — never wrong data, never a visible half-written object; afterwards the backend
works again by itself, with nothing left locked.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager
from typing import Any, ClassVar, cast

import pytest
import trio

from ..l2 import (
    HEADER_SIZE,
    Backend,
    BackendError,
    Corrupt,
    Naming,
    Touching,
    capabilities,
    check,
    header,
)

__all__ = ["BackendConformance"]

FINGERPRINT = b"conformance-fp16"


def _key(label: str) -> bytes:
    return (label.encode() + os.urandom(32))[:32]


def _object(key: bytes, size: int, fill: int | None = None) -> tuple[bytes, bytearray]:
    payload = bytearray(os.urandom(size) if fill is None else bytes([fill]) * size)
    return header(key, FINGERPRINT, payload), payload


def _parts(head: bytes, payload: bytearray) -> list[memoryview]:
    return [memoryview(head), memoryview(payload)]


class BackendConformance:
    """Subclass it and provide an async ``backend`` fixture (see the module docstring)."""

    object_size = 64 << 10
    protects_locked_objects = True
    fault_kinds: ClassVar[tuple[str, ...]] = ()
    """The faults :meth:`fault` can cause for this backend (see the module docstring)."""
    FAULT_KINDS: ClassVar[tuple[str, ...]] = (
        "read_only",
        "full",
        "eio",
        "dir_replaced",
        "unavailable",
    )

    def fault(self, backend: Backend, kind: str) -> AbstractAsyncContextManager[None]:
        """Cause fault ``kind`` (one of :attr:`fault_kinds`) for the duration of the block."""
        raise NotImplementedError(f"{type(self).__name__} lists {kind!r} but cannot cause it")

    @pytest.fixture
    async def backend(self) -> AsyncIterator[Backend]:
        raise NotImplementedError("provide a `backend` fixture in your subclass")
        yield  # type: ignore[unreachable]  # noqa: PT022 - a generator, like subclasses write

    # ----------------------------------------------------------------- helpers

    async def put(self, backend: Backend, key: bytes, fill: int | None = None) -> bytearray:
        head, payload = _object(key, self.object_size, fill)
        assert await backend.store([key], [_parts(head, payload)]) == [True]
        return payload

    async def get(self, backend: Backend, key: bytes) -> bytearray | None:
        """Load a framed object and verify it; None for a miss."""
        head, payload = bytearray(HEADER_SIZE), bytearray(self.object_size)
        (ok,) = await backend.load([key], [[memoryview(head), memoryview(payload)]])
        if not ok:
            return None
        check(bytes(head), key, FINGERPRINT, memoryview(payload))
        return payload

    def locks(self, backend: Backend) -> float:
        return backend.statistics()["locks"]

    # ----------------------------------------------------------------- the suite

    async def test_round_trip(self, backend: Backend) -> None:
        key = _key("round-trip")
        payload = await self.put(backend, key)
        assert await self.get(backend, key) == payload

    async def test_store_replaces(self, backend: Backend) -> None:
        key = _key("replace")
        await self.put(backend, key, fill=1)
        second = await self.put(backend, key, fill=2)
        assert await self.get(backend, key) == second

    async def test_many_keys_in_one_call(self, backend: Backend) -> None:
        keys = [_key(f"batch{i}") for i in range(5)]
        objects = [_object(key, self.object_size) for key in keys]
        assert await backend.store(keys, [_parts(h, p) for h, p in objects]) == [True] * 5
        heads = [bytearray(HEADER_SIZE) for _ in keys]
        payloads = [bytearray(self.object_size) for _ in keys]
        buffers = [[memoryview(h), memoryview(p)] for h, p in zip(heads, payloads, strict=True)]
        assert await backend.load(keys, buffers) == [True] * 5
        assert payloads == [p for _, p in objects]

    async def test_a_store_with_parents_if_the_backend_takes_them(self, backend: Backend) -> None:
        """``accepts_parents`` (optional): ``store(..., parents=)`` stores like a plain store."""
        if not capabilities(backend).parents:
            pytest.skip("the backend does not take parents (optional)")
        keys = [_key(f"parents{i}") for i in range(3)]
        objects = [_object(key, self.object_size) for key in keys]
        extra: dict[str, Any] = {"parents": [None, keys[0], keys[1]]}
        parts = [_parts(h, p) for h, p in objects]
        assert await backend.store(keys, parts, **extra) == [True] * 3
        assert await backend.lookup_and_lock(keys) == 3
        await backend.unlock(keys)
        for key, (_, payload) in zip(keys, objects, strict=True):
            assert await self.get(backend, key) == payload

    async def test_a_store_with_owners_if_the_backend_takes_them(self, backend: Backend) -> None:
        """``accepts_owners`` (optional): ``store(..., owners=)`` stores like a plain store,
        with ``parents=`` too where the backend takes both."""
        if not capabilities(backend).owners:
            pytest.skip("the backend does not take owners (optional)")
        keys = [_key(f"owners{i}") for i in range(3)]
        objects = [_object(key, self.object_size) for key in keys]
        extra: dict[str, Any] = {"owners": [b"a" * 16, b"b" * 16, b"a" * 16]}
        if capabilities(backend).parents:
            extra["parents"] = [None, keys[0], keys[1]]
        parts = [_parts(h, p) for h, p in objects]
        assert await backend.store(keys, parts, **extra) == [True] * 3
        assert await backend.lookup_and_lock(keys) == 3
        await backend.unlock(keys)
        for key, (_, payload) in zip(keys, objects, strict=True):
            assert await self.get(backend, key) == payload

    async def test_touch_if_the_backend_takes_touches(self, backend: Backend) -> None:
        """``accepts_touches`` (optional): ``touch`` of stored, locked, unknown and deleted keys
        changes nothing visible (no lock taken or dropped, no object made or lost)."""
        if not capabilities(backend).touches:
            pytest.skip("the backend does not take touches (optional)")
        keys = [_key(f"touch{i}") for i in range(3)]
        payloads = [await self.put(backend, key) for key in keys]
        missing = _key("touch-missing")
        assert await backend.lookup_and_lock(keys[:1]) == 1
        touch = cast(Touching, backend).touch
        await touch([*reversed(keys), missing])
        await touch([])
        assert self.locks(backend) == 1
        await backend.unlock(keys[:1])
        assert self.locks(backend) == 0
        assert await backend.lookup_and_lock([missing]) == 0
        for key, payload in zip(keys, payloads, strict=True):
            assert await self.get(backend, key) == payload
        await backend.delete(keys[:1])
        await touch(keys[:1])
        assert await backend.lookup_and_lock(keys[:1]) == 0
        assert await self.get(backend, keys[0]) is None
        assert self.locks(backend) == 0

    async def test_names_if_the_backend_keeps_them(self, backend: Backend) -> None:
        """``accepts_names`` (optional): ``store(..., names=)`` stores like a plain store, and
        ``names(prefix, limit)`` gives back names as they were given (a backend may leave out
        names it has no room for), of the prefix's objects still stored, the newest first,
        within ``limit`` bytes; never another prefix's, a deleted object's, or one stored
        without names."""
        if not capabilities(backend).names:
            pytest.skip("the backend keeps no names (optional)")
        prefix = os.urandom(16)
        keys = [prefix + os.urandom(16) for _ in range(4)]
        other = os.urandom(32)
        given: list[bytes | None] = [b"names 0", b"names 1", None, b"names 3"]
        objects = [_object(key, self.object_size) for key in [*keys, other]]
        parts = [_parts(h, p) for h, p in objects]
        extra: dict[str, Any] = {"names": [*given, b"another prefix"]}
        assert await backend.store([*keys, other], parts, **extra) == [True] * 5
        for key, (_, payload) in zip(keys, objects[:4], strict=True):
            assert await self.get(backend, key) == payload
        await backend.delete(keys[3:])
        naming = cast(Naming, backend)
        found = await naming.names(prefix, 1 << 20)
        kept = {keys[0]: given[0], keys[1]: given[1]}
        assert all(kept.get(key) == record for key, record in found), found
        assert [key for key, _ in found] == [k for k in (keys[1], keys[0]) if k in dict(found)]
        limited = await naming.names(prefix, 7)
        assert sum(len(record) for _, record in limited) <= 7
        assert await naming.names(os.urandom(16), 1 << 20) == []

    async def test_prefix_semantics(self, backend: Backend) -> None:
        keys = [_key(f"prefix{i}") for i in range(4)]
        for key in (keys[0], keys[1], keys[3]):
            await self.put(backend, key)
        assert await backend.lookup_and_lock(keys) == 2
        assert await backend.lookup_and_lock(keys[3:]) == 1
        assert await backend.lookup_and_lock(keys[2:]) == 0
        assert await backend.lookup_and_lock([]) == 0
        await backend.unlock(keys[:2])
        await backend.unlock(keys[3:])
        assert self.locks(backend) == 0

    async def test_missing_keys(self, backend: Backend) -> None:
        key = _key("missing")
        assert await self.get(backend, key) is None
        await backend.delete([key])
        await backend.unlock([key])  # ignored
        assert self.locks(backend) == 0

    async def test_a_load_into_buffers_of_another_size_is_a_miss(self, backend: Backend) -> None:
        key = _key("size")
        await self.put(backend, key)
        short = [memoryview(bytearray(HEADER_SIZE)), memoryview(bytearray(self.object_size - 1))]
        assert await backend.load([key], [short]) == [False]

    async def test_lock_refcounts(self, backend: Backend) -> None:
        key = _key("locks")
        payload = await self.put(backend, key)
        assert await backend.lookup_and_lock([key]) == 1
        assert await backend.lookup_and_lock([key]) == 1
        assert self.locks(backend) == 2
        await backend.delete([key])
        if self.protects_locked_objects:
            assert await self.get(backend, key) == payload, "a locked object was deleted"
        await backend.unlock([key])
        assert self.locks(backend) == 1
        await backend.unlock([key])
        await backend.unlock([key])  # one too many: ignored
        assert self.locks(backend) == 0
        assert await self.get(backend, key) is None  # the delete took effect once unlocked
        assert await backend.lookup_and_lock([key]) == 0

    async def test_delete(self, backend: Backend) -> None:
        key = _key("delete")
        await self.put(backend, key)
        await backend.delete([key])
        assert await self.get(backend, key) is None

    async def test_concurrent_stores_and_loads_of_one_key_never_tear(
        self, backend: Backend
    ) -> None:
        key = _key("concurrent")
        await self.put(backend, key, fill=0)
        seen: list[int] = []

        async def writer(fill: int) -> None:
            for _ in range(5):
                await self.put(backend, key, fill=fill)

        async def reader() -> None:
            for _ in range(10):
                payload = await self.get(backend, key)  # check() raises on a torn object
                if payload is not None:
                    assert len(set(payload)) == 1
                    seen.append(payload[0])

        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                for fill in (1, 2):
                    nursery.start_soon(writer, fill)
                for _ in range(3):
                    nursery.start_soon(reader)
        assert seen, "no load saw the object"
        assert set(seen) <= {0, 1, 2}

    async def test_corrupted_objects_are_detected(self, backend: Backend) -> None:
        key = _key("corrupt")
        head, payload = _object(key, self.object_size)
        flipped = bytearray(payload)
        flipped[len(flipped) // 2] ^= 0x40
        assert await backend.store([key], [_parts(head, flipped)]) == [True]  # a bit flip at rest
        with pytest.raises(Corrupt, match="checksum"):
            await self.get(backend, key)
        truncated = bytearray(payload[:-100])
        assert await backend.store([key], [_parts(head, truncated)]) == [True]
        assert await self.get(backend, key) is None  # wrong length: a miss
        other = _key("other")
        assert await backend.store(
            [key], [_parts(header(other, FINGERPRINT, payload), payload)]
        ) == [True]
        with pytest.raises(Corrupt, match="another key"):
            await self.get(backend, key)

    async def test_cancellation_leaves_nothing_locked(self, backend: Backend) -> None:
        keys = [_key(f"cancel{i}") for i in range(3)]
        for key in keys:
            await self.put(backend, key)
        locked = 0
        for attempt in range(40):
            with trio.move_on_after(attempt * 0.0005):
                count = await backend.lookup_and_lock(keys)
                locked += count
                await backend.unlock(keys[:count])
                locked -= count
            with trio.move_on_after(attempt * 0.0005):
                await self.get(backend, keys[0])
        assert locked == 0
        assert self.locks(backend) == 0

    async def test_aclose_with_operations_in_flight(self, backend: Backend) -> None:
        keys = [_key(f"close{i}") for i in range(4)]
        for key in keys:
            await self.put(backend, key)

        async def busy() -> None:
            try:
                for _ in range(20):
                    await self.get(backend, keys[0])
                    await self.put(backend, keys[1])
            except (BackendError, trio.ClosedResourceError):
                pass  # operations racing aclose may fail, but must not hang or crash

        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                for _ in range(3):
                    nursery.start_soon(busy)
                await trio.sleep(0.01)
                await backend.aclose()

    async def test_statistics(self, backend: Backend) -> None:
        stats = backend.statistics()
        assert "locks" in stats
        assert all(isinstance(value, (int, float)) for value in stats.values())

    # ----------------------------------------------------------------- faults

    async def test_faults_are_errors_or_misses_never_wrong_data(self, backend: Backend) -> None:
        assert set(self.fault_kinds) <= set(self.FAULT_KINDS), self.fault_kinds
        for kind in self.fault_kinds:
            await self._survive(backend, kind)

    async def _survive(self, backend: Backend, kind: str) -> None:
        before = _key(f"{kind}-before")
        kept = await self.put(backend, before)
        during = _key(f"{kind}-during")
        head, payload = _object(during, self.object_size)
        async with self.fault(backend, kind):
            try:
                stored = await backend.store([during], [_parts(head, payload)])
            except Exception:
                stored = [False]
            assert stored == [False], f"{kind}: a store succeeded anyway"
            try:
                found = await backend.lookup_and_lock([before, during])
            except Exception:
                found = 0
            else:
                await backend.unlock([before, during][:found])
            await self._load_is_right_or_nothing(backend, before, kept, kind)
        # The fault is gone: the backend works again by itself (it may have lost objects).
        with trio.fail_after(30):
            while True:
                try:
                    after = _key(f"{kind}-after")
                    fresh = await self.put(backend, after)
                    break
                except Exception:
                    await trio.sleep(0.1)
        assert await self.get(backend, after) == fresh, f"{kind}: not working again"
        await self._load_is_right_or_nothing(backend, before, kept, kind)
        if stored == [False]:
            assert await backend.lookup_and_lock([during]) == 0, f"{kind}: a failed store shows"
        assert self.locks(backend) == 0, f"{kind}: locks left"

    async def _load_is_right_or_nothing(
        self, backend: Backend, key: bytes, payload: bytearray, kind: str
    ) -> None:
        head, got = bytearray(HEADER_SIZE), bytearray(self.object_size)
        try:
            (ok,) = await backend.load([key], [[memoryview(head), memoryview(got)]])
        except Exception:
            return
        if ok:
            check(bytes(head), key, FINGERPRINT, memoryview(got))
            assert got == payload, f"{kind}: a load returned other bytes"
