"""The memory backend's own rules (``kvtrio.l2.memory``) beyond the conformance kit's."""

from __future__ import annotations

from kvtrio.l2.memory import MemoryBackend, MemoryOptions
from kvtrio.options import ByteSize


def parts(fill: int, size: int) -> list[memoryview]:
    return [memoryview(bytes([fill]) * size)]


async def test_a_refused_store_leaves_the_object_it_would_replace() -> None:
    """Was: the old object was dropped before room was sought, also while locked."""
    backend = MemoryBackend(MemoryOptions(capacity=ByteSize(2000)))
    k1, k2 = b"1" * 32, b"2" * 32
    assert await backend.store([k1, k2], [parts(1, 1000), parts(2, 1000)]) == [True, True]
    assert await backend.lookup_and_lock([k1, k2]) == 2  # neither may be evicted
    assert await backend.store([k1], [parts(3, 1500)]) == [False]  # k2 locked: no room
    buffer = bytearray(1000)
    assert await backend.load([k1], [[memoryview(buffer)]]) == [True]
    assert buffer == bytes([1]) * 1000
    assert await backend.store([k1], [parts(4, 1000)]) == [True]  # its own room: replaced
    assert await backend.load([k1], [[memoryview(buffer)]]) == [True]
    assert buffer == bytes([4]) * 1000
    assert backend.statistics()["bytes"] == 2000
