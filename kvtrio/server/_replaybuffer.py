"""The KV events' sequence numbers and replay buffers, one of each per topic (``_events``).

Each topic's batches are numbered from 0 (a subscriber sees a gap only where it missed one of
its own) and the last ``size`` of them, at most :data:`BUFFER_BYTES`, are kept for replay. No
I/O but the replay's sends, which never wait (the ROUTER socket drops beyond its high-water
mark).
"""

from __future__ import annotations

import collections

import trio

from ..protocol import encode_seq
from ..transport import Socket

__all__ = ["BATCH", "BUFFER_BYTES", "ReplayBuffers"]

BATCH = 64
"""Batches a replay sends per turn (as many as an events socket takes per wake-up)."""
BUFFER_BYTES = 64 << 20
"""The most bytes of batches a topic's replay buffer keeps (besides ``size`` batches): a batch
of stores carrying 64-byte block hashes is about a megabyte."""


class ReplayBuffers:
    """Per topic: the next sequence number and the last batches sent."""

    def __init__(self, size: int) -> None:
        self.size = size
        """Batches kept per topic (``events_buffer``)."""
        self._seq: dict[bytes, int] = {}
        self._buffers: dict[bytes, collections.deque[tuple[int, bytes]]] = {}
        self._bytes: collections.Counter[bytes] = collections.Counter()

    def __contains__(self, topic: bytes) -> bool:
        """Whether a batch was sent on ``topic``."""
        return topic in self._seq

    def next_seq(self, topic: bytes) -> int:
        """The sequence number of ``topic``'s next batch."""
        return self._seq.get(topic, 0)

    def only_topic(self) -> bytes | None:
        """The topic, if batches were sent on exactly one."""
        return next(iter(self._buffers)) if len(self._buffers) == 1 else None

    def skip(self, topic: bytes) -> None:
        """Skip ``topic``'s next sequence number: a batch that was never sent (and that no
        replay brings)."""
        self._seq[topic] = self._seq.get(topic, 0) + 1

    def add(self, topic: bytes, payload: bytes) -> int:
        """Number ``topic``'s next batch and keep it (dropping the oldest beyond the bounds);
        its sequence number."""
        seq = self._seq.get(topic, 0)
        self._seq[topic] = seq + 1
        buffer = self._buffers.get(topic)
        if buffer is None:
            buffer = self._buffers[topic] = collections.deque()
        buffer.append((seq, payload))
        size = self._bytes[topic] + len(payload)
        while len(buffer) > self.size or (size > BUFFER_BYTES and len(buffer) > 1):
            size -= len(buffer.popleft()[1])
        self._bytes[topic] = size
        return seq

    async def replay(self, router: Socket, peer: bytes, topic: bytes, start: int) -> int:
        """Send ``topic``'s kept batches from ``start`` on to ``peer``, :data:`BATCH` per turn
        (the buffer may move between turns: batches that left it are skipped); how many.
        Cancellation: between turns."""
        answered = 0
        buffer = self._buffers.get(topic)
        while buffer:
            first = buffer[0][0]
            index = max(start, first) - first
            if index >= len(buffer):
                break
            for i in range(index, min(index + BATCH, len(buffer))):
                seq, payload = buffer[i]
                router.try_send_multipart((peer, b"", topic, encode_seq(seq), payload))
                answered += 1
                start = seq + 1
            await trio.lowlevel.checkpoint()
        return answered
