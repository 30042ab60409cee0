"""A consumer of KV events (kvtrio's stream, or any vLLM engine's): an index of which tier
holds which block, kept in step by sequence numbers and replay.

:class:`EventIndex` applies batches (no I/O) and answers "which tier holds how much of this
prompt": the blocks of a prompt, from its first, that each ``medium`` holds. It checks each
topic's sequence numbers: a batch after a gap is held back while the gap is replayed
(:meth:`EventIndex.apply` says which sequence numbers are missing); a stream that starts again
(a sequence number lower than expected, or ``AllBlocksCleared``) clears what the topic had
announced. :meth:`EventIndex.restore` replaces a topic's state by a kvtrio server's snapshot
(its current blocks, and the sequence number the stream goes on from). :func:`subscribe` runs
one over a SUB socket and its replay socket (trio): a snapshot first, then the live stream;
a gap is replayed, and a gap the replay buffer no longer holds is filled by a new snapshot.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

import trio
import zmq

from ..protocol import (
    END_SEQ,
    SNAPSHOT_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    decode_batch,
    decode_seq,
    encode_seq,
)
from ..transport import Socket, open_socket

__all__ = ["EventIndex", "subscribe"]

REPLAY_QUIET = 2.0
"""Seconds a replay or snapshot answer may go quiet before it counts as ended."""


class EventIndex:
    """Block hash → the media that hold it, per topic, from KV event batches. A hybrid engine's
    groups name a block alike (vLLM's ``group_idx`` tells them apart): a block is held on a
    medium while any group's copy is there, and one group's removal leaves the others'."""

    def __init__(self) -> None:
        self._tiers: dict[bytes, dict[int | bytes, set[tuple[str, int | None]]]] = {}
        """topic → block hash → the (medium, group) pairs that hold it."""
        self._next: dict[bytes, int] = {}
        self._live: dict[bytes, int] = {}
        """The last sequence number each topic's live stream brought."""
        self._held: dict[bytes, dict[int, bytes]] = {}
        self._restored: set[bytes] = set()
        """Topics restored from a snapshot that no live batch followed yet."""
        self.gaps = 0
        """Sequence gaps seen (each replayed or, if the replay had lost it, counted lost)."""
        self.restarts = 0
        """Streams that started again (a publisher restarted)."""
        self.lost = 0
        """Batches a gap lost for good (the replay buffer no longer held them)."""
        self.applied = 0
        self.undecodable = 0
        """Batches that did not decode (skipped, in sequence)."""
        self.snapshots = 0
        """Snapshots applied (:meth:`restore`)."""

    def expected(self, topic: bytes) -> int:
        """The next sequence number ``topic`` should bring (0 before any)."""
        return self._next.get(topic, 0)

    def apply(self, topic: bytes, seq: int, payload: bytes, *, live: bool = False) -> range | None:
        """Apply one message, in sequence order: a message after a gap is held back and the
        missing range returned (replay it, then call :meth:`give_up` for what the replay did
        not bring); a message already applied is ignored. ``live``: it came from the live
        socket, whose numbers only grow on one connection: one not above the last live one is
        a new stream (the publisher started again), whatever its number (was: only seq 0 said
        so, which only a topic's first subscriber gets)."""
        expected = self._next.setdefault(topic, 0)  # (joining a running stream: a gap)
        last = self._live.get(topic)
        if live:
            self._live[topic] = seq
        restarted = live and last is not None and seq <= last
        if restarted or (seq < expected and seq == 0 and topic not in self._restored):
            # The publisher started again: what it said before is gone. (Right after a
            # snapshot, an older batch numbered 0 is one the snapshot covers.)
            self.restarts += 1
            self._clear(topic)
            self._held.pop(topic, None)
            self._next[topic] = 0
            return self.apply(topic, seq, payload)
        if seq < expected:
            return None  # a duplicate (a replay overlapping the live stream)
        if seq > expected:
            held = self._held.setdefault(topic, {})
            first_gap = not held
            held[seq] = payload
            if first_gap:
                self.gaps += 1
            return range(expected, min(held))
        self._apply(topic, payload)
        self._next[topic] = seq + 1
        self._restored.discard(topic)
        self._drain(topic)
        return None

    def give_up(self, topic: bytes) -> None:
        """The replay did not bring the missing batches: skip to the held ones (the index may
        now miss what they said; counted in :attr:`lost`)."""
        held = self._held.get(topic)
        if not held:
            return
        first = min(held)
        self.lost += first - self._next.get(topic, 0)
        self._next[topic] = first
        self._drain(topic)

    def restore(self, topic: bytes, payloads: Sequence[bytes], next_seq: int) -> None:
        """Make ``topic``'s state a snapshot's: its batches of ``BlockStored`` (``payloads``),
        then the stream from ``next_seq`` on (batches held back before it are dropped, those
        from it on applied)."""
        self._clear(topic)
        self._tiers[topic] = {}
        for payload in payloads:
            self._apply(topic, payload)
        held = self._held.get(topic, {})
        for seq in [s for s in held if s < next_seq]:
            del held[seq]
        self._next[topic] = next_seq
        self._restored.add(topic)
        self._drain(topic)
        self.snapshots += 1

    def _drain(self, topic: bytes) -> None:
        held = self._held.get(topic, {})
        while (payload := held.pop(self._next[topic], None)) is not None:
            self._apply(topic, payload)
            self._next[topic] += 1

    def _apply(self, topic: bytes, payload: bytes) -> None:
        tiers = self._tiers.setdefault(topic, {})
        try:
            batch = decode_batch(payload)
        except ValueError:
            self.undecodable += 1
            return
        for event in batch.events:
            if type(event) is BlockStored:
                where = (event.medium or "", event.group_idx)
                for h in event.block_hashes:
                    tiers.setdefault(h, set()).add(where)
            elif type(event) is BlockRemoved:
                where = (event.medium or "", event.group_idx)
                for h in event.block_hashes:
                    held = tiers.get(h)
                    if held is not None:
                        held.discard(where)
                        if not held:
                            del tiers[h]
            elif type(event) is AllBlocksCleared:
                tiers.clear()
        self.applied += 1

    def _clear(self, topic: bytes) -> None:
        self._tiers.pop(topic, None)

    def blocks(self, topic: bytes | None = None) -> dict[str, set[int | bytes]]:
        """Every block held, per medium (to compare with the server's state)."""
        result: dict[str, set[int | bytes]] = {}
        tables = [self._tiers.get(topic, {})] if topic is not None else list(self._tiers.values())
        for table in tables:
            for h, held in table.items():
                for medium, _ in held:
                    result.setdefault(medium, set()).add(h)
        return result

    def holds(
        self, block_hashes: Sequence[int | bytes], topic: bytes | None = None
    ) -> dict[str, int]:
        """For each medium, how many of ``block_hashes`` (a prompt's, in order) it holds from
        the first on."""
        result: dict[str, int] = {}
        tables = [self._tiers.get(topic, {})] if topic is not None else list(self._tiers.values())
        open_media: set[str] | None = None
        for count, h in enumerate(block_hashes):
            media: set[str] = set()
            for table in tables:
                media |= {medium for medium, _ in table.get(h, ())}
            open_media = media if open_media is None else open_media & media
            for medium in open_media:
                result[medium] = count + 1
            if not open_media:
                break
        return result

    def media(self, topic: bytes | None = None) -> Mapping[str, int]:
        """How many blocks each medium holds."""
        counts: dict[str, int] = {}
        tables = [self._tiers.get(topic, {})] if topic is not None else list(self._tiers.values())
        for table in tables:
            for held in table.values():
                for medium in {medium for medium, _ in held}:
                    counts[medium] = counts.get(medium, 0) + 1
        return counts


async def _answer(replay: Socket) -> list[bytes] | None:
    """The replay socket's next message, or None once it was quiet for :data:`REPLAY_QUIET`
    seconds (an answer's end lost: the replay socket drops what its peer cannot take)."""
    with trio.move_on_after(REPLAY_QUIET):
        return await replay.recv_multipart()
    return None


async def _replay(replay: Socket, index: EventIndex, topic: bytes, missing: range) -> None:
    """Ask the replay socket for ``missing`` of ``topic`` and apply what comes back; what it no
    longer had is filled by a snapshot (or, from a publisher without snapshots, given up). An
    answer that goes quiet ends (was: waited for for ever, the live stream with it)."""
    await replay.send_multipart([b"", encode_seq(missing.start), topic])
    while True:
        frames = await _answer(replay)
        if frames is None:
            break
        if len(frames) < 4:
            continue
        _, got_topic, seq, payload = frames[-4:]
        if seq == END_SEQ:
            break
        index.apply(got_topic, decode_seq(seq), payload)
    if index.expected(topic) < missing.stop and not await _snapshot(replay, index, topic):
        index.give_up(topic)


async def _snapshot(replay: Socket, index: EventIndex, topic: bytes) -> bool:
    """Ask for ``topic``'s snapshot and restore ``index`` from it; False if the publisher
    has none (a vLLM engine's replay socket answers the end marker alone)."""
    await replay.send_multipart([b"", SNAPSHOT_SEQ, topic])
    payloads: list[bytes] = []
    while True:
        frames = await _answer(replay)
        if frames is None:
            return False
        if len(frames) < 4:
            continue
        _, got_topic, seq, payload = frames[-4:]
        if seq == END_SEQ:
            if len(payload) != 8:
                return False
            index.restore(topic, payloads, decode_seq(payload))
            return True
        if seq == SNAPSHOT_SEQ and got_topic == topic:
            payloads.append(payload)


@asynccontextmanager
async def subscribe(
    index: EventIndex,
    endpoint: str,
    replay_endpoint: str,
    topic: bytes,
    *,
    options: Mapping[int, Any] | None = None,
    snapshot: bool = True,
) -> AsyncIterator[None]:
    """Keep ``index`` in step with ``topic`` of the publisher at ``endpoint`` for the block
    (``options``: CURVE client options, e.g. :func:`~kvtrio.client.curve_options`): with
    ``snapshot``, the topic's current blocks first (a kvtrio server's; other publishers have
    none), then the live stream. A gap (or joining a running stream) is replayed from
    ``replay_endpoint``, and what the replay no longer has is filled by a snapshot.
    Cancellation: the sockets close; the index keeps what it applied."""
    sub_options = {**(options or {}), zmq.SUBSCRIBE: topic}
    async with (
        open_socket(zmq.SUB, options=sub_options) as sub,
        open_socket(zmq.DEALER, options=dict(options or {})) as replay,
        trio.open_nursery() as nursery,
    ):
        sub.connect(endpoint)
        replay.connect(replay_endpoint)

        async def run() -> None:
            if snapshot:
                await _snapshot(replay, index, topic)
            while True:
                frames = await sub.recv_multipart()
                if len(frames) != 3:
                    continue
                missing = index.apply(frames[0], decode_seq(frames[1]), frames[2], live=True)
                if missing:
                    await _replay(replay, index, frames[0], missing)

        nursery.start_soon(run)
        try:
            yield
        finally:
            nursery.cancel_scope.cancel()
