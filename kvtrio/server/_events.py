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
  its own). Tenant names never hold ``/`` (``protocol._tenant``), so no topic prefixes another.
  The XPUB socket applies a subscription only after checking it (``XPUB_MANUAL``): the topic
  must be exactly one of a tenant the subscriber's CURVE key may use (the key's tenants, as for
  requests); any other subscription, a prefix such as ``""`` included, is ignored and counted.
  Over ``ipc://`` (this user only) every tenant's topic may be subscribed, and ``""`` too; over
  ``--insecure`` tcp only tenant ``""``'s, ``kvtrio//``. A new topic's first subscriber gets
  ``AllBlocksCleared`` (seq 0) if nothing was sent on it yet: a subscriber that knew an earlier
  server's stream learns at once that it is gone. The server announces nothing for a tenant
  nobody subscribed to in the last :data:`GRACE` seconds (:meth:`EventPublisher.subscribed`,
  ``_announce``).
- **Subscriptions reach the connection whose key was checked.** libzmq applies
  ``setsockopt(SUBSCRIBE)`` to the pipe of the last subscription read, from a queue that a
  message that is not a subscription (first byte not 0 or 1, or several frames) shifts: a peer
  sending such messages between subscriptions would have other connections' subscriptions
  applied to its own pipe. So after such a message no subscription is applied until the
  socket's queue is empty again, and then the XPUB socket is closed and bound anew: every
  connection is dropped, subscribers reconnect by themselves (ZeroMQ's reconnect, 100 ms by
  default) and send their subscriptions again; the offending CURVE key is refused by the events
  sockets for :data:`BAN_SECONDS`. At most one such reset per :data:`RESET_INTERVAL`.
- **Bounded like requests**: each socket takes at most :data:`BATCH` messages per wake-up, then
  lets other tasks run; a key may subscribe :data:`SUBSCRIBE_RATE` times a second (bursts of
  :data:`SUBSCRIBE_BURST`) and ask for :data:`REPLAY_RATE` replays a second (bursts of
  :data:`REPLAY_BURST`): beyond, a subscription is ignored and a replay answered with the end
  marker alone (both counted); a replay is sent :data:`BATCH` batches at a time; refusals are
  logged at most once per :data:`LOG_INTERVAL` per kind, with the count of those not logged.
- **Replay**: a request ``[b"", start_seq]`` (vLLM's) or ``[b"", start_seq, topic]`` is answered
  with the topic's buffered batches from ``start_seq`` on, then the end marker; the topic
  defaults to the key's only tenant. The last ``events_buffer`` batches of each topic are kept,
  at most :data:`~._replaybuffer.BUFFER_BYTES` of them (``_replaybuffer``).
- **Snapshot** (``_snapshot``): ``[b"", SNAPSHOT_SEQ, topic]`` is answered with the topic's
  current blocks, then the sequence number the live stream goes on from; authorized and rate
  limited as a replay.
- CURVE as on the request socket (the same server keys and allowed keys), with a ZAP domain of
  their own (``kvtrio-events``) so that a key can be refused here alone.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable
from typing import Any

import trio
import zmq

from ..errors import TransportError
from ..protocol import (
    END_SEQ,
    SNAPSHOT_SEQ,
    AllBlocksCleared,
    KVEvent,
    encode_batch,
    encode_seq,
    events_topic,
    replay_endpoint,
    tenant_problem,
)
from ..transport import Socket, open_socket
from ._announce import Announcer, Publish, Subscribed
from ._auth import EVENTS_ZAP_DOMAIN, Principal, ServerAuth
from ._event_limits import RateLog, Rates
from ._replaybuffer import ReplayBuffers
from ._snapshot import Snapshots, send_snapshot

__all__ = ["EventPublisher"]

log = logging.getLogger("kvtrio.events")

_HWM = 100_000
BATCH = 64
"""Messages an events socket takes per wake-up (as the request router); a replay sends as many
batches per turn (``_replaybuffer``)."""
SUBSCRIBE_RATE, SUBSCRIBE_BURST = 200.0, 1000.0
REPLAY_RATE, REPLAY_BURST = 20.0, 50.0
BAN_SECONDS = 60.0
"""How long the events sockets refuse a key that sent them a message that is not a
subscription."""
GRACE = 60.0
"""Seconds a tenant's events are still announced (and names kept) after its last subscriber
left: a subscriber that reconnects, or comes late, replays what it missed."""
RESET_INTERVAL = 1.0
"""The least time between two resets of the XPUB socket."""
RESYNC_WAIT = 0.5
"""The longest time subscriptions wait, after a message that is not one, for the socket's queue
to empty before the reset drops every connection anyway (a peer flooding it)."""
_PREFIX = b"kvtrio/"
_MAX_FRAME = 1024
"""The largest frame either events socket reads (libzmq drops a connection that sends a larger
one): a subscription is a byte and a topic of at most ``kvtrio/`` + a tenant name + ``/``, a
replay request's frames are smaller still (was: unbounded, a topic of any size kept)."""


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
        announce: Callable[[Publish, Subscribed], Announcer] | None = None,
    ) -> None:
        """``announce`` makes the announcer that publishes here (given :meth:`publish` and
        :meth:`subscribed`); its snapshots answer snapshot requests."""
        self.auth = auth
        self.endpoint = endpoint
        self.replay = replay or replay_endpoint(endpoint)
        self._buffer_size = buffer
        self._queue_size = queue
        self.interval = interval
        self._ipc_group = ipc_group
        self._queue: list[tuple[str, KVEvent]] = []
        self._topics = ReplayBuffers(buffer)
        """Each topic's sequence numbers and replay buffer."""
        self.counters: collections.Counter[str] = collections.Counter()
        """``published`` events, ``batches`` sent, ``dropped`` (queue full), ``replays``
        answered (``replays_refused`` beyond the rate), ``subscriptions`` applied,
        ``refused_subscriptions`` (``subscriptions_over_rate`` of them beyond the rate),
        ``not_subscriptions`` received, ``skipped_subscriptions`` (after one), ``resets``."""
        self._wake = trio.Event()
        self.bound: tuple[str, str] | None = None
        """The endpoints bound (tcp port 0 resolved), once serving."""
        self._subscribers: collections.Counter[bytes] = collections.Counter()
        """Subscriptions applied per topic, less unsubscriptions (an estimate never below the
        truth: a connection's end unsubscribes it from every topic it asked for)."""
        self._refused: collections.Counter[bytes] = collections.Counter()
        """Subscriptions refused per topic: their connections' ends unsubscribe them too (libzmq
        sends an unsubscription, with no user, for each topic a leaving pipe asked for)."""
        self._held: collections.Counter[tuple[str, bytes]] = collections.Counter()
        """Subscriptions applied per (CURVE key, topic), less that key's own unsubscriptions: a
        key's unsubscription counts only against what it was given (was: any key's ended
        another tenant's count, and its events stopped)."""
        self._dropped: set[bytes] = set()
        """Running topics whose events the full queue dropped since the last flush."""
        self._left: dict[bytes, float] = {}
        """When each topic's last subscriber left (``time.monotonic()``)."""
        self._wanted: dict[str, tuple[bool, float]] = {}
        """``subscribed``'s answers per tenant, and until when they hold."""
        self._subscribe_rates = Rates(SUBSCRIBE_RATE, SUBSCRIBE_BURST)
        self._replay_rates = Rates(REPLAY_RATE, REPLAY_BURST)
        self._log_refused = RateLog()
        self._log_replay = RateLog()
        self._log_reset = RateLog()
        self._last_reset = -RESET_INTERVAL
        self.announcer = None if announce is None else announce(self.publish, self.subscribed)
        """What turns the cache's changes into events published here."""
        self.snapshots: Snapshots | None = (
            None if self.announcer is None else self.announcer.snapshot
        )
        """A tenant's current blocks (the announcer's), for snapshot requests."""

    # ----------------------------------------------------------------- request path

    def publish(self, tenant: str, event: KVEvent) -> None:
        """Queue ``event`` for ``tenant``'s subscribers; never waits (dropped and counted when
        the queue is full)."""
        if len(self._queue) >= self._queue_size:
            self.counters["dropped"] += 1
            self._dropped.add(events_topic(tenant))
            return
        self._queue.append((tenant, event))
        if len(self._queue) == 1:
            self._wake.set()

    def subscribed(self, tenant: str) -> bool:
        """Whether anyone may want ``tenant``'s events: a subscription to its topic (or, over
        ipc, a prefix of it) applied, or one that ended less than :data:`GRACE` seconds ago
        (never a false "no")."""
        now = time.monotonic()
        cached = self._wanted.get(tenant)
        if cached is not None and now < cached[1]:
            return cached[0]
        topic = events_topic(tenant)
        wanted, until = False, now + GRACE
        for t, n in self._subscribers.items():
            if topic.startswith(t) and n > 0:
                wanted = True
        for t, left in self._left.items():
            if topic.startswith(t) and left + GRACE > now:
                wanted, until = True, min(until, left + GRACE)
        self._wanted[tenant] = (wanted, until)
        return wanted

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
        cancelled (the sockets close; what was queued is not sent). The XPUB socket is
        replaced (closed, bound anew) after a message that is not a subscription."""
        options = {
            **self.auth.socket_options(EVENTS_ZAP_DOMAIN),
            zmq.SNDHWM: _HWM,
            zmq.XPUB_MANUAL: 1,
            zmq.MAXMSGSIZE: _MAX_FRAME,
        }
        replay_options = {
            **self.auth.socket_options(EVENTS_ZAP_DOMAIN),
            zmq.SNDHWM: 2 * (self._buffer_size + 1),
            zmq.RCVHWM: 1000,
            zmq.MAXMSGSIZE: _MAX_FRAME,
        }
        async with (
            open_socket(zmq.ROUTER, options=replay_options, context=context) as router,
            trio.open_nursery() as nursery,
        ):
            endpoint = ""
            while True:
                async with open_socket(zmq.XPUB, options=options, context=context) as pub:
                    if not endpoint:
                        endpoint = pub.bind(self.endpoint, ipc_group=self._ipc_group)
                        replay = router.bind(self.replay, ipc_group=self._ipc_group)
                        self.bound = (endpoint, replay)
                        log.info("KV events on %s, replay on %s", endpoint, replay)
                        nursery.start_soon(self._replays, router)
                        task_status.started()
                    else:
                        await self._rebind(pub, endpoint)
                    async with trio.open_nursery() as inner:
                        inner.start_soon(self._send_loop, pub)
                        await self._subscriptions(pub)  # returns when a reset is due
                        await trio.sleep_until(self._last_reset + RESET_INTERVAL)
                        inner.cancel_scope.cancel()
                self._last_reset = trio.current_time()
                self._forget_subscriptions()
                self.counters["resets"] += 1

    def _forget_subscriptions(self) -> None:
        """The XPUB socket was replaced: every connection dropped, with no unsubscription; the
        subscribers subscribe again. Their topics count as left now (:data:`GRACE` holds)."""
        now = time.monotonic()
        for topic in self._subscribers:
            self._left[topic] = now
        self._subscribers.clear()
        self._refused.clear()
        self._held.clear()
        self._wanted.clear()

    async def _rebind(self, pub: Socket, endpoint: str) -> None:
        """Bind the new XPUB socket where the old one was (retried while libzmq's I/O thread
        still holds the old listener)."""
        delay = 0.005
        while True:
            try:
                pub.bind(endpoint, ipc_group=self._ipc_group)
                return
            except TransportError as exc:
                self._log_reset("KV events: binding %s again: %s; retrying", endpoint, exc)
                await trio.sleep(delay)
                delay = min(2 * delay, 1.0)

    async def _send_loop(self, pub: Socket) -> None:
        if self._queue:  # queued while the socket was replaced
            self._wake.set()
        while True:
            await self._wake.wait()
            self._wake = trio.Event()
            await trio.sleep(self.interval)  # gather what the next few ms bring into one batch
            self.flush(pub)

    def flush(self, pub: Socket) -> None:
        """Send every queued event: one batch per tenant, in the order queued. A running topic
        whose events were dropped (the queue was full) skips a sequence number first: its
        subscribers see a gap no replay fills, and resynchronise (was: a stream without a
        gap, so a subscriber kept blocks the server had dropped, and never knew)."""
        for topic in self._dropped:
            if topic in self._topics:
                self._topics.skip(topic)
        self._dropped.clear()
        queued, self._queue = self._queue, []
        by_tenant: dict[str, list[KVEvent]] = {}
        for tenant, event in queued:
            by_tenant.setdefault(tenant, []).append(event)
        now = time.time()
        for tenant, events in by_tenant.items():
            self._send(pub, events_topic(tenant), encode_batch(now, events))
            self.counters["published"] += len(events)

    def _send(self, pub: Socket, topic: bytes, payload: bytes) -> None:
        seq = self._topics.add(topic, payload)
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
        tenant = self._tenant_of(topic)
        return tenant is not None and principal.may_use(tenant)

    def _tenant_of(self, topic: bytes) -> str | None:
        """The tenant whose topic ``topic`` is (None: no tenant's; over ipc any topic is one
        a subscriber may be given, ``""`` here)."""
        if self.auth.mode == "ipc":
            return ""
        if not (topic.startswith(_PREFIX) and topic.endswith(b"/") and len(topic) > 7):
            return None
        try:
            tenant = topic[len(_PREFIX) : -1].decode("ascii")
        except UnicodeDecodeError:
            return None
        return tenant if tenant_problem(tenant) is None else None

    def _refuse(self, topic: bytes) -> None:
        """Count a refused subscription of ``topic`` against its connection's unsubscription
        to come, if some subscriber may be given ``topic`` (one no key may have can never be
        counted as applied: it is not kept, whatever a client sends)."""
        self.counters["refused_subscriptions"] += 1
        if self._tenant_of(topic) is not None:
            self._refused[topic] += 1

    async def _subscriptions(self, pub: Socket) -> None:
        """Apply (or ignore) each subscription as it comes (``XPUB_MANUAL``), :data:`BATCH` at
        a time; return when the socket must be replaced (a message that was not a
        subscription shifted libzmq's queue of pipes: see the module doc)."""
        shifted_at: float | None = None  # when the first such message of this queue came
        taken = 0
        while True:
            message = pub.try_recv_authenticated()
            if message is None:  # the queue is empty: libzmq's queue of pipes too
                if shifted_at is not None:
                    return
                taken = 0
                await pub.wait_readable()
                continue
            taken += 1
            if taken >= BATCH:
                taken = 0
                await trio.lowlevel.checkpoint()
            frames, user = message
            data = frames[0]
            if len(frames) != 1 or not data or data[0] > 1:
                self.counters["not_subscriptions"] += 1
                if shifted_at is None:
                    shifted_at = trio.current_time()
                    self._log_reset(
                        "KV events: a connection sent a message that is not a subscription; "
                        "dropping every connection (subscribers reconnect)%s",
                        f", refusing its key for {BAN_SECONDS:.0f} s" if user else "",
                    )
                self.auth.ban_from_events(user, BAN_SECONDS)
                continue
            if shifted_at is not None:
                # Which connection libzmq would apply it to is unknown: apply nothing.
                self.counters["skipped_subscriptions"] += 1
                if trio.current_time() - shifted_at > RESYNC_WAIT:
                    return
                continue
            self._subscription(pub, data[1:], data[0] == 1, user)

    def _subscription(self, pub: Socket, topic: bytes, subscribe: bool, user: str) -> None:
        """Apply or refuse one subscription (or unsubscription) of connection ``user``, the
        last libzmq received."""
        if not subscribe:
            pub.set_option(zmq.UNSUBSCRIBE, topic)
            if user:  # (sent by a CURVE peer: a leaving pipe's own come with no user)
                if not self._held[(user, topic)]:
                    return  # nothing of this key's to end
                _take(self._held, (user, topic))
            if self._refused[topic] > 0:
                _take(self._refused, topic)
            elif self._subscribers[topic] > 0:
                _take(self._subscribers, topic)
                if not self._subscribers[topic]:
                    self._left[topic] = time.monotonic()
                    self._wanted.clear()
            return
        if not self._subscribe_rates.take(user):
            self._refuse(topic)
            self.counters["subscriptions_over_rate"] += 1
            self._log_refused("ignored KV events subscriptions beyond %.0f/s", SUBSCRIBE_RATE)
            return
        if not self._may_subscribe(self._principal(user), topic):
            self._refuse(topic)
            self._log_refused("refused a KV events subscription to %r", topic[:80])
            return
        pub.set_option(zmq.SUBSCRIBE, topic)
        self.counters["subscriptions"] += 1
        self._subscribers[topic] += 1
        if user:
            self._held[(user, topic)] += 1
        if self._subscribers[topic] == 1:
            self._left.pop(topic, None)
            self._wanted.clear()
            if self.announcer is not None:  # (the L2's chunks, announced under their names)
                whole = topic.startswith(_PREFIX) and topic.endswith(b"/") and len(topic) > 7
                tenant = topic[len(_PREFIX) : -1].decode("ascii", "replace")
                self.announcer.subscriber(tenant if whole else None)
        if topic and topic not in self._topics:
            # A new stream (this server's first batch on the topic): whatever a subscriber
            # knew of the topic before is gone.
            self._send(pub, topic, encode_batch(time.time(), [AllBlocksCleared()]))
            self.counters["published"] += 1

    # ----------------------------------------------------------------- replays

    async def _replays(self, router: Socket) -> None:
        taken = 0
        while True:
            message = router.try_recv_authenticated()
            if message is None:
                taken = 0
                await router.wait_readable()
                continue
            taken += 1
            if taken >= BATCH:
                taken = 0
                await trio.lowlevel.checkpoint()
            frames, user = message
            await self._replay(router, frames, user)

    async def _replay(self, router: Socket, frames: list[bytes], user: str) -> None:
        """Answer one replay request (a bad one, or one beyond the key's rate, gets the end
        marker alone), :data:`BATCH` batches per turn. Cancellation: between turns."""
        if len(frames) < 3 or len(frames[2]) != 8:
            return
        peer, start = frames[0], int.from_bytes(frames[2], "big")
        principal = self._principal(user)
        answered = 0
        if not self._replay_rates.take(user):
            self.counters["replays_refused"] += 1
            self._log_replay("answered KV events replays beyond %.0f/s with none", REPLAY_RATE)
        else:
            topic = frames[3] if len(frames) > 3 else self._only_topic(principal)
            if topic is not None and self._may_subscribe(principal, topic):
                if frames[2] == SNAPSHOT_SEQ:
                    await self._snapshot(router, peer, topic)
                    return
                answered = await self._topics.replay(router, peer, topic, start)
        router.try_send_multipart((peer, b"", b"", END_SEQ, b""))
        self.counters["replays"] += 1
        self.counters["replayed_batches"] += answered

    async def _snapshot(self, router: Socket, peer: bytes, topic: bytes) -> None:
        tenant = topic[len(_PREFIX) : -1].decode("ascii", "replace")
        proper = topic.startswith(_PREFIX) and topic.endswith(b"/") and len(topic) > 7
        snapshots = self.snapshots if proper else None  # (over ipc any topic may be asked)
        events = iter(()) if snapshots is None else snapshots(tenant)
        batches = await send_snapshot(router, peer, topic, events, self._topics.next_seq(topic))
        self.counters["snapshots"] += 1
        self.counters["snapshot_batches"] += batches

    def _only_topic(self, principal: Principal | None) -> bytes | None:
        """The topic of a replay request that names none: the principal's one tenant."""
        if principal is None:
            return None
        if self.auth.mode == "ipc" and self._topics.only_topic() is not None:
            return self._topics.only_topic()
        tenants = [t for t in principal.tenants if t != "*"]
        return events_topic(tenants[0]) if len(tenants) == 1 else None


def _take(counter: collections.Counter[Any], key: Any) -> None:
    """One less of ``key``, forgotten at 0 (a ``Counter`` keeps zeros: topics a client chose,
    kept for ever)."""
    if counter[key] > 1:
        counter[key] -= 1
    else:
        del counter[key]
