"""What the synchronous client's threads share: one :class:`ClientState` per client.

:class:`~kvtrio.client._sync.Client` (the callers' side), :class:`~kvtrio.client._connection.
Connection` (the socket, under the socket lock) and :class:`~kvtrio.client._background.
Background` (the background thread) each get the same :class:`ClientState` and import this
module, not each other. It holds the client's settings, what the connection tells callers
(``status``, ``server_info``, ``in_flight``), the queue of requests not yet taken by the
socket's holder, the socket lock, who waits for replies (leader, followers) and the two wake
pipes; its methods are the operations all three need: settle futures and wake their waiters,
wake the background thread or ask it to watch the socket, log what the connection did.

Nothing here takes the GIL-heavy road: a wake is one ``write`` to a pipe, and the pipe to the
background thread is written only when it must act (see :meth:`ClientState.want_background`).
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future

import attrs

from ..protocol import HelloReply, Reply, Request
from ._common import HandshakeWatch

__all__ = ["Call", "ClientState", "Outcome", "ReplyFuture", "ServerChange", "settle"]

log = logging.getLogger("kvtrio.client")

ServerChange = Callable[[HelloReply], None]
Outcome = tuple["Call", "Reply | BaseException"]
Waiter = Callable[["ReplyFuture", "float | None"], None]


@attrs.define(eq=False)
class ClientState:
    """The state one synchronous client's threads share (see the module docstring).

    Plain attributes, no validators (an assignment is a slot store, as on the hot path it must
    be). Each says who writes it; everyone may read it.
    """

    endpoint: str
    timeout: float
    """Seconds a request waits for its reply unless told otherwise (also the client's own)."""
    client_name: str
    heartbeat: bool
    on_server_change: ServerChange | None
    handshake: HandshakeWatch
    """Fed by the connection's monitor events."""
    wait: Waiter
    """How a caller waits for its future: ``Client._wait`` (receives in the calling thread);
    what :meth:`ReplyFuture.result` calls."""

    server_info: HelloReply | None = None
    """The server's last ``hello`` answer (written by whoever receives it, under the lock)."""
    handshake_error: str | None = None
    """Why the last handshake failed, if it did (the connection, under the socket lock)."""
    status: str = "connecting"
    """``connecting`` (never connected yet), ``connected`` or ``disconnected`` (the
    connection, under the socket lock)."""
    in_flight: int = 0
    """Requests sent and not answered yet (the connection, under the socket lock)."""
    ids: itertools.count[int] = attrs.field(factory=lambda: itertools.count(1))
    """Request ids, for the callers' requests and the client's own."""
    outbox: collections.deque[tuple[int, Call]] = attrs.field(factory=collections.deque)
    """Requests submitted and not yet taken by the socket's holder (appended by callers,
    taken under the socket lock)."""
    closing: bool = False
    """Set once, by ``close()`` or by the background thread as it ends."""
    socket_lock: threading.Lock = attrs.field(factory=threading.Lock)
    """Guards the DEALER socket and the connection's state (see ``_connection``)."""
    leader: int | None = None
    """The thread id of the one caller sleeping on the socket, if any (``Client._wait``)."""
    followers: int = 0
    """Callers waiting while another one leads (under :attr:`handoff`)."""
    handoff: threading.Condition = attrs.field(
        factory=lambda: threading.Condition(threading.Lock())
    )
    """Followers wait on it; settlers and a leaving leader notify it."""
    background_wakes_at: float = 0.0
    """When the background thread wakes next (monotonic; the background thread)."""
    background_watches: bool = False
    """The background thread sleeps on the socket (the background thread)."""
    background_wanted: bool = False
    """A pending future has done callbacks: the background thread must watch the socket when
    no caller does (set by :meth:`want_background`, cleared by the background thread)."""
    wake_r: int = attrs.field(init=False)
    wake_w: int = attrs.field(init=False)
    lead_r: int = attrs.field(init=False)
    lead_w: int = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self.wake_r, self.wake_w = os.pipe()
        self.lead_r, self.lead_w = os.pipe()
        for fd in (self.wake_r, self.wake_w, self.lead_r, self.lead_w):
            os.set_blocking(fd, False)

    def close_pipes(self) -> None:
        """Close both wake pipes (once no thread uses them any more)."""
        for fd in (self.wake_r, self.wake_w, self.lead_r, self.lead_w):
            os.close(fd)

    # ------------------------------------------------------------------ waking threads

    def wake(self) -> None:
        """Wake the background thread (one byte into its pipe; never blocks: a full pipe means
        wake-ups are pending anyway)."""
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self.wake_w, b"\0")

    def take_wakeups(self) -> None:
        """Empty the background thread's pipe (the background thread, after it woke)."""
        with contextlib.suppress(BlockingIOError):
            os.read(self.wake_r, 65536)

    def take_lead_wakeups(self) -> None:
        """Empty the leader's pipe (the leader, after it woke)."""
        with contextlib.suppress(BlockingIOError, OSError):
            os.read(self.lead_r, 4096)

    def want_background(self) -> None:
        """A pending future has a done callback (or is the client's own): the background
        thread must receive its reply if no caller does. Wakes it only if it is not watching
        the socket already, so a future without callbacks never costs a wake-up (the background
        thread would then take the GIL from a spinning caller)."""
        self.background_wanted = True
        if not self.background_watches:
            self.wake()

    def settle(self, outcomes: Sequence[Outcome]) -> None:
        """Settle ``outcomes`` (:func:`settle`; outside the socket lock: done callbacks run
        here and may submit), then wake the callers waiting for them.

        A KeyboardInterrupt (main thread only) while settling, or between taking the outcomes
        from the connection and settling them, leaves the rest unsettled for good: they are no
        longer the connection's calls, and nothing expires them.
        """
        settle(outcomes)
        self.wake_waiters()

    def wake_waiters(self) -> None:
        """Futures were settled (or cancelled): the callers waiting for them look again (the
        followers through :attr:`handoff`, the leader through its pipe, unless it is this
        thread)."""
        if self.followers:
            with self.handoff:
                self.handoff.notify_all()
        leader = self.leader
        if leader is not None and leader != threading.get_ident():
            with contextlib.suppress(BlockingIOError, OSError):  # full: it wakes anyway
                os.write(self.lead_w, b"\0")

    # ------------------------------------------------------------------ what callers are told

    def log_warning(self, failure: str) -> None:
        """Log why a handshake failed (as the monitor tells it)."""
        log.warning("%s: %s", self.endpoint, failure)

    def log_lost(self) -> None:
        """Log that a connection that was up dropped."""
        log.info("lost connection to %s", self.endpoint)

    def unreachable(self, *, with_handshake: bool = True) -> str:
        """The message of a ``ServerUnavailable``: why the server cannot be reached."""
        handshake_error = self.handshake_error if with_handshake else None
        if handshake_error is not None:
            return f"cannot reach {self.endpoint}: {handshake_error}"
        return f"cannot reach {self.endpoint} (no connection; is the server running?)"


class ReplyFuture(Future[Reply]):
    """A future whose ``result()``/``exception()`` drive the client's I/O in the calling thread
    (so a waiting caller receives its own reply, no thread hand-off). ``state`` is ``None``
    for the client's own requests (hello, ping): nobody waits for those."""

    def __init__(self, state: ClientState | None, deadline: float) -> None:
        super().__init__()
        self._shared = state  # (not ``_state``: the base class's)
        self.deadline = deadline
        self.finished = False
        """True once settled or cancelled: what the client's loops read, without taking the
        future's lock (``done()`` takes it)."""

    def result(self, timeout: float | None = None) -> Reply:
        """The reply, receiving in this thread until it comes (``ClientState.wait``); raises
        the request's error. Every future settles by its deadline (``RequestTimeout`` or
        ``ServerUnavailable``); ``timeout`` only bounds this wait (then ``TimeoutError``,
        and the request stays pending). Interrupted (KeyboardInterrupt), the request stays
        pending and whoever receives next settles it."""
        if self._shared is not None and not self.finished:
            self._shared.wait(self, timeout)
            if not self.finished:  # ``timeout`` has passed: the base class must not wait anew
                timeout = 0
        return super().result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """As :meth:`result`, returning the error instead of raising it."""
        if self._shared is not None and not self.finished:
            self._shared.wait(self, timeout)
            if not self.finished:
                timeout = 0
        return super().exception(timeout)

    # ``finished`` is set first: done callbacks run inside ``set_result`` and may call
    # ``result()``, which must not wait then (the base class's ``result()`` waits for the
    # state under the future's lock, so setting it early is safe).
    def set_result(self, result: Reply) -> None:
        self.finished = True
        super().set_result(result)

    def set_exception(self, exception: BaseException | None) -> None:
        self.finished = True
        super().set_exception(exception)

    def cancel(self) -> bool:
        """As usual (possible until the reply is settled); a caller waiting for it is woken. A
        request still in the outbox is never sent; one taken from it is, and its reply is
        dropped."""
        cancelled = super().cancel()
        if cancelled:
            self.finished = True
            if self._shared is not None:
                self._shared.wake_waiters()  # a caller may be waiting for it
        return cancelled

    def add_done_callback(self, fn: Callable[[Future[Reply]], object]) -> None:
        """As usual; a pending future with a callback has the background thread receive its
        reply if no caller does (the callback then runs in the background thread)."""
        super().add_done_callback(fn)
        if self._shared is not None and not self.finished:
            self._shared.want_background()


class Call:
    """One request on its way: its encoded frames until sent, its future, its deadline."""

    __slots__ = ("deadline", "fail_fast", "frames", "future", "on_reply", "request_type", "sent")

    def __init__(
        self, request: Request, frames: list[bytes], future: ReplyFuture, fail_fast: bool
    ) -> None:
        self.request_type = type(request)
        self.frames = frames
        self.deadline = future.deadline
        self.fail_fast = fail_fast
        self.future = future
        self.sent = False
        self.on_reply: Callable[[Reply], None] | None = None
        """For the client's own requests: run under the lock as the reply is received (so a
        hello's answer is known before any reply that came after it is settled)."""


def settle(outcomes: Sequence[Outcome]) -> None:
    """Settle futures (outside the socket lock: done callbacks may submit); cancelled ones are
    skipped."""
    for call, outcome in outcomes:
        future = call.future
        if not future.set_running_or_notify_cancel():
            continue
        if isinstance(outcome, BaseException):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)
