"""A worker adapter's registration: made, remade for a new server, retried, attached in order.

The worker registers its KV cache with the server it is connected to and keeps that true by
itself: when it meets a new server instance it registers again, a refused or failed
registration is retried with backoff (logged once per reason, counted in the adapter's
:class:`~._failures.Failures`), and the server saying "not registered" makes it register
again. Every registration has a *generation*; only the newest one's reply is attached. A reply
is attached in the adapter's transfer thread (its copy path maps the arena it names there),
ordered with the copies: a transfer queued after the reply never uses an older registration.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future

import attrs

from ..protocol import HelloReply, Register, Registered, Reply
from ._failures import Failures
from ._sync import Client

__all__ = ["Current", "Registrar"]

log = logging.getLogger("kvtrio.client")

_RETRY_FIRST = 0.5
_RETRY_MAX = 30.0
"""Backoff of registration retries: first delay, doubling up to this."""


@attrs.define
class Current:
    """An attached registration."""

    registered: Registered
    generation: int
    instance_id: str | None
    """The server instance the registration was made with."""


class Registrar:
    """One worker adapter's registration (see the module docstring). Thread-safe.

    ``request`` builds the ``register`` message; ``attach`` readies the copy path for a reply
    (in the transfer thread; ``OSError`` if it cannot); ``transfers`` is the adapter's
    transfer thread.
    """

    def __init__(
        self,
        client: Client,
        request: Callable[[], Register],
        attach: Callable[[Registered], None],
        transfers: Executor,
        failures: Failures,
        rank: int,
        timeout: float,
    ) -> None:
        self.client = client
        self._request = request
        self._attach_path = attach
        self._transfers = transfers
        self._failures = failures
        self._rank = rank
        self._timeout = timeout
        self._current: Current | None = None
        self._generation = 0
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._registering = False  # a registration is under way (sent, or reply not attached)
        self._target: str | None = None  # server instance the last Register went to
        self._queued: tuple[Registered, int, str | None] | None = None  # reply to attach
        self._retry_delay = _RETRY_FIRST
        self._retry: threading.Timer | None = None
        self._closed = False

    def register(self) -> Future[Reply]:
        """Send a new registration (any thread); the old one stops being used at once."""
        info = self.client.server_info
        with self._lock:
            self._generation += 1
            generation = self._generation
            self._registering = True
            # None: sent before any hello, so it reaches the first server the client meets.
            self._target = info.instance_id if info is not None else None
        future = self.client.submit(self._request(), timeout=self._timeout)
        future.add_done_callback(lambda f: self._answered(f, generation))
        return future

    def lost(self) -> None:
        """The server says it has no registration of this connection: register again."""
        log.info("kvtrio: server lost this worker's registration; registering again")
        self.register()

    def _answered(self, future: Future[Reply], generation: int) -> None:
        # In the client's I/O thread: mapping the arena takes a while, do it in the transfer
        # thread (which also orders it before any transfer submitted after it).
        if future.cancelled() or future.exception() is not None:
            self._failed(generation, str(future.exception() or "cancelled"))
            return
        reply = future.result()
        assert isinstance(reply, Registered)
        info = self.client.server_info
        instance = info.instance_id if info is not None else None
        with self._lock:
            if generation != self._generation:
                return
            self._queued = (reply, generation, instance)
            self._changed.notify_all()
        with contextlib.suppress(RuntimeError):  # the adapter shut down meanwhile
            self._transfers.submit(self._attach_queued)

    def _failed(self, generation: int, reason: str) -> None:
        """Count, say once per reason why this rank is not caching, retry with backoff."""
        with self._lock:
            if generation != self._generation or self._closed:
                return
            self._registering = False
            self._failures.registration()
            delay, self._retry_delay = self._retry_delay, min(_RETRY_MAX, self._retry_delay * 2)
            self._changed.notify_all()
            self._retry = threading.Timer(delay, self._retry_registration)
            self._retry.daemon = True
            self._retry.start()
        self._failures.warn_once(
            f"registration:{reason}",
            logging.ERROR,
            "kvtrio: rank %d is not caching: registration at %s failed (%s); retrying with backoff",
            self._rank,
            self.client.endpoint,
            reason,
        )

    def _retry_registration(self) -> None:
        with self._lock:
            if self._closed or self._registering or self.current() is not None:
                return
        self.register()

    def _attach_queued(self) -> None:
        """Attach a registration reply that arrived (transfer thread: ordered with copies)."""
        with self._lock:
            queued, self._queued = self._queued, None
        if queued is not None:
            self._attach(*queued)

    def _attach(self, reply: Registered, generation: int, instance: str | None) -> None:
        with self._lock:
            if generation != self._generation:
                return
        try:
            self._attach_path(reply)
        except OSError as exc:
            self._failed(generation, f"cannot map the L1 arena: {exc}")
            return
        except Exception as exc:  # anything else: still a failed attach, retried with backoff
            log.exception("kvtrio: attaching the registration failed")
            self._failed(generation, f"cannot attach the registration: {exc}")
            return
        with self._lock:
            if generation != self._generation:
                return  # a newer registration is under way
            self._current = Current(reply, generation, instance)
            # Attached: wake waiters, reset the backoff.
            self._registering = False
            self._retry_delay = _RETRY_FIRST
            self._failures.forget("registration:")
            self._changed.notify_all()
        log.info("kvtrio: rank %d registered at %s", self._rank, self.client.endpoint)

    def wait(self, deadline: float, *, attach: bool = True) -> Current | None:
        """The current registration, waiting until ``deadline`` while one is under way.

        With ``attach`` (in the transfer thread) a reply that arrived is attached here, so a
        copy queued before the reply never waits for itself."""
        while True:
            if attach:
                self._attach_queued()
            current = self.current()
            if current is not None:
                return current
            with self._lock:
                remaining = deadline - time.monotonic()
                if not self._registering or remaining <= 0:
                    return None
                if self._queued is None or not attach:
                    self._changed.wait(remaining)

    def server_changed(self, info: HelloReply) -> None:
        """The client met a server (its I/O thread): register with it, unless the registration
        already made is for it. Only queues; never waits."""
        # Registering bumps the generation, so the old arena (meaningless to the new server)
        # stops being used at once. The registration already made for this very server
        # (register_kv_caches before the first hello) is not repeated: that made the server
        # see register → unregister → register within milliseconds.
        with self._lock:
            if (self._registering or self.current() is not None) and (
                self._target in (None, info.instance_id)
            ):
                self._target = info.instance_id
                return
        self.register()

    def current(self) -> Current | None:
        """The current registration, if it is attached."""
        current = self._current
        return current if current is not None and current.generation == self._generation else None

    @property
    def registered(self) -> bool:
        """Registered with the server the client is connected to right now."""
        current = self.current()
        info = self.client.server_info
        return (
            current is not None
            and self.client.connected
            and info is not None
            and info.instance_id == current.instance_id
        )

    def close(self) -> None:
        """No more retries (at shutdown)."""
        with self._lock:
            self._closed = True
            if self._retry is not None:
                self._retry.cancel()
