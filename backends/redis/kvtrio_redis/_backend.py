"""``redis``: L2 objects in Redis (one server, or a Redis Cluster), shared by kvtrio servers.

Each object is one Redis string ``<prefix><key as hex>`` written by a single ``SET`` (with
``PX`` when a ``ttl`` is set): Redis applies a command only once all of its arguments have
arrived, and replaces a value in one step, so a reader sees the whole old object, the whole new
one, or none — never a header of one and a body of another — and a store that fails or is
interrupted half-way leaves nothing behind. Header and chunk go out as two pieces of that one
command, straight from the caller's buffers (see :mod:`._wire`); no temporary key, so no
RENAME and no hash tags are needed in a cluster either.

Locks are local: ``lookup_and_lock`` counts them in this process and a ``delete`` of a locked
key waits for the last unlock, but Redis itself may still evict a locked object (``maxmemory``)
or expire it (``ttl``), and another kvtrio server sharing the Redis may delete it. A load of
such an object is simply a miss.

Blocking redis-py calls run in worker threads, at most ``connections`` at once (the pool has as
many connections, per node in a cluster). A thread, once started, finishes its Redis exchange
even when the calling task is cancelled (bounded by ``timeout``); cancellation takes effect
before it starts or after it ends, except for a lookup's EXISTS, which writes into no buffer
and locks nothing until it is answered: a cancelled lookup returns at once and its thread's
answer is dropped (so a lookup's deadline holds while Redis does not answer). Every redis-py
exception is turned into :class:`~kvtrio.l2.BackendUnavailable` (cannot reach the service) or
:class:`~kvtrio.l2.BackendError` here.
"""

from __future__ import annotations

import collections
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, TypeVar

import attrs
import trio
from redis import exceptions

from kvtrio.l2 import (
    BackendError,
    BackendMisconfigured,
    BackendUnavailable,
    Buffers,
    LocalLocks,
)
from kvtrio.options import not_negative, positive

from ._client import NOT_STANDALONE, ClusterClient, StandaloneClient
from ._wire import byte_views

__all__ = ["RedisBackend", "RedisOptions"]

_T = TypeVar("_T")

# Failures that mean "the service cannot be reached right now" rather than "it refused this".
_UNAVAILABLE: tuple[type[BaseException], ...] = (
    exceptions.ConnectionError,  # also authentication, LOADING, too many connections
    exceptions.TimeoutError,
    exceptions.ClusterDownError,
    exceptions.TryAgainError,
    exceptions.RedisClusterException,  # cannot read the slot map, slot not covered
    OSError,  # includes socket timeouts
)


def _redis_url(instance: object, attribute: attrs.Attribute[Any], value: str) -> None:
    scheme = urllib.parse.urlsplit(value).scheme
    if scheme not in ("redis", "rediss", "unix"):
        raise ValueError(f"{attribute.name}: must be redis://, rediss:// or unix://, got {value!r}")


@attrs.frozen
class RedisOptions:
    url: str = attrs.field(
        default="redis://127.0.0.1:6379/0",
        validator=_redis_url,
        metadata={"help": "Redis URL (redis://, rediss://, unix://); with cluster, any node."},
    )
    cluster: bool = attrs.field(
        default=False, metadata={"help": "Use Redis Cluster (url names any node of it)."}
    )
    prefix: str = attrs.field(
        default="kvtrio:", metadata={"help": "Prepended to every key name (no {hash tags})."}
    )
    ttl: float = attrs.field(
        default=0.0,
        validator=not_negative,
        metadata={"help": "Seconds until a stored object expires (0: never)."},
    )
    connections: int = attrs.field(
        default=4,
        validator=positive,
        metadata={"help": "Concurrent operations: worker threads and pooled connections."},
    )
    timeout: float = attrs.field(
        default=5.0,
        validator=positive,
        metadata={"help": "Seconds to connect or wait on a socket before Redis counts as down."},
    )


class RedisBackend:
    """Objects as Redis strings; per-key lock counts kept locally (see the module docstring)."""

    name: ClassVar[str] = "redis"
    shared_store: ClassVar[bool] = True  # other kvtrio servers may use it too (fleet records)
    Options: ClassVar[type[RedisOptions]] = RedisOptions

    def __init__(self, options: RedisOptions | None = None) -> None:
        self.options = options or RedisOptions()
        if self.options.cluster and urllib.parse.urlsplit(self.options.url).scheme == "unix":
            raise ValueError("url: a Redis Cluster is reached over TCP, not unix://")
        client_class = ClusterClient if self.options.cluster else StandaloneClient
        self._client = client_class(
            self.options.url, self.options.connections, self.options.timeout
        )  # (neither connects here)
        self._prefix = self.options.prefix.encode()
        self._ttl_ms = max(1, round(self.options.ttl * 1000)) if self.options.ttl else 0
        self._threads = trio.CapacityLimiter(self.options.connections)
        self._locks = LocalLocks()  # deleted while locked: DEL at the last unlock
        self._closed = False
        self._checked = False  # whether the server was found to be what `cluster` says
        self._running = 0  # operations inside a worker thread (or waiting for one)
        self._idle = trio.Event()
        self._idle.set()
        self.counters = collections.Counter[str]()

    # ----------------------------------------------------------------- the interface

    async def lookup_and_lock(self, keys: Sequence[bytes]) -> int:
        """Length of the prefix of ``keys`` present in Redis (one pipelined EXISTS round trip),
        locked locally. Cancelled before the answer is in (also while the thread waits on
        Redis: it is abandoned, its answer dropped): nothing is locked; once the answer is in,
        the locks are taken without another checkpoint."""
        if not keys:
            await trio.lowlevel.checkpoint()
            return 0
        present = await self._run(
            "lookup", self._client.exists, self._names(keys), abandon_on_cancel=True
        )
        found = 0
        for key, exists in zip(keys, present, strict=True):
            if not exists or self._locks.is_doomed(key):
                break
            found += 1
        self._locks.lock(keys[:found])
        self.counters["lookups"] += 1
        return found

    async def unlock(self, keys: Sequence[bytes]) -> None:
        """Drop one lock per key, first thing (so cancellation cannot skip it); never fails.

        A key deleted while locked is deleted from Redis now, shielded from cancellation (bounded
        by ``timeout``); if that fails it is counted and the object stays until evicted."""
        gone = self._locks.unlock(keys)
        if not gone or self._closed:
            await trio.lowlevel.cancel_shielded_checkpoint()
            return
        await self._delete_due(gone)

    async def _delete_due(self, keys: list[bytes]) -> None:
        """DEL keys whose deferred delete is due, shielded from cancellation (bounded by
        ``timeout``); a failure is counted, and the objects stay until evicted."""
        with trio.CancelScope(shield=True):
            try:
                await self._run("delete", self._client.delete, self._names(keys))
            except BackendError:
                self.counters["deferred_delete_errors"] += 1

    async def load(self, keys: Sequence[bytes], buffers: Sequence[Buffers]) -> list[bool]:
        """GET every key into its buffers (one pipelined batch). Cancelled before the worker
        thread starts: nothing was read; once started, the batch completes."""
        views = [byte_views(parts) for parts in buffers]
        if len(views) != len(keys):
            raise ValueError("load: one list of buffers per key")
        if not keys:
            await trio.lowlevel.checkpoint()
            return []
        results = await self._run("load", self._client.get_into, self._names(keys), views)
        hits = sum(results)
        self.counters["loads"] += len(keys)
        self.counters["load_misses"] += len(keys) - hits
        self.counters["load_bytes"] += sum(
            sum(len(v) for v in parts) for parts, ok in zip(views, results, strict=True) if ok
        )
        return results

    async def store(self, keys: Sequence[bytes], buffers: Sequence[Buffers]) -> list[bool]:
        """SET every key to the concatenation of its buffers (one pipelined batch; each object
        appears whole or not at all). False where Redis refuses it for lack of memory.
        Cancelled before the worker thread starts: nothing is written; once started, the batch
        completes."""
        views = [byte_views(parts) for parts in buffers]
        if len(views) != len(keys):
            raise ValueError("store: one list of buffers per key")
        if not keys:
            await trio.lowlevel.checkpoint()
            return []
        # A key's last unlock may come after Redis applied its SET and before this task sees
        # the answer: the locks then keep its deferred delete until the store's outcome is known.
        self._locks.storing(keys)
        results: list[bool] = []
        try:
            results = await self._run(
                "store", self._client.set_from, self._names(keys), views, self._ttl_ms
            )
        finally:
            outcomes = results if len(results) == len(keys) else [False] * len(keys)
            due = [k for k, ok in zip(keys, outcomes, strict=True) if self._locks.stored(k, ok)]
            if due and not self._closed:
                await self._delete_due(due)
        for parts, ok in zip(views, results, strict=True):
            if ok:
                self.counters["stores"] += 1
                self.counters["store_bytes"] += sum(len(v) for v in parts)
            else:
                self.counters["store_refused"] += 1
        return results

    async def delete(self, keys: Sequence[bytes]) -> None:
        """DEL the keys; locally locked ones are deleted at their last unlock instead.
        Cancelled before the worker thread starts: nothing is deleted."""
        gone = []
        for key in keys:
            if not self._locks.defer_delete(key):
                gone.append(key)
        if not gone:
            await trio.lowlevel.checkpoint()
            return
        await self._run("delete", self._client.delete, self._names(gone))
        self.counters["deletes"] += len(gone)

    async def aclose(self) -> None:
        """Close the connections; idempotent. Operations in flight fail with BackendError (their
        sockets are shut down) and later ones at once. Waits for worker threads to finish, up
        to ``timeout``, then closes again whatever they reopened; cancellation skips the wait."""
        if self._closed:
            await trio.lowlevel.checkpoint()
            return
        self._closed = True
        with trio.CancelScope(shield=True):  # closing sockets does not wait on the network
            await trio.to_thread.run_sync(self._client.close)
        try:
            with trio.move_on_after(self.options.timeout + 1):
                await self._idle.wait()
        finally:
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(self._client.close)

    def statistics(self) -> Mapping[str, float]:
        return {
            "locks": self._locks.total,
            "locked_keys": self._locks.locked_keys,
            "doomed": self._locks.deferred_deletes,
            "threads_busy": self._threads.borrowed_tokens,
            "cluster_redirects": self._client.redirects,
            **self.counters,
        }

    # ----------------------------------------------------------------- internals

    def _names(self, keys: Sequence[bytes]) -> list[bytes]:
        return [self._prefix + key.hex().encode() for key in keys]

    async def _run(
        self,
        operation: str,
        function: Callable[..., _T],
        *args: Any,
        abandon_on_cancel: bool = False,
    ) -> _T:
        """Run ``function(*args)`` in a worker thread, mapping every failure to BackendError.

        The result comes back without a checkpoint after the thread ends, so callers can act on
        it before a pending cancellation is delivered. ``abandon_on_cancel``: a cancellation
        returns at once, the thread runs on (bounded by ``timeout``, holding its limiter token)
        and its result is dropped; only for calls that touch no caller's buffer."""
        if self._closed:
            await trio.lowlevel.checkpoint()
            raise BackendError(f"redis: {operation} after aclose()")
        self._running += 1
        self._idle = trio.Event() if self._running == 1 else self._idle
        try:
            return await trio.to_thread.run_sync(
                self._in_thread,
                operation,
                function,
                *args,
                limiter=self._threads,
                abandon_on_cancel=abandon_on_cancel,
            )
        except BackendError:
            self.counters["errors"] += 1
            raise
        finally:
            self._running -= 1
            if not self._running:
                self._idle.set()

    def _in_thread(self, operation: str, function: Callable[..., _T], *args: Any) -> _T:
        """Run one operation; before the first that reaches the server, check that the server
        is what ``cluster`` says (:class:`BackendMisconfigured` naming the option if not)."""
        if self._closed:
            raise BackendError(f"redis: {operation} after aclose()")
        try:
            if not self._checked:
                wrong = self._client.check()
                if wrong is not None:
                    raise BackendMisconfigured(f"redis {_server(self.options.url)} {wrong}")
                self._checked = True  # (two threads may both check first: harmless)
            return function(*args)
        except BackendMisconfigured:
            raise
        except Exception as exc:
            if self._closed:  # whatever redis-py raises when its sockets close under it
                raise BackendError(f"redis: {operation} interrupted by aclose()") from None
            if isinstance(exc, exceptions.MovedError):
                raise BackendMisconfigured(
                    f"redis {_server(self.options.url)} {NOT_STANDALONE}"
                ) from None
            if isinstance(exc, _UNAVAILABLE):
                raise BackendUnavailable(_describe(operation, exc, self.options.url)) from None
            if isinstance(exc, exceptions.RedisError):
                raise BackendError(_describe(operation, exc, self.options.url)) from None
            raise


def _server(url: str) -> str:
    """Where ``url`` points, never with its password."""
    where = urllib.parse.urlsplit(url)
    return where.netloc.rpartition("@")[2] or where.path


def _describe(operation: str, exc: BaseException, url: str) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return f"redis {_server(url)}: {operation} failed: {type(exc).__name__}: {text}"
