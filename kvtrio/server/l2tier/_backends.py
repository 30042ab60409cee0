"""The tier's backends and the one boundary for calls into them: health, backoff, counters.

Every exception a backend raises (``BackendError``, any ``OSError``, a plugin's ``TypeError``…)
is a backend failure: counted, logged (once per outage), and the backend is skipped for a
growing backoff (0.5 s … 30 s), then tried again; no backend error reaches a client.
Cancellation is not an ``Exception`` and passes.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol, cast

import attrs
import trio

from ..._logging import event
from ...l2 import (
    Backend,
    BackendError,
    BackendMisconfigured,
    Buffers,
    Capabilities,
    Naming,
    Touching,
    capabilities,
)

__all__ = [
    "Call", "Calls", "NamesRecord", "Observe", "TierBackend", "TierListener", "describe"
]  # fmt: skip

log = logging.getLogger("kvtrio.l2")

_BACKOFF_MIN, _BACKOFF_MAX = 0.5, 30.0
_DOWN_AFTER = 3
"""Distinct objects whose reads fail with no read succeeding in between: then it is not the
objects, it is the backend (backed off as for any failure)."""
_DROP_AFTER = 2
"""Failed reads of one object, none succeeding in between, after which it is deleted (unless
they backed the backend off)."""
_REMEMBERED = 4096
"""Objects whose failed reads are remembered at most (the oldest are forgotten)."""
_ROLES = {"read": "lookups", "store": "stores"}

Observe = Callable[[str, str, float, bool], None]
"""``(backend label, operation, seconds, succeeded)`` per call into a backend (the metrics)."""


class TierListener(Protocol):
    """Told what the tier learns of the chunks each backend holds (the server's KV events):
    a store answered true, a lookup found a prefix and missed the next, a delete."""

    def stored(self, key: bytes, medium: str, parent: bytes | None = None) -> None: ...

    def removed(self, key: bytes, medium: str = ...) -> None: ...

    def seen(self, keys: Sequence[bytes], found: int, medium: str) -> None: ...

    def names_of(self, key: bytes) -> NamesRecord | None:
        """The names to keep beside chunk ``key`` in a backend that takes names, if any."""
        ...

    def recovered(self, key: bytes, medium: str, record: bytes) -> None:
        """A backend kept chunk ``key``'s names ``record`` (read back after a restart)."""
        ...


class NamesRecord(Protocol):
    """A chunk's names as a backend keeps them: encoded (in a worker thread) when written."""

    def encode(self) -> bytes: ...


@attrs.define(eq=False)
class TierBackend:
    """One backend of the cascade with its health: whether it may be used now, its counters."""

    backend: Backend
    name: str
    label: str = ""
    """The name, made unique within the cascade (``disk``, ``disk#2``): for metrics."""
    capabilities: Capabilities = attrs.field(
        default=attrs.Factory(lambda self: capabilities(self.backend), takes_self=True)
    )
    """What the backend's class declares it takes besides :class:`Backend`'s calls."""
    down_until: float = -math.inf
    backoff: float = 0.0
    known: bool = False
    """Whether any operation (or the start-up health check) has answered yet."""
    counters: dict[str, int] = attrs.field(factory=dict)
    read_failures: dict[bytes, int] = attrs.field(factory=dict)
    """Failed reads per object since it was last read (at most :data:`_REMEMBERED` objects,
    oldest first)."""
    failing: set[bytes] = attrs.field(factory=set)
    """Distinct objects whose reads failed since the last read that succeeded."""
    problems: dict[str, str] = attrs.field(factory=dict)
    """What does not work, by role (``read``: lookups, loads, unlocks; ``store``: stores and
    deletes): the last failure's description, until an operation of that role succeeds. A
    backend with a problem is unhealthy, also once its backoff has passed: a disk that
    answers lookups but cannot store is not healthy (issue 22)."""
    misconfigured: str = ""
    """The last failure's description where it was :class:`BackendMisconfigured` (the
    service is not what the options say), until an operation succeeds."""

    def count(self, what: str, n: int = 1) -> None:
        self.counters[what] = self.counters.get(what, 0) + n

    async def store(
        self,
        keys: Sequence[bytes],
        buffers: Sequence[Buffers],
        *,
        parents: Sequence[bytes | None] | None = None,
        owners: Sequence[bytes] | None = None,
        names: Sequence[bytes | None] | None = None,
    ) -> list[bool]:
        """The backend's ``store``, given ``parents``, ``owners`` and ``names`` where its
        :attr:`capabilities` say it takes them (and they are given). An answer that is not one
        result per key is the backend's failure (:class:`BackendError`, raised here: inside the
        caller's :meth:`Calls.call`). Cancellation: as the backend's ``store`` (which leaves no
        object behind)."""
        extra: dict[str, object] = {}
        if parents is not None and self.capabilities.parents:
            extra["parents"] = parents
        if owners is not None and self.capabilities.owners:
            extra["owners"] = owners
        if names is not None and self.capabilities.names:
            extra["names"] = names
        results = await self.backend.store(keys, buffers, **extra)
        if len(results) != len(keys):
            raise BackendError(f"store answered {len(results)} results for {len(keys)} keys")
        return results

    async def touch(self, keys: Sequence[bytes]) -> None:
        """The backend's ``touch``: only for one whose :attr:`capabilities` say it takes
        touches. Cancellation: as the backend's ``touch``."""
        assert self.capabilities.touches, f"{self.name} does not take touches"
        await cast(Touching, self.backend).touch(keys)

    async def names(self, prefix: bytes, limit: int) -> Sequence[tuple[bytes, bytes]]:
        """The backend's ``names``: only for one whose :attr:`capabilities` say it keeps names.
        Cancellation: as the backend's ``names``."""
        assert self.capabilities.names, f"{self.name} keeps no names"
        return await cast(Naming, self.backend).names(prefix, limit)

    def usable(self, now: float) -> bool:
        return now >= self.down_until

    @property
    def healthy(self) -> bool | None:
        """False while an operation of some role fails (:attr:`problems`), None until anything
        answered, else True."""
        if self.problems:
            return False
        return True if self.known else None

    @property
    def problem(self) -> str:
        """Why it is unhealthy, in one line (empty if it is not): ``stores fail: …``."""
        return "; ".join(f"{_ROLES[role]} fail: {text}" for role, text in self.problems.items())

    def failed(self, exc: BaseException, now: float, role: str = "read") -> None:
        """Count and log a failure (once per outage), note it as a problem of ``role``
        (``read`` or ``store``) and back the backend off."""
        self.known = True
        self.problems[role] = describe(exc)
        if isinstance(exc, BackendMisconfigured):
            self.misconfigured = describe(exc)
        self.count("errors")
        self.backoff = min(max(self.backoff * 2, _BACKOFF_MIN), _BACKOFF_MAX)
        if self.down_until < now:
            error = describe(exc)
            log.warning(
                "L2 backend %s failed (%s); skipping it for %.1fs",
                self.name,
                error,
                self.backoff,
                exc_info=None if isinstance(exc, BackendError) else exc,  # a bug: show where
                extra=event(
                    "l2_backend_error", backend=self.label, error=error, backoff_s=self.backoff
                ),
            )
        self.down_until = now + self.backoff

    def read_some(self, keys: list[bytes]) -> None:
        """A load read ``keys``: the backend reads (earlier failures were the objects'), and
        their own earlier failures were passing ones (forgotten)."""
        self.failing.clear()
        for key in keys:
            self.read_failures.pop(key, None)

    def unreadable(
        self, keys: list[bytes], exc: BaseException, now: float, *, read_others: bool
    ) -> list[bytes]:
        """Reads of ``keys`` failed for reasons of their own (:class:`UnreadableObjects`);
        ``read_others``: the same call read other objects.

        Returns those that failed :data:`_DROP_AFTER` times: the caller deletes them. When
        :data:`_DOWN_AFTER` distinct objects have failed with no read succeeding in between,
        the failure is the backend's: it is backed off (:meth:`failed`), nothing is blamed on
        the objects, and nothing is returned.
        """
        self.count("read_errors", len(keys))
        if read_others:
            self.failing.clear()
        else:
            self.failing.update(keys)
        if len(self.failing) >= _DOWN_AFTER:
            self.failing.clear()
            self.read_failures.clear()
            self.failed(exc, now)
            return []
        doomed = []
        for key in keys:
            failures = self.read_failures.pop(key, 0) + 1
            if failures >= _DROP_AFTER:
                doomed.append(key)
                continue
            self.read_failures[key] = failures
            if len(self.read_failures) > _REMEMBERED:
                del self.read_failures[next(iter(self.read_failures))]
            log.info(
                "L2 backend %s: an object could not be read (%s); it goes if it fails again",
                self.name,
                describe(exc),
                extra=event("l2_read_error", backend=self.label, error=describe(exc)),
            )
        return doomed

    def succeeded(self, role: str = "read") -> None:
        """An operation of ``role`` worked: its problem is gone, the backoff ends; logged as
        back once no role has a problem."""
        self.known = True
        self.misconfigured = ""
        if self.problems.pop(role, None) is not None and not self.problems:
            log.info(
                "L2 backend %s is back",
                self.name,
                extra=event("l2_backend_back", backend=self.label),
            )
        self.backoff = 0.0
        self.down_until = -math.inf  # (it answers: skipping it any longer loses writes)


@attrs.define
class Call:
    """What became of one call into a backend (see :meth:`Calls.call`)."""

    failed: bool = False
    """The call raised: a failure of the backend (counted, logged, backed off); whatever it
    was to answer is missing."""
    complete: bool = True
    """Cleared by the caller where the call answered for part of its work only (a load with
    unreadable objects): observed as not succeeded, yet no failure of the backend."""


class Calls:
    """The one boundary for calls into backends (:meth:`call`), and the calls that lookups,
    loads, touches and the health checks share."""

    def __init__(
        self, observe: Observe | None = None, listener: TierListener | None = None
    ) -> None:
        self.observe = observe
        """The metrics' observer (see :data:`Observe`), if any."""
        self.listener = listener
        """Told what the calls learn of the chunks each backend holds (KV events), if any."""

    @contextlib.contextmanager
    def call(
        self,
        backend: TierBackend,
        op: str,
        role: str = "read",
        *,
        heals: bool = False,
        metered: bool = True,
    ) -> Iterator[Call]:
        """Wrap one call into ``backend`` (the block): any ``Exception`` the block raises is a
        failure of the backend's ``role`` (:meth:`TierBackend.failed`), swallowed here, and the
        yielded :class:`Call` says ``failed``; a block that completes is, with ``heals``, proof
        that the role works (:meth:`TierBackend.succeeded`). ``metered``: the call is reported
        to the observer as ``op`` (with its time and whether it succeeded and was
        :attr:`Call.complete`); the health checks' are not.

        Cancellation (any ``BaseException`` that is not an ``Exception``) passes through,
        unobserved and not counted: the block's own cleanup applies.
        """
        outcome = Call()
        started = trio.current_time()
        try:
            yield outcome
        except Exception as exc:  # any failure of a backend: see the module docstring
            outcome.failed = True
            self._observed(metered, backend, op, started, False)
            backend.failed(exc, trio.current_time(), role)
        else:
            self._observed(metered, backend, op, started, outcome.complete)
            if heals:
                backend.succeeded(role)

    def _observed(
        self, metered: bool, backend: TierBackend, op: str, started: float, ok: bool
    ) -> None:
        """Report one call that started at ``started`` (``trio.current_time()``)."""
        if metered and self.observe is not None:
            self.observe(backend.label, op, trio.current_time() - started, ok)

    async def unlock(self, backend: TierBackend, keys: list[bytes]) -> None:
        """Unlock ``keys`` in ``backend``; a failure is the backend's (see the module doc).
        Cancellation: as the backend's ``unlock`` (callers shield it)."""
        if not keys:
            return
        with self.call(backend, "unlock"):
            await backend.backend.unlock(keys)

    async def delete(self, backend: TierBackend, keys: list[bytes]) -> None:
        """Delete ``keys`` from ``backend`` (objects found corrupt or unreadable); a failure is
        one of its stores. Cancellation: as the backend's ``delete``."""
        with self.call(backend, "delete", "store") as call:
            await backend.backend.delete(keys)
        if not call.failed and self.listener is not None:
            for key in keys:
                self.listener.removed(key, backend.label)

    async def touch(self, backend: TierBackend, keys: list[bytes]) -> None:
        """Send ``keys`` (used from L1) to the ``touch`` of a backend that takes touches (its
        :attr:`~TierBackend.capabilities`); a failure is the backend's. Cancellation: as the
        backend's ``touch``."""
        with self.call(backend, "touch") as call:
            await backend.touch(keys)
        if not call.failed:
            backend.count("touches", len(keys))


def describe(exc: BaseException) -> str:
    """One line for a backend failure: the message, with the type unless it is ours."""
    if isinstance(exc, BackendError):
        return str(exc)
    if isinstance(exc, OSError) and exc.strerror:
        return f"{type(exc).__name__}: {exc.strerror}"
    return f"{type(exc).__name__}: {exc}"
