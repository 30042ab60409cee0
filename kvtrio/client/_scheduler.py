"""The engine scheduler's side: lookups and request ends, never raising into the step loop."""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future

from ..errors import ErrorCode, KvtrioError, ServerError
from ..protocol import (
    DEFAULT_CHUNK_SIZE,
    MAX_HASHES,
    MAX_LOOKUP_BATCH,
    MAX_LOOKUP_KEYS,
    EndSession,
    FreeLookupLocks,
    HelloReply,
    Lookup,
    LookupBatch,
    LookupBatchReply,
    LookupReply,
    PromptChunks,
    Reply,
    prompt_chunks,
    wire_request_id,
)
from ._grouped import GroupedChunks, grouped_chunks
from ._identity import EngineIdentity
from ._sync import Client

__all__ = ["SchedulerAdapter"]

log = logging.getLogger("kvtrio.client")


def lookup_limit(world_size: int) -> int:
    """The most chunk hashes one lookup at ``world_size`` may carry (the server's
    ``MAX_HASHES`` and ``MAX_LOOKUP_KEYS``)."""
    return max(1, min(MAX_HASHES, MAX_LOOKUP_KEYS // max(world_size, 1)))


def _batches(queue: list[tuple[str, _Queued]], world_size: int) -> list[list[tuple[str, _Queued]]]:
    """``queue`` cut into batches of at most ``MAX_LOOKUP_BATCH`` lookups and
    ``MAX_LOOKUP_KEYS`` keys (world size × hashes) each."""
    batches: list[list[tuple[str, _Queued]]] = [[]]
    keys = 0
    for entry in queue:
        size = len(entry[1].hashes) * world_size
        if batches[-1] and (len(batches[-1]) >= MAX_LOOKUP_BATCH or keys + size > MAX_LOOKUP_KEYS):
            batches.append([])
            keys = 0
        batches[-1].append(entry)
        keys += size
    return batches


class _Queued:
    """A lookup: its prompt's chunks, then (once sent) the future of its message and its index
    in the batch (-1: sent alone), then (once answered) the tokens of its hit's L1 part."""

    __slots__ = ("batch", "chunks", "index", "l1_tokens")

    def __init__(
        self, chunks: PromptChunks | GroupedChunks, batch: Future[Reply] | None = None
    ) -> None:
        self.chunks = chunks
        self.batch = batch
        self.index = -1
        self.l1_tokens: int | None = None

    @property
    def hashes(self) -> tuple[bytes, ...]:
        return self.chunks.hashes


Groups = tuple[tuple[tuple[tuple[bytes | int, ...], int], ...], tuple[bytes | int, ...] | None]
"""A grouped lookup's block hashes: each group's (with the first token a hit needs of it), and
the state group's (or None)."""


class _Early:
    """A lookup made before the server's first ``hello`` answer (whose chunk size names the
    chunks): its prompt, kept until that answer or ``deadline``."""

    __slots__ = ("block_hashes", "deadline", "defer", "groups", "token_ids")

    def __init__(
        self,
        block_hashes: Sequence[bytes | int] | None,
        token_ids: Sequence[int] | None,
        defer: bool,
        deadline: float,
        groups: Groups | None = None,
    ) -> None:
        # Copies: an engine's token list grows as it generates.
        self.block_hashes = None if block_hashes is None else tuple(block_hashes)
        self.token_ids = None if token_ids is None else tuple(token_ids)
        self.defer = defer
        self.deadline = deadline
        self.groups = groups


class _Looked:
    """The lookups sent for one request until its end: how many, the last one's future, and
    whether the server is known to hold nothing for it (``quiet``): its one lookup answered a
    miss, or had its pins freed once answered. Then its end needs no message."""

    __slots__ = ("count", "last", "quiet")

    def __init__(self) -> None:
        self.count = 0
        self.last: Future[Reply] | None = None
        self.quiet = False

    def sent(self, future: Future[Reply]) -> None:
        self.count += 1
        self.last = future
        self.quiet = False

    def settled(self) -> None:
        """Nothing is held for the request now, if it sent one lookup and that one is
        answered (a lookup replaced by another may still pin as it ends: not settled)."""
        if self.count == 1 and self.last is not None and self.last.done():
            self.quiet = True


class SchedulerAdapter:
    """What an engine's scheduler calls (method names of vLLM's LMCache multiprocess adapter).

    Lookups are submitted without waiting and polled with :meth:`check_lookup_result`. While the
    server is away, lookups report 0 hits at once (``fail_fast``); a lookup made while the
    client's first connection is still being made (an adapter used as soon as it is made) waits
    for it, up to ``timeout``. Nothing here raises into the engine: failures are logged and
    count as misses. ``engine_id`` names the engine: its workers
    must be given the same one (request ids are scoped by it).

    Deferred lookups (``defer=True``) are queued and go out together, as one ``lookup_batch``
    message, at :meth:`flush_lookups` or when one of them is waited for: what a scheduler step
    with a burst of new requests should do (one message for the step, not one per request).
    """

    def __init__(
        self,
        server_url: str,
        model_name: str,
        world_size: int,
        kv_rank: int,
        block_size: int,
        *,
        tenant: str = "",
        engine_id: str = "",
        timeout: float = 5.0,
        client: Client | None = None,
        server_key: str | None = None,
        client_key: str | None = None,
    ) -> None:
        self.model_name = model_name
        self.engine_id = engine_id
        self.world_size = world_size
        self.kv_rank = kv_rank
        self.block_size = block_size
        self.tenant = tenant
        self.timeout = timeout
        self._own_client = client is None
        self.client = (
            client
            if client is not None
            else Client(
                server_url,
                timeout=timeout,
                client_name=f"kvtrio-scheduler/{model_name}",
                server_key=server_key,
                client_key=client_key,
            )
        )
        self._lookups: dict[str, _Queued | _Early] = {}
        self._queue: list[tuple[str, _Queued]] = []
        """Deferred lookups not sent yet (see :meth:`flush_lookups`)."""
        self._batches = True
        """False once the server answered that it has no ``lookup_batch`` (older server)."""
        self._sent: collections.deque[tuple[EndSession | FreeLookupLocks, Future[Reply]]] = (
            collections.deque()
        )
        """Fire-and-forget requests not known to be answered yet (checked for failures later)."""
        self._looked: dict[str, _Looked] = {}
        """The lookups sent per request until its end (:meth:`end_session`)."""
        self._lock = threading.Lock()

    @classmethod
    def from_identity(cls, identity: EngineIdentity) -> SchedulerAdapter:
        """The scheduler adapter of the engine ``identity`` names."""
        i = identity
        return cls(i.server_url, i.model_name, i.world_size, i.kv_rank, i.block_size,
                   tenant=i.tenant, engine_id=i.engine_id, timeout=i.timeout,
                   server_key=i.server_key, client_key=i.client_key)  # fmt: skip

    @property
    def chunk_size(self) -> int:
        info = self.client.server_info
        return info.chunk_size if info is not None else DEFAULT_CHUNK_SIZE

    def num_blocks_per_chunk(self) -> int:
        """Engine blocks per cached chunk (a method, as in vLLM's adapter)."""
        return max(1, self.chunk_size // self.block_size)

    def maybe_submit_lookup_request(
        self,
        request_id: str,
        block_hashes: Sequence[bytes | int] | None = None,
        token_ids: Sequence[int] | None = None,
        *,
        defer: bool = False,
        groups: Sequence[tuple[Sequence[bytes | int], int]] | None = None,
        state: Sequence[bytes | int] | None = None,
    ) -> None:
        """Start a lookup for ``request_id`` unless one is already pending or answered.

        With ``defer``, it is queued and sent with the other queued ones at the next
        :meth:`flush_lookups` (or when it is waited for). With ``groups`` (each KV cache
        group's block hashes, and the first token a hit at their end needs of it) and
        ``state`` (a state group's), one lookup asks for every group's chunks and its hit is
        what every group holds (:mod:`._grouped`).
        """
        with self._lock:
            if request_id in self._lookups:
                return
            grouped: Groups | None = None
            if groups is not None:
                grouped = (
                    tuple((tuple(hashes), first) for hashes, first in groups),
                    None if state is None else tuple(state),
                )
            info = self.client.server_info  # its chunk size names the chunks
            if info is None and not self.client.known_away():  # the first hello is on its way
                deadline = time.monotonic() + self.timeout
                self._lookups[request_id] = _Early(
                    block_hashes, token_ids, defer, deadline, grouped
                )
                return
            self._start(request_id, info, block_hashes, token_ids, defer, grouped)

    def _start(
        self,
        request_id: str,
        info: HelloReply | None,
        block_hashes: Sequence[bytes | int] | None,
        token_ids: Sequence[int] | None,
        defer: bool,
        grouped: Groups | None = None,
    ) -> None:
        """Queue or send the lookup (under the lock); without ``info`` (no server) it answers
        0 at once."""
        try:
            if info is None:
                raise ValueError(f"no kvtrio server at {self.client.endpoint} yet")
            # The prompt's full chunks and its partial chunk (the whole blocks after them):
            # a hit may reach its last whole block.
            chunks: PromptChunks | GroupedChunks
            if grouped is not None:
                chunks = grouped_chunks(info.chunk_size, self.block_size, *grouped)
            else:
                chunks = prompt_chunks(
                    info.chunk_size, self.block_size, token_ids=token_ids, block_hashes=block_hashes
                )
            # A lookup answers a prefix: beyond the server's bounds, a shorter prefix.
            chunks = chunks.limited(lookup_limit(self.world_size))
        except (ValueError, TypeError, OverflowError) as exc:
            log.debug("lookup of %s not sent: %s", request_id, exc)
            failed: Future[Reply] = Future()
            failed.set_result(LookupReply(0, 0))
            self._lookups[request_id] = _Queued(PromptChunks((), 1, 1), failed)
            return
        queued = _Queued(chunks)
        self._lookups[request_id] = queued
        if defer and self._batches:
            self._queue.append((request_id, queued))
            return
        queued.batch = self._submit(request_id, chunks.hashes)

    def _after_hello(self, request_id: str, early: _Early, wait: float) -> _Queued | None:
        """Start a lookup made before the first hello once the answer is there (waiting up to
        ``wait`` seconds for it): its entry now, or None while it still waits. At its deadline,
        or once the server is known to be away, it answers 0."""
        client = self.client
        if client.server_info is None and wait > 0:
            client.wait_for_server(min(wait, early.deadline - time.monotonic()))
        info = client.server_info
        if info is None and not client.known_away() and time.monotonic() < early.deadline:
            return None
        with self._lock:
            if self._lookups.get(request_id) is early:
                del self._lookups[request_id]
                self._start(
                    request_id,
                    info,
                    early.block_hashes,
                    early.token_ids,
                    early.defer,
                    early.groups,
                )
            entry = self._lookups.get(request_id)
        return entry if isinstance(entry, _Queued) else None

    def _lookup_sent(self, request_id: str, future: Future[Reply]) -> None:
        """A lookup of ``request_id`` went out (under the lock)."""
        looked = self._looked.get(request_id)
        if looked is None:
            looked = self._looked[request_id] = _Looked()
        looked.sent(future)

    def _submit(self, request_id: str, hashes: tuple[bytes, ...]) -> Future[Reply]:
        """Send one lookup (under the lock)."""
        lookup = Lookup(
            request=wire_request_id(request_id),
            model=self.model_name,
            world_size=self.world_size,
            chunk_hashes=hashes,
            tenant=self.tenant,
            engine=self.engine_id,
        )
        future = self.client.submit(lookup, timeout=self.timeout, fail_fast=True)
        self._lookup_sent(request_id, future)
        return future

    def flush_lookups(self) -> None:
        """Send the deferred lookups: one ``lookup_batch`` message (a ``lookup`` if only one;
        several batches beyond :data:`~kvtrio.protocol.MAX_LOOKUP_BATCH` lookups)."""
        with self._lock:
            queue, self._queue = self._queue, []
            queue = [(rid, queued) for rid, queued in queue if self._lookups.get(rid) is queued]
            if len(queue) == 1 or (queue and not self._batches):
                for request_id, queued in queue:
                    queued.batch = self._submit(request_id, queued.hashes)
                return
            if not queue:
                return
            for part in _batches(queue, self.world_size):  # within the server's bounds
                batch = LookupBatch(
                    model=self.model_name,
                    world_size=self.world_size,
                    requests=tuple(wire_request_id(request_id) for request_id, _ in part),
                    chunk_hashes=tuple(queued.hashes for _, queued in part),
                    tenant=self.tenant,
                    engine=self.engine_id,
                )
                future = self.client.submit(batch, timeout=self.timeout, fail_fast=True)
                for index, (request_id, queued) in enumerate(part):
                    queued.batch = future
                    queued.index = index
                    self._lookup_sent(request_id, future)

    def check_lookup_result(self, request_id: str, *, wait: float = 0.0) -> int | None:
        """Matched tokens of the lookup, or None while it is pending (0 if it failed); waits
        up to ``wait`` seconds for a pending one (sending the deferred ones first). A hit that
        includes the prompt's partial chunk reaches its last whole block.

        Without a wait it still makes progress: replies that arrived are received here, in the
        calling thread (a busy scheduler thread never waits for another thread to get the GIL).
        """
        with self._lock:
            entry = self._lookups.get(request_id)
        if isinstance(entry, _Early):
            started = time.monotonic()
            entry = self._after_hello(request_id, entry, wait)
            wait = max(0.0, wait - (time.monotonic() - started)) if wait > 0 else 0.0
        if entry is None:
            return None
        if entry.batch is None:
            if wait <= 0:
                return None  # (deferred: not sent yet, no answer possible)
            self.flush_lookups()
            if entry.batch is None:  # pragma: no cover - flush sends every queued lookup
                return None
        future = entry.batch
        if not future.done():
            if wait > 0:
                with contextlib.suppress(concurrent.futures.TimeoutError):
                    future.exception(timeout=wait)  # receives in this thread
            else:
                self.client.poll()
            if not future.done():
                return None
        try:
            reply = future.result()
        except ServerError as exc:
            if entry.index >= 0 and exc.code is ErrorCode.UNKNOWN_OPERATION:
                self._unbatched(request_id, entry)  # an older server: sent alone now
                return None
            log.debug("lookup of %s failed: %s", request_id, exc)
            return 0
        except KvtrioError as exc:
            log.debug("lookup of %s failed: %s", request_id, exc)
            return 0
        if type(reply) is LookupBatchReply:
            for failure in reply.failed:
                if failure.index == entry.index:
                    log.debug("lookup of %s failed: %s", request_id, failure.message)
                    return 0
            hit_tokens = reply.hit_tokens[entry.index]
            l1 = reply.l1_chunks[entry.index] if entry.index < len(reply.l1_chunks) else -1
        else:
            assert isinstance(reply, LookupReply)
            hit_tokens, l1 = reply.hit_tokens, reply.l1_chunks
        hit_chunks = hit_tokens // entry.chunks.chunk_size
        if hit_chunks == 0:  # nothing pinned, no load started
            self._settled(request_id, entry)
        # (A server older than ``l1_chunks`` does not say: the whole hit counts as L1.)
        entry.l1_tokens = entry.chunks.covered(hit_chunks if l1 < 0 else min(l1, hit_chunks))
        return entry.chunks.covered(hit_chunks)

    def _settled(self, request_id: str, entry: _Queued) -> None:
        """``entry``, the request's lookup, left nothing held at the server (if it is still
        the request's lookup)."""
        with self._lock:
            looked = self._looked.get(request_id)
            if looked is not None and self._lookups.get(request_id) is entry:
                looked.settled()

    def lookup_l1_tokens(self, request_id: str) -> int | None:
        """Of the hit :meth:`check_lookup_result` answered for ``request_id``, the leading
        tokens that were in the server's L1 (the rest come from its L2 backends); None before
        that answer or after :meth:`cleanup_lookup_result`."""
        with self._lock:
            entry = self._lookups.get(request_id)
        return entry.l1_tokens if isinstance(entry, _Queued) else None

    def _unbatched(self, request_id: str, queued: _Queued) -> None:
        """The server has no ``lookup_batch``: send this lookup alone (and no more batches)."""
        with self._lock:
            self._batches = False
            if self._lookups.get(request_id) is queued:
                queued.index = -1
                queued.batch = self._submit(request_id, queued.hashes)

    def cleanup_lookup_result(self, request_id: str) -> None:
        """Forget the local result of ``request_id``'s lookup (its pins stay for the retrieve)."""
        with self._lock:
            self._lookups.pop(request_id, None)

    def free_lookup_locks(self, request_id: str) -> None:
        """Release the pins of ``request_id``'s lookup without ending it (no load will come)."""
        wire = wire_request_id(request_id)
        self._send(FreeLookupLocks(wire, self.model_name, self.tenant, self.engine_id))
        with self._lock:
            looked = self._looked.get(request_id)
            if looked is not None:  # (the server reads the release after the lookup's answer)
                looked.settled()

    def end_session(self, request_id: str) -> None:
        """The engine request is finished or aborted: release everything it holds at the
        server. (The name is the wire operation's: it ends an engine request, not a session.)
        No message when the server is known to hold nothing for it: no lookup of it went out,
        or its one lookup answered a miss or had its pins freed (a message less per request
        for most requests: misses, and hits vLLM's own cache already had)."""
        with self._lock:
            self._lookups.pop(request_id, None)
            looked = self._looked.pop(request_id, None)
        if looked is None or looked.quiet:
            return
        wire = wire_request_id(request_id)
        self._send(EndSession(wire, self.model_name, self.tenant, self.engine_id))

    def _send(self, request: EndSession | FreeLookupLocks) -> None:
        """Send without waiting for the answer. No done callback: a pending future with one
        makes the client's background thread receive, and take the GIL from a busy scheduler
        thread; the answers are received by whoever drains the socket next, and looked at
        (failures logged) at the next call here."""
        future = self.client.submit(request, timeout=self.timeout, fail_fast=True)
        with self._lock:
            sent = self._sent
            sent.append((request, future))
            while sent and sent[0][1].done():  # (answered in order, per connection)
                done, answered = sent.popleft()
                error = None if answered.cancelled() else answered.exception()
                if error is not None:
                    log.debug("%s of %s failed: %s", done.op, done.request, error)

    def close(self) -> None:
        if self._own_client:
            self.client.close()
