"""A topic's current blocks for a late or recovering subscriber (``[b"", SNAPSHOT_SEQ, topic]``
on the replay socket): what a subscriber that applied every event from the topic's start holds,
and the sequence number the live stream goes on from.

The answer is ``BlockStored`` batches ``[b"", topic, SNAPSHOT_SEQ, payload]`` of at most
:data:`SNAPSHOT_EVENTS` events each, then ``[b"", b"", END_SEQ, next_seq]``. The chunks and their
tiers are taken at the request (``Announcer.snapshot``), and ``next_seq`` with them: the events
still queued for the next batch are in the snapshot already, and applying them again changes
nothing (a ``BlockStored`` or ``BlockRemoved`` of a block in a medium sets what the last one
said), so the snapshot, then the batches from ``next_seq`` on, is the server's state with no gap.
Bounded as a replay: the same rate per key, one batch encoded and sent per turn; its size
follows the tenant's names (``NAMES_BYTES``).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator

import trio

from ..protocol import END_SEQ, SNAPSHOT_SEQ, KVEvent, encode_batch, encode_seq
from ..transport import Socket

__all__ = ["SNAPSHOT_EVENTS", "Snapshots", "send_snapshot"]

SNAPSHOT_EVENTS = 1000
"""Events in one batch of a snapshot (a few ms to encode)."""

Snapshots = Callable[[str], Iterator[KVEvent]]
"""``snapshots(tenant)``: the tenant's current blocks as events (the chunks taken at the call)."""


async def send_snapshot(
    router: Socket, peer: bytes, topic: bytes, events: Iterator[KVEvent], next_seq: int
) -> int:
    """Send ``events`` as snapshot batches of ``topic`` to ``peer``, then the end marker
    carrying ``next_seq``; the number of batches. Cancellation: between batches (the peer sees
    no end marker and asks again)."""
    batches = 0
    while chunk := list(itertools.islice(events, SNAPSHOT_EVENTS)):
        payload = encode_batch(time.time(), chunk)
        router.try_send_multipart((peer, b"", topic, SNAPSHOT_SEQ, payload))
        batches += 1
        await trio.lowlevel.checkpoint()
    router.try_send_multipart((peer, b"", b"", END_SEQ, encode_seq(next_seq)))
    return batches
