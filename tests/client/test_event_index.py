"""The client's KV event index (:class:`kvtrio.client.EventIndex`), fed encoded batches."""

from __future__ import annotations

from pathlib import Path

import trio
import zmq

from kvtrio.client import EventIndex, subscribe
from kvtrio.protocol import encode_seq
from kvtrio.protocol._events import BlockRemoved, BlockStored, encode_batch
from kvtrio.transport import open_socket

from .._support.waiting import await_condition

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


def test_a_live_number_not_above_the_last_live_one_is_a_new_stream() -> None:
    """A topic's second subscriber after a publisher restart never gets the new stream's
    batch 0 (sent to a topic's first subscriber only). Was: its batch 1 was taken for a
    duplicate of the old stream, and the old stream's blocks kept."""
    index = EventIndex()
    for seq in range(9):
        assert index.apply(TOPIC, seq, encode_batch(1.0, [stored((seq,), None)]), live=True) is None
    assert index.holds(list(range(9)), TOPIC) == {"CPU": 9}
    new = encode_batch(2.0, [stored((100,), None)])
    assert index.apply(TOPIC, 1, new, live=True) == range(1)  # replay the new stream's 0
    assert index.restarts == 1
    assert index.holds(list(range(9)), TOPIC) == {}  # the old stream's blocks are gone
    assert index.apply(TOPIC, 0, encode_batch(2.0, [])) is None  # (the replay)
    assert index.holds([100], TOPIC) == {"CPU": 1}
    # replays never count as live: a replay's older batch is a duplicate, as before
    assert index.apply(TOPIC, 1, new) is None
    assert index.restarts == 1


async def test_a_replay_that_is_never_answered_ends_and_the_stream_goes_on(
    short_dir: Path,
) -> None:
    """A gap's replay whose answer never comes (a replay socket drops what its peer cannot
    take, the end marker too). Was: the subscriber waited for it for ever, and applied nothing
    more; now the replay and the snapshot after it go quiet, the gap counts as lost, and the
    live stream is applied on."""
    endpoint, replay_endpoint = f"ipc://{short_dir}/ev", f"ipc://{short_dir}/ev.replay"
    topic = b"kvtrio//"
    index = EventIndex()
    async with (
        open_socket(zmq.XPUB) as pub,
        open_socket(zmq.ROUTER) as replay,  # reads the requests, answers none
    ):
        pub.bind(endpoint)
        replay.bind(replay_endpoint)
        async with subscribe(index, endpoint, replay_endpoint, topic, snapshot=False):
            assert await pub.recv_multipart() == [b"\x01" + topic]  # subscribed
            batch = encode_batch(0.0, [BlockStored((1,), None, (), 16, "CPU")])
            await pub.send_multipart([topic, encode_seq(5), batch])  # 0-4 missed: a gap
            with trio.fail_after(10):
                await replay.recv_multipart()  # the replay asked for
                await replay.recv_multipart()  # then the snapshot
                await await_condition(lambda: index.lost == 5, what="the gap given up")
            await pub.send_multipart([topic, encode_seq(6), batch])
            await await_condition(lambda: index.expected(topic) == 7, what="the stream on")
