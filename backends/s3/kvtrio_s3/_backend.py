"""``s3``: one S3 object per kvtrio object, in a bucket of AWS S3 or any S3-compatible store.

Object names are ``prefix + hex[:2] + "/" + hex`` of the key (the two-character fan-out spreads
the keys over 256 prefixes, which S3 partitions and rate-limits separately). A PUT is atomic in
S3, so every object is written by exactly one PUT and a reader sees a whole object or none.

S3 calls go through obstore's synchronous API in worker threads, at most ``connections`` at
once (one ``trio.CapacityLimiter``). Threads that read from or write into the caller's buffers
are never abandoned on cancellation, so a cancelled load or store first waits for its requests
in flight (each bounded by ``timeout``); a lookup's HEADs touch no buffer and lock nothing until
answered, so a cancelled lookup returns at once and drops their answers (a lookup's deadline
holds while the store does not answer).

Locks are local: S3 evicts nothing, but lifecycle rules or other servers sharing the bucket may
delete an object at any time, and then a load of it is simply a miss. A local ``delete`` of a
locked key is deferred until its last unlock (lookups no longer see it meanwhile), so within one
server a locked object is protected.
"""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import attrs
import trio

from kvtrio.l2 import BackendError, BackendUnavailable, Buffers, LocalLocks
from kvtrio.options import at_least, positive

from ._client import MAX_OBJECT_SIZE, S3Client

__all__ = ["S3Backend", "S3Options"]

_T = TypeVar("_T")
_COUNTERS = (
    "lookups", "lookup_hits", "heads", "loads", "load_bytes", "load_misses",
    "load_size_mismatches", "stores", "store_bytes", "store_refused", "deletes", "errors",
    "unavailable",
)  # fmt: skip
_PROBE_NAME = "kvtrio-bucket-probe"  # not hex: never the name of an object


def _not_empty(instance: object, attribute: attrs.Attribute[Any], value: str) -> None:
    if not value.strip():
        raise ValueError(f"{attribute.name}: must not be empty")


def _url(instance: object, attribute: attrs.Attribute[Any], value: str) -> None:
    if value and not value.startswith(("http://", "https://")):
        raise ValueError(f"{attribute.name}: must be an http:// or https:// URL, got {value!r}")


@attrs.frozen
class S3Options:
    bucket: str = attrs.field(
        validator=_not_empty, metadata={"help": "Bucket of the objects (required)."}
    )
    endpoint: str = attrs.field(
        default="",
        validator=_url,
        metadata={"help": "S3 endpoint URL, e.g. http://127.0.0.1:8333 (empty: AWS S3)."},
    )
    region: str = attrs.field(
        default="",
        metadata={"help": "Region (empty: AWS_REGION / AWS_DEFAULT_REGION, else us-east-1)."},
    )
    prefix: str = attrs.field(
        default="kvtrio/", metadata={"help": "Prefix of the object names in the bucket."}
    )
    access_key_id: str = attrs.field(
        default="",
        metadata={"help": "Access key id (empty: the AWS_* environment / credential chain)."},
    )
    secret_access_key: str = attrs.field(
        default="", metadata={"help": "Secret access key (with access_key_id)."}, repr=False
    )
    allow_http: bool = attrs.field(
        default=False, metadata={"help": "Allow an http:// endpoint (local or trusted networks)."}
    )
    connections: int = attrs.field(
        default=16,
        validator=at_least(1),
        metadata={"help": "Concurrent S3 requests (worker threads)."},
    )
    create_bucket: bool = attrs.field(
        default=False, metadata={"help": "Create the bucket on first use if it is missing."}
    )
    timeout: float = attrs.field(
        default=30.0,
        validator=positive,
        metadata={"help": "Seconds a request may take, retries included."},
    )
    retries: int = attrs.field(
        default=3,
        validator=at_least(0),
        metadata={"help": "Retries of a request after a 5xx answer or a connection error."},
    )
    sign_payload: bool = attrs.field(
        default=False,
        metadata={"help": "Sign bodies' SHA-256 too (costs CPU; kvtrio checksums objects)."},
    )

    def __attrs_post_init__(self) -> None:
        if self.endpoint.startswith("http://") and not self.allow_http:
            raise ValueError(f"endpoint: {self.endpoint} is plain http; set allow_http=true")
        if bool(self.access_key_id) != bool(self.secret_access_key):
            missing = "secret_access_key" if self.access_key_id else "access_key_id"
            raise ValueError(f"{missing}: needed too when the other key is given")
        if self.prefix.startswith("/"):
            raise ValueError(f"prefix: must not start with '/', got {self.prefix!r}")


class _Probe:
    """One check of the bucket; concurrent first operations wait for it."""

    def __init__(self) -> None:
        self.done = trio.Event()
        self.error: BackendError | None = None


class _PrefixScan:
    """The HEADs of one lookup, in key order: requests are handed out one index at a time, and
    none for keys after a known miss or error (also checked in the worker thread, just before
    the request, since another thread may have just found one)."""

    def __init__(self, client: S3Client, paths: list[str]) -> None:
        self._client = client
        self._paths = paths
        self._lock = threading.Lock()
        self._next = 0
        self._stop = len(paths)  # index of the first miss or error known so far
        self._outcomes: list[bool | BackendError | None] = [None] * len(paths)

    def next_index(self) -> int | None:
        """The next key to ask about, or None when the prefix is settled."""
        with self._lock:
            index = self._next
            if index >= self._stop:
                return None
            self._next += 1
            return index

    def head(self, index: int) -> bool | None:
        """In a worker thread: whether the object exists; None if not asked (after a miss)."""
        with self._lock:
            if index > self._stop:
                return None
        try:
            exists = self._client.head(self._paths[index])
        except BackendError as exc:
            self.record(index, exc)
            raise
        self.record(index, exists)
        return exists

    def record(self, index: int, outcome: bool | BackendError) -> None:
        with self._lock:
            self._outcomes[index] = outcome
            if outcome is not True:
                self._stop = min(self._stop, index)

    def result(self) -> int:
        """The prefix length: up to the first key not found or not asked about; the error that
        ended it is raised."""
        for index, outcome in enumerate(self._outcomes):
            if isinstance(outcome, BackendError):
                raise outcome
            if outcome is not True:
                return index
        return len(self._outcomes)


class S3Backend:
    """Objects in an S3 bucket; local lock counts, deferred deletes of locked keys."""

    name = "s3"
    Options = S3Options
    shared_store = True  # other kvtrio servers may use the bucket too (fleet records)

    def __init__(self, options: S3Options) -> None:
        self.options = options
        self._client = S3Client(options)  # no I/O: obstore connects at the first request
        self._limiter = trio.CapacityLimiter(options.connections)
        self._locks = LocalLocks()  # deleted while locked: deleted at the last unlock
        self._ready = False  # the bucket was found (or created)
        self._probe: _Probe | None = None
        self._closed = False
        self.counters = collections.Counter[str](dict.fromkeys(_COUNTERS, 0))

    # ----------------------------------------------------------------- the interface

    async def lookup_and_lock(self, keys: Sequence[bytes]) -> int:
        """HEAD the keys in order, up to ``connections`` at once; lock the prefix that exists.

        No request is started for keys after the first miss (keys deleted locally while locked
        count as misses). On cancellation, HEADs in flight are abandoned (they run on, bounded by
        ``timeout``; their answers are dropped), and nothing is locked: the locks are taken
        after the last checkpoint.
        """
        self._check_open()
        limit = next((i for i, key in enumerate(keys) if self._locks.is_doomed(key)), len(keys))
        if limit == 0:
            await trio.lowlevel.checkpoint()
            return 0
        await self._ensure_ready()
        self.counters["lookups"] += 1
        found = await self._count_existing(keys[:limit])
        # No checkpoint from here on.
        found = next((i for i, key in enumerate(keys[:found]) if self._locks.is_doomed(key)), found)
        self._locks.lock(keys[:found])
        self.counters["lookup_hits"] += found
        return found

    async def unlock(self, keys: Sequence[bytes]) -> None:
        """Drop one lock per key; delete objects whose deletion waited for their last unlock.

        The counts change before anything can be cancelled; the deferred DELETE is shielded
        from cancellation (bounded by ``timeout``), and if it fails, BackendError is raised
        with the counts already updated (the object stays in the bucket).
        """
        gone = self._locks.unlock(keys)
        if not gone or self._closed:
            await trio.lowlevel.cancel_shielded_checkpoint()
            return
        with trio.CancelScope(shield=True):
            await self._delete_now(gone)

    async def load(self, keys: Sequence[bytes], buffers: Sequence[Buffers]) -> list[bool]:
        """GET the objects concurrently into their buffers; False for missing objects and
        objects whose length differs from their buffers'.

        Raises the first error after every request has ended. On cancellation, GETs in flight
        finish first (they write into the buffers), then Cancelled propagates.
        """
        self._check_open()
        if len(keys) != len(buffers):
            raise ValueError("load: as many buffers as keys are needed")
        await self._ensure_ready()
        results = [False] * len(keys)
        errors: list[BackendError] = []

        async def load_one(index: int) -> None:
            parts = buffers[index]
            size = sum(part.nbytes for part in parts)
            try:
                outcome = await self._run(
                    self._client.get_into, self._path(keys[index]), parts, size
                )
            except BackendError as exc:
                self._count_error(exc)
                errors.append(exc)
                return
            self.counters["loads"] += 1
            if outcome:
                results[index] = True
                self.counters["load_bytes"] += size
            elif outcome is None:
                self.counters["load_misses"] += 1
            else:
                self.counters["load_size_mismatches"] += 1

        async with trio.open_nursery() as nursery:
            for index in range(len(keys)):
                nursery.start_soon(load_one, index)
        if errors:
            raise errors[0]
        return results

    async def store(self, keys: Sequence[bytes], buffers: Sequence[Buffers]) -> list[bool]:
        """PUT each object (the concatenation of its buffers) with one request, concurrently.

        Raises the first error after every request has ended (objects written by the other
        requests stay: they are complete). If cancelled, the requests in flight finish and the
        objects this call wrote are deleted again (shielded), so nothing of it stays behind.
        """
        self._check_open()
        if len(keys) != len(buffers):
            raise ValueError("store: as many buffers as keys are needed")
        await self._ensure_ready()
        results = [False] * len(keys)
        errors: list[BackendError] = []
        written: list[bytes] = []
        due: list[bytes] = []  # (deferred deletes the failed stores left due)

        async def store_one(index: int) -> None:
            key, parts = keys[index], buffers[index]
            size = sum(part.nbytes for part in parts)
            if size > MAX_OBJECT_SIZE:
                self.counters["store_refused"] += 1
                return
            # The key's last unlock may come after the PUT is applied and before its answer
            # is seen here: the locks keep its deferred delete until the outcome is known.
            self._locks.storing([key])
            ok = False
            try:
                await self._run(self._client.put, self._path(key), parts)
                ok = True
            except BackendError as exc:
                self._count_error(exc)
                errors.append(exc)
                return
            finally:
                if self._locks.stored(key, ok):  # (ok: a pending delete was for the old one)
                    due.append(key)
            written.append(key)
            results[index] = True
            self.counters["stores"] += 1
            self.counters["store_bytes"] += size

        try:
            async with trio.open_nursery() as nursery:
                for index in range(len(keys)):
                    nursery.start_soon(store_one, index)
        except BaseException:
            if written or due:
                with trio.CancelScope(shield=True):
                    try:
                        await self._delete(written)
                        if due:
                            await self._delete_now(due)
                    except BackendError as exc:
                        self._count_error(exc)
            raise
        if due:
            with trio.CancelScope(shield=True), contextlib.suppress(BackendError):
                await self._delete_now(due)  # (a failure is counted; the object stays)
        if errors:
            raise errors[0]
        return results

    async def delete(self, keys: Sequence[bytes]) -> None:
        """DELETE the objects (one request per 1000 keys); locked keys go at their last unlock.

        Cancellation while the request is in flight waits for it; the objects are then gone.
        """
        self._check_open()
        await self._delete(keys)

    async def aclose(self) -> None:
        """Refuse new operations (BackendError); operations in flight complete. Idempotent."""
        self._closed = True
        await trio.lowlevel.checkpoint()

    def statistics(self) -> Mapping[str, float]:
        return {
            "locks": self._locks.total,
            "locked_keys": self._locks.locked_keys,
            "pending_deletes": self._locks.deferred_deletes,
            "connections": self.options.connections,
            "connections_busy": self._limiter.borrowed_tokens,
            "ready": float(self._ready),
            **self.counters,
        }

    # ----------------------------------------------------------------- internals

    def _path(self, key: bytes) -> str:
        name = key.hex()
        return f"{self.options.prefix}{name[:2]}/{name}"

    def _check_open(self) -> None:
        if self._closed:
            raise BackendError("s3: the backend is closed")

    def _count_error(self, exc: BackendError) -> None:
        self.counters["errors"] += 1
        if isinstance(exc, BackendUnavailable):
            self.counters["unavailable"] += 1

    async def _run(
        self, function: Callable[..., _T], *args: Any, abandon_on_cancel: bool = False
    ) -> _T:
        """Run a blocking S3 call in a worker thread; abandoned on cancellation only with
        ``abandon_on_cancel`` (for calls that touch no caller's buffer: the HEADs of lookups)."""
        self._check_open()
        return await trio.to_thread.run_sync(
            function, *args, limiter=self._limiter, abandon_on_cancel=abandon_on_cancel
        )

    async def _count_existing(self, keys: Sequence[bytes]) -> int:
        """Length of the prefix of ``keys`` whose objects exist: HEADs in key order, up to
        ``connections`` at once, none after the first miss."""
        scan = _PrefixScan(self._client, [self._path(key) for key in keys])

        async def worker() -> None:
            while (index := scan.next_index()) is not None:
                try:
                    outcome = await self._run(scan.head, index, abandon_on_cancel=True)
                except BackendError as exc:
                    scan.record(index, exc)  # (also when it never reached the thread)
                    self._count_error(exc)
                    return
                if outcome is not None:
                    self.counters["heads"] += 1

        async with trio.open_nursery() as nursery:
            for _ in range(min(self.options.connections, len(keys))):
                nursery.start_soon(worker)
        return scan.result()

    async def _delete(self, keys: Sequence[bytes]) -> None:
        """Delete now, or at the last unlock for locked keys."""
        now = []
        for key in keys:
            if not self._locks.defer_delete(key):
                now.append(key)
        if now:
            await self._delete_now(now)
        else:
            await trio.lowlevel.checkpoint()

    async def _delete_now(self, keys: Sequence[bytes]) -> None:
        await self._ensure_ready()
        try:
            await self._run(self._client.delete, [self._path(key) for key in keys])
        except BackendError as exc:
            self._count_error(exc)
            raise
        self.counters["deletes"] += len(keys)

    async def _ensure_ready(self) -> None:
        """Check the bucket once (creating it if asked); retried by the next operation after
        a failure. Concurrent callers share one check and its outcome."""
        while not self._ready:
            probe = self._probe
            if probe is not None:
                await probe.done.wait()
                if probe.error is not None:
                    raise type(probe.error)(str(probe.error))
                continue
            probe = self._probe = _Probe()
            try:
                await self._run(
                    self._client.prepare_bucket,
                    self.options.prefix + _PROBE_NAME,
                    self.options.create_bucket,
                )
            except BackendError as exc:
                self._count_error(exc)
                probe.error = exc
                raise
            else:
                self._ready = True
            finally:
                self._probe = None
                probe.done.set()
