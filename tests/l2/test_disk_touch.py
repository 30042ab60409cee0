"""Issue 22, item 3 (the disk backend's part): ``touch`` refreshes objects in its eviction
policy, as a lookup hit does, so what is used from the server's L1 is not what goes first."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtrio.l2._diskio import record_size
from kvtrio.l2.disk import DiskBackend, DiskOptions
from kvtrio.options import ByteSize
from kvtrio.storage import EVICTION_POLICIES


def _obj() -> list[bytes]:
    return [b"h" * 72, b"p" * 1000]


@pytest.mark.parametrize("eviction", sorted(EVICTION_POLICIES))
async def test_a_touched_object_outlives_untouched_ones(tmp_path: Path, eviction: str) -> None:
    backend = DiskBackend(
        DiskOptions(path=str(tmp_path), capacity=ByteSize(8 * record_size(1072)), eviction=eviction)
    )
    assert backend.accepts_touches
    hot = [bytes([0, i]) * 16 for i in range(2)]  # a prompt of two chunks
    assert await backend.store(hot, [_obj()] * 2, parents=[None, hot[0]]) == [True, True]
    for n in range(30):  # cold prompts pass; the hot one is used (from L1) all along
        await backend.touch(list(reversed(hot)))  # (the server's order: the head last)
        cold = [bytes([1 + n, i]) * 16 for i in range(2)]
        assert await backend.store(cold, [_obj()] * 2, parents=[None, cold[0]]) == [True, True]
    assert backend.statistics()["evictions"] >= 50
    assert await backend.lookup_and_lock(hot) == 2, eviction
    await backend.unlock(hot)
    await backend.aclose()


async def test_without_touches_the_hot_prompt_goes_first(tmp_path: Path) -> None:
    """The defect the touches fix: stored once and never looked up in L2, it is evicted."""
    backend = DiskBackend(DiskOptions(path=str(tmp_path), capacity=ByteSize(8 * record_size(1072))))
    hot = [bytes([0, i]) * 16 for i in range(2)]
    assert await backend.store(hot, [_obj()] * 2, parents=[None, hot[0]]) == [True, True]
    for n in range(30):
        cold = [bytes([1 + n, i]) * 16 for i in range(2)]
        assert await backend.store(cold, [_obj()] * 2, parents=[None, cold[0]]) == [True, True]
    assert await backend.lookup_and_lock(hot) == 0
    await backend.aclose()
