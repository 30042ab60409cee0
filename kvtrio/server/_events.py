"""The server's KV event publisher (``kvtrio serve --events ENDPOINT``): vLLM's wire format on
a ZeroMQ XPUB socket, one topic per tenant, and a replay ROUTER socket.

- **Never in the request path's way**: :meth:`EventPublisher.publish` appends to a bounded
  queue and returns; beyond 100,000 events it drops the event and counts it
  (``kvtrio_events_dropped``). One task sends what is queued every ``events_interval`` (5 ms),
  one ``KVEventBatch`` per tenant, and never waits on a subscriber: a subscriber slower than its
  high-water mark loses messages (libzmq drops them for that subscriber alone), sees the gap in
  the sequence numbers and asks the replay socket for what it missed.
- **Per tenant**: tenant ``T``'s batches go to topic ``kvtrio/T/`` with their own sequence
  numbers (from 0, one counter per topic, so a subscriber sees a gap only where it missed one of
  its own). The XPUB socket applies a subscription only after checking it (``XPUB_MANUAL``):
  the topic must be exactly one of a tenant the subscriber's CURVE key may use (the key's
  tenants, as for requests); any other subscription, a prefix such as ``""`` included, is
  ignored and counted. Over ``ipc://`` (this user only) every tenant's topic may be subscribed,
  and ``""`` too; over ``--insecure`` tcp only tenant ``""``'s.
- **Replay**: a request ``[b"", start_seq]`` (vLLM's) or ``[b"", start_seq, topic]`` is answered
  with the topic's buffered batches from ``start_seq`` on, then the end marker; the topic
  defaults to the key's only tenant. The last ``events_buffer`` batches of each topic are kept.
- CURVE and the ZAP domain are the request socket's (the same server keys and allowed keys).
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Any

import trio
import zmq

from ..protocol import (
    END_SEQ,
    AllBlocksCleared,
    KVEvent,
    encode_batch,
    encode_seq,
    events_topic,
    replay_endpoint,
)
from ..transport import Socket, open_socket
from ._auth import Principal, ServerAuth

__all__ = ["EventPublisher"]

log = logging.getLogger("kvtrio.events")

_HWM = 100_000


class EventPublisher:
    """The queue, the sequence numbers and replay buffers per topic, and the sockets' task."""

    def __init__(
        self,
        auth: ServerAuth,
        *,
        endpoint: str,
        buffer: int,
        interval: float,
        replay: str = "",
        queue: int = 100_000,
        ipc_group: str = "",
    ) -> None:
        self.auth = auth
        self.endpoint = endpoint
        self.replay = replay or replay_endpoint(endpoint)
        self._buffer_size = buffer
        self._queue_size = queue
        self.interval = interval
        self._ipc_group = ipc_group
        self._queue: list[tuple[str, KVEvent]] = []
        self._seq: dict[bytes, int] = {}
        self._buffers: dict[bytes, collections.deque[tuple[int, bytes]]] = {}
        self.counters: collections.Counter[str] = collections.Counter()
        """``published`` events, ``batches`` sent, ``dropped`` (queue full), ``replays``
        answered, ``subscriptions`` applied, ``refused_subscriptions``."""
        self._wake = trio.Event()
        self.bound: tuple[str, str] | None = None
        """The endpoints bound (tcp port 0 resolved), once serving."""

    # ----------------------------------------------------------------- request path

    def publish(self, tenant: str, event: KVEvent) -> None:
        """Queue ``event`` for ``tenant``'s subscribers; never waits (dropped and counted when
        the queue is full)."""
        if len(self._queue) >= self._queue_size:
            self.counters["dropped"] += 1
            return
        self._queue.append((tenant, event))
        if len(self._queue) == 1:
            self._wake.set()

    def stats(self) -> dict[str, int]:
        return {**self.counters, "queued": len(self._queue)}

    # ----------------------------------------------------------------- the task

    async def serve(
        self,
        context: zmq.Context[Any] | None = None,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Bind both sockets, then send batches, apply subscriptions and answer replays until
        cancelled (the sockets close; what was queued is not sent)."""
        options = {**self.auth.socket_options(), zmq.SNDHWM: _HWM, zmq.XPUB_MANUAL: 1}
        replay_options = {
            **self.auth.socket_options(),
            zmq.SNDHWM: 2 * (self._buffer_size + 1),
            zmq.RCVHWM: 1000,
        }
        async with (
            open_socket(zmq.XPUB, options=options, context=context) as pub,
            open_socket(zmq.ROUTER, options=replay_options, context=context) as router,
        ):
            bound = pub.bind(self.endpoint, ipc_group=self._ipc_group)
            replay = router.bind(self.replay, ipc_group=self._ipc_group)
            self.bound = (bound, replay)
            log.info("KV events on %s, replay on %s", bound, replay)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._subscriptions, pub)
                nursery.start_soon(self._replays, router)
                task_status.started()
                await self._send_loop(pub)

    async def _send_loop(self, pub: Socket) -> None:
        while True:
            await self._wake.wait()
            self._wake = trio.Event()
            await trio.sleep(self.interval)  # gather what the next few ms bring into one batch
            self.flush(pub)

    def flush(self, pub: Socket) -> None:
        """Send every queued event: one batch per tenant, in the order queued."""
        queued, self._queue = self._queue, []
        by_tenant: dict[str, list[KVEvent]] = {}
        for tenant, event in queued:
            by_tenant.setdefault(tenant, []).append(event)
        now = time.time()
        for tenant, events in by_tenant.items():
            self._send(pub, events_topic(tenant), encode_batch(now, events))
            self.counters["published"] += len(events)

    def _send(self, pub: Socket, topic: bytes, payload: bytes) -> None:
        seq = self._seq.get(topic, 0)
        self._seq[topic] = seq + 1
        buffer = self._buffers.get(topic)
        if buffer is None:
            buffer = self._buffers[topic] = collections.deque(maxlen=self._buffer_size)
        buffer.append((seq, payload))
        self.counters["batches"] += 1
        if not pub.try_send_multipart((topic, encode_seq(seq), payload)):
            self.counters["send_refused"] += 1  # (PUB drops, never refuses; be safe)

    # ----------------------------------------------------------------- subscriptions

    def _principal(self, user: str) -> Principal | None:
        return self.auth.principal(user)

    def _may_subscribe(self, principal: Principal | None, topic: bytes) -> bool:
        if principal is None:
            return False
        if self.auth.mode == "ipc":
            return True
        prefix, closing = b"kvtrio/", b"/"
        if not (topic.startswith(prefix) and topic.endswith(closing) and len(topic) > 8):
            return False
        tenant = topic[len(prefix) : -1]
        if b"/" in tenant:
            return False
        return principal.may_use(tenant.decode(errors="replace"))

    async def _subscriptions(self, pub: Socket) -> None:
        """Apply (or ignore) each subscription as it comes (``XPUB_MANUAL``); a new tenant
        topic's first subscriber gets ``AllBlocksCleared`` (seq 0) if nothing was sent on it yet:
        a subscriber that knew an earlier server's stream learns at once that it is gone."""
        while True:
            await pub.wait_readable()
            while (message := pub.try_recv_authenticated()) is not None:
                frames, user = message
                data = frames[0] if frames else b""
                if not data or data[0] not in (0, 1):
                    continue
                topic, subscribe = data[1:], data[0] == 1
                if not subscribe:
                    pub.set_option(zmq.UNSUBSCRIBE, topic)
                    continue
                if self._may_subscribe(self._principal(user), topic):
                    pub.set_option(zmq.SUBSCRIBE, topic)
                    self.counters["subscriptions"] += 1
                    if topic and topic not in self._seq:
                        # A new stream (this server's first batch on the topic): whatever a
                        # subscriber knew of the topic before is gone.
                        self._send(pub, topic, encode_batch(time.time(), [AllBlocksCleared()]))
                        self.counters["published"] += 1
                else:
                    self.counters["refused_subscriptions"] += 1
                    log.info("refused a KV events subscription to %r", topic[:80])

    async def _replays(self, router: Socket) -> None:
        while True:
            await router.wait_readable()
            while (message := router.try_recv_authenticated()) is not None:
                frames, user = message
                self._replay(router, frames, self._principal(user))

    def _replay(self, router: Socket, frames: list[bytes], principal: Principal | None) -> None:
        """Answer one replay request (a bad one gets the end marker alone)."""
        if len(frames) < 3 or len(frames[2]) != 8:
            return
        peer, start = frames[0], int.from_bytes(frames[2], "big")
        topic = frames[3] if len(frames) > 3 else self._only_topic(principal)
        answered = 0
        if topic is not None and self._may_subscribe(principal, topic):
            for seq, payload in self._buffers.get(topic, ()):
                if seq >= start:
                    router.try_send_multipart((peer, b"", topic, encode_seq(seq), payload))
                    answered += 1
        router.try_send_multipart((peer, b"", b"", END_SEQ, b""))
        self.counters["replays"] += 1
        self.counters["replayed_batches"] += answered

    def _only_topic(self, principal: Principal | None) -> bytes | None:
        """The topic of a replay request that names none: the principal's one tenant."""
        if principal is None:
            return None
        if self.auth.mode == "ipc" and len(self._buffers) == 1:
            return next(iter(self._buffers))
        tenants = [t for t in principal.tenants if t != "*"]
        return events_topic(tenants[0]) if len(tenants) == 1 else None
