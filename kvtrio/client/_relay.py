"""A synchronous relay of a kvtrio server's KV events, for an engine's own event publisher.

An engine connector (vLLM's ``take_events``) calls :meth:`EventRelay.take` at every scheduler
step and never waits: a daemon thread subscribes to the tenant's topic, replays gaps from the
replay socket (a subscriber that joins a running stream replays it from the start), and queues
the decoded events, in order, up to ``limit`` (beyond it the oldest are dropped and counted). A
stream that starts again (the server restarted) queues ``AllBlocksCleared`` first.

A new stream is told by the live socket alone: its numbers only grow on one connection (a gap
is replayed, never resent live), so a number below the next one expected is a new stream,
whatever it is; and a connection made again may lead to a new server whose stream already
passed the old one's number, so the first batch after a reconnection starts the stream anew
(replayed from 0). Was: only a batch numbered 0 said so, which only a topic's first subscriber
gets: a relay that subscribed second after a restart dropped the new stream as duplicates.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
from collections.abc import Mapping
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from ..protocol import (
    END_SEQ,
    AllBlocksCleared,
    KVEvent,
    decode_batch,
    decode_seq,
    encode_seq,
)

__all__ = ["EventRelay"]

log = logging.getLogger("kvtrio.client")

_REPLAY_TIMEOUT_MS = 2000
"""How long a replay may go quiet before the batches it did not send count as lost."""
_POLL_MS = 100
"""How often the thread looks at its stop flag."""


class EventRelay:
    """A server's KV events of one topic, relayed in order (see the module docstring)."""

    def __init__(
        self,
        endpoint: str,
        replay: str,
        topic: bytes,
        *,
        options: Mapping[int, Any] | None = None,
        limit: int = 100_000,
    ) -> None:
        self.topic = topic
        self._events: collections.deque[KVEvent] = collections.deque()
        self._limit = limit
        self._lock = threading.Lock()
        self._next = 0
        self.dropped = 0
        """Events dropped because nobody took them in time (beyond ``limit``)."""
        self.lost = 0
        """Batches a gap lost for good (the server's replay buffer no longer held them)."""
        self._stop = threading.Event()
        context: zmq.Context[Any] = zmq.Context.instance()
        self._sub = context.socket(zmq.SUB)
        self._replay = context.socket(zmq.DEALER)
        for sock in (self._sub, self._replay):
            sock.setsockopt(zmq.LINGER, 0)
            for option, value in (options or {}).items():
                sock.setsockopt(option, value)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic)
        self._monitor = self._sub.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._rejoined = False
        """The live connection dropped since the last batch: the next one starts anew."""
        self._sub.connect(endpoint)
        self._replay.connect(replay)
        self._thread = threading.Thread(target=self._run, name="kvtrio-events", daemon=True)
        self._thread.start()

    def take(self) -> list[KVEvent]:
        """The events relayed since the last call, in order; never waits."""
        with self._lock:
            events = list(self._events)
            self._events.clear()
        return events

    def close(self) -> None:
        """Stop the thread, waiting for it a bounded time; the thread closes its sockets as it
        ends (a ZeroMQ socket is never touched by two threads, even when a replay it is
        waiting for holds it past the join)."""
        self._stop.set()
        self._thread.join(timeout=_POLL_MS / 1000 + 1.0)

    # ----------------------------------------------------------------- the thread

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sub, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                ready = dict(poller.poll(_POLL_MS))
                if ready.get(self._monitor):  # (first: a drop is known before what follows it)
                    while self._monitor.poll(0):
                        if recv_monitor_message(self._monitor)["event"] == zmq.EVENT_DISCONNECTED:
                            self._rejoined = True
                if not ready.get(self._sub):
                    continue
                frames = self._sub.recv_multipart()
                if len(frames) == 3:
                    self._message(decode_seq(frames[1]), frames[2])
        except zmq.ZMQError:  # the context was terminated under us
            pass
        except Exception:  # pragma: no cover - a bug: say so, stop relaying
            log.exception("the KV event relay stopped")
        finally:
            with contextlib.suppress(zmq.ZMQError):
                self._sub.disable_monitor()
            self._monitor.close(linger=0)
            self._sub.close(linger=0)
            self._replay.close(linger=0)

    def _message(self, seq: int, payload: bytes) -> None:
        if seq < self._next or (self._rejoined and self._next):  # a new stream (see the top)
            self._queue([AllBlocksCleared()])
            self._next = 0
        self._rejoined = False
        if seq > self._next:
            self._fill(seq)
        if seq >= self._next:
            self._apply(payload)
            self._next = seq + 1

    def _fill(self, seq: int) -> None:
        """Replay ``[next, seq)`` (in this thread; the engine's step never waits for it)."""
        self._replay.send_multipart([b"", encode_seq(self._next), self.topic])
        waited = 0
        while not self._stop.is_set() and waited < _REPLAY_TIMEOUT_MS:
            if not self._replay.poll(_POLL_MS):
                waited += _POLL_MS
                continue
            waited = 0
            frames = self._replay.recv_multipart()
            if len(frames) < 4 or frames[-2] == END_SEQ:
                break
            got = decode_seq(frames[-2])
            if self._next <= got < seq:
                self._apply(frames[-1])
                self._next = got + 1
        if self._stop.is_set():
            return  # closing: nothing was lost
        if self._next < seq:
            self.lost += seq - self._next
            log.warning("KV events: %d batches lost (beyond the replay buffer)", seq - self._next)
            self._next = seq

    def _apply(self, payload: bytes) -> None:
        try:
            self._queue(list(decode_batch(payload).events))
        except ValueError as exc:
            log.warning("KV events: a batch that does not decode (%s)", exc)

    def _queue(self, events: list[KVEvent]) -> None:
        with self._lock:
            self._events.extend(events)
            over = len(self._events) - self._limit
            for _ in range(max(0, over)):
                self._events.popleft()
                self.dropped += 1
