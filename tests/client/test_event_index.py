"""The client's KV event index (:class:`kvtrio.client.EventIndex`), fed encoded batches."""

from __future__ import annotations

from kvtrio.client import EventIndex
from kvtrio.protocol._events import BlockRemoved, BlockStored, encode_batch

TOPIC = b"kvtrio//"


def stored(hashes: tuple[int, ...], group: int | None) -> BlockStored:
    return BlockStored(hashes, None, (), 16, "CPU", group_idx=group)


def test_one_groups_removal_leaves_the_other_groups_blocks() -> None:
    """A hybrid engine's groups name a block alike (vLLM's ``group_idx`` tells them apart):
    the sliding group's chunk leaving L1 does not make the full-attention group's, under the
    same block hashes, look gone."""
    index = EventIndex()
    index.apply(TOPIC, 0, encode_batch(1.0, [stored((1, 2), 0), stored((1, 2), 1)]))
    assert index.holds([1, 2], TOPIC) == {"CPU": 2}
    assert index.media(TOPIC) == {"CPU": 2}
    index.apply(TOPIC, 1, encode_batch(2.0, [BlockRemoved((1, 2), "CPU", group_idx=1)]))
    assert index.holds([1, 2], TOPIC) == {"CPU": 2}
    assert index.blocks(TOPIC) == {"CPU": {1, 2}}
    index.apply(TOPIC, 2, encode_batch(3.0, [BlockRemoved((1, 2), "CPU", group_idx=0)]))
    assert index.holds([1, 2], TOPIC) == {}
    # one group (no group_idx): as before
    index.apply(TOPIC, 3, encode_batch(4.0, [stored((3,), None)]))
    index.apply(TOPIC, 4, encode_batch(5.0, [BlockRemoved((3,), "CPU")]))
    assert index.blocks(TOPIC) == {}
