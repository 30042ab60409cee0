"""How a worker adapter's stores and retrieves move bytes: the copy path and what it works on.

A :class:`WorkerCopies` is chosen once, when the engine registers its KV tensors
(:meth:`~kvtrio.client.WorkerAdapter.register_kv_caches`), and every store and retrieve of
the adapter runs on it, in the adapter's transfer thread:

* :class:`~._arena_worker.ArenaCopies` (CPU tensors): the worker copies between its tensors
  and L1 slots of the shared arena, with a :class:`kvtrio.transfer.Transfer` engine, pipelined
  with the protocol (stores in growing batches, one commit; partial retrieves);
* :class:`~._cuda_worker.CudaCopies` (CUDA tensors): the server copies over CUDA IPC; the
  worker hands it the engine's blocks and event and waits for the server's event.

:class:`Span` is an operation as both see it: the chunks of a token range (the last one may be
the prompt's partial chunk, or a chunk only partly loaded), their hashes and engine blocks. The
helpers below are shared by both paths.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from typing import Any, Protocol, TypeVar

import attrs

from ..errors import KvtrioError, NotRegistered, ProtocolError
from ..protocol import (
    MAX_EVENT_TOKENS,
    CudaCache,
    Registered,
    Reply,
    Retrieve,
    RetrieveReply,
    Store,
    StoreReply,
    pack_tokens,
    wire_request_id,
)
from ..transfer import KVLayout
from ._failures import Failures

__all__ = [
    "BATCH_BYTES",
    "EventGroup",
    "LoadStoreOp",
    "Retrieved",
    "Span",
    "WorkerCopies",
    "count_failed_slots",
    "failure_cause",
    "reply_of",
    "when_all",
]

BATCH_BYTES = 32 << 20
"""Chunk bytes per request of a split store or retrieve (at least one chunk)."""

_R = TypeVar("_R", bound=Reply)


def _ints(values: Iterable[int]) -> tuple[int, ...]:
    return tuple(int(v) for v in values)


@attrs.frozen
class LoadStoreOp:
    """One store or retrieve of a request (vLLM's LMCache adapter ``LoadStoreOp``).

    ``block_ids`` are the request's engine blocks from its first token on; ``[start, end)`` is
    the token range to move, in whole blocks (``start`` a multiple of the chunk size). Give the
    prompt as ``token_ids`` or ``block_hashes`` (hash mode). A store moves the full chunks of
    the prompt's first ``end`` tokens and then, as its *partial chunk*, the whole blocks after
    them. A retrieve names the chunks from the whole prompt, as its lookup did (the partial
    chunk of the prompt's whole blocks after its full chunks), writes only the blocks before
    ``end`` (the last chunk may be loaded in part), and leaves the first
    ``skip_first_n_tokens`` tokens of the range alone (a whole number of blocks): the engine
    has them already, in blocks other requests may be reading.
    """

    block_ids: tuple[int, ...] = attrs.field(converter=_ints)
    token_ids: Sequence[int] | None = None
    block_hashes: Sequence[bytes | int] | None = None
    start: int = 0
    end: int = 0
    skip_first_n_tokens: int = 0
    event_hashes: Sequence[bytes | int] | None = None
    """The engine's block hashes as its KV events name them (vLLM:
    ``maybe_convert_block_hash``) of the blocks from ``start`` (block ``start // block_size``)
    to ``end``, sent with the store (or the load's retrieves) so that the server's KV events
    name the chunks as the engine does (``docs/events.md``)."""
    event_extra_keys: Sequence[tuple[Any, ...] | None] | None = None
    """The extra keys of the same blocks as vLLM's KV events publish them (LoRA name,
    multimodal identifiers, the cache salt on the prompt's first block), one entry per block of
    ``event_hashes``; None when no block has any."""
    lora_name: str = ""
    """The request's LoRA adapter (``""``: none), for the KV events."""
    group: EventGroup | None = None
    """The KV cache group whose blocks a hybrid engine's store moves, for the KV events (None:
    the engine has one group)."""


@attrs.frozen
class EventGroup:
    """A KV cache group as vLLM's KV events name it (``BlockStored.group_idx``,
    ``kv_cache_spec_kind``, ``kv_cache_spec_sliding_window``): an engine with several groups
    stores each group's blocks under the same block hashes, told apart by these."""

    index: int
    spec_kind: str
    sliding_window: int = 0
    """The group's sliding window in tokens (0: not a sliding window)."""

    def fields(self) -> dict[str, Any]:
        """The store's fields (:class:`~kvtrio.protocol.Store`) naming this group."""
        return {
            "group_idx": self.index,
            "kv_cache_spec_kind": self.spec_kind,
            "kv_cache_spec_sliding_window": self.sliding_window,
        }


@attrs.frozen
class Span:
    """The chunks of one store or retrieve: chunk ``first + i`` has ``hashes[i]``.

    Every chunk has the full chunk's format in its slot; the engine blocks moved are those
    before ``stop_block``: the last chunk may hold fewer (the prompt's partial chunk: its
    blocks first, zeros after) or be loaded only in part (the engine computes the rest)."""

    request_id: str
    first: int
    hashes: tuple[bytes, ...]
    parent: bytes
    """The hash of chunk ``first - 1`` (empty for the prompt's first chunk)."""
    chunk_size: int
    chunk_bytes: int
    blocks_per_chunk: int
    block_ids: Sequence[int]
    """The engine blocks of the request from its first token on."""
    stop_block: int = 1 << 62
    """Blocks from this one on (an index in the prompt) are not moved."""
    partial: bool = False
    """The last chunk is the prompt's partial chunk."""
    event_hashes: Sequence[bytes | int] = ()
    """The engine's block hashes as its KV events name them, from block ``event_first`` on
    (stores)."""
    event_first: int = 0
    """The block (an index in the prompt) that ``event_hashes`` start at."""
    event_extra_keys: Sequence[tuple[Any, ...] | None] = ()
    """The extra keys of the blocks of ``event_hashes`` (one entry each), or none."""
    lora_name: str = ""
    """The request's LoRA adapter, or ``""``."""
    prompt_tokens: Sequence[int] = ()
    """Stores: the prompt's tokens from its first (sent with each store's range, for the KV
    events' routers)."""
    group: EventGroup | None = None
    """Stores: the KV cache group of a hybrid engine's blocks, for the KV events."""

    def blocks(self, chunk: int) -> Sequence[int]:
        """The engine blocks of chunk ``chunk`` (an index in the prompt) that are moved."""
        per = self.blocks_per_chunk
        return self.block_ids[chunk * per : min((chunk + 1) * per, self.stop_block)]

    def batches(self, limit: int = BATCH_BYTES) -> list[range]:
        """Consecutive ranges of ``range(len(hashes))``: 1 chunk, then doubling, at most
        ``limit`` bytes of chunks each (but at least one chunk). The first reply comes back
        soonest; the later ones are answered while the earlier batches copy."""
        cap = max(1, limit // max(1, self.chunk_bytes))
        batches, start, size = [], 0, 1
        while start < len(self.hashes):
            end = min(len(self.hashes), start + size)
            batches.append(range(start, end))
            start, size = end, min(cap, size * 2)
        return batches

    def tokens(self, batch: range) -> tuple[int, int]:
        """The token range ``[start, end)`` of a batch."""
        return (self.first + batch.start) * self.chunk_size, (
            self.first + batch.stop
        ) * self.chunk_size

    @property
    def chunks(self) -> int:
        return len(self.hashes)

    @property
    def wire_id(self) -> str:
        """The request's id in messages (:func:`~kvtrio.protocol.wire_request_id`)."""
        return wire_request_id(self.request_id)

    def store(self, batch: range | None = None, **fields: Any) -> Store:
        """The store of a batch of chunks (indices into ``hashes``; all of them if None),
        linked to the chunk before it."""
        batch = range(self.chunks) if batch is None else batch
        per = self.blocks_per_chunk
        first = (self.first + batch.start) * per
        stop = min((self.first + batch.stop) * per, self.stop_block)
        for name, value in self._names(first, stop).items():
            fields.setdefault(name, value)
        if self.group is not None:
            for name, value in self.group.fields().items():
                fields.setdefault(name, value)
        return Store(
            self.wire_id,
            *self.tokens(batch),
            self.hashes[batch.start : batch.stop],
            parent_hash=self.hashes[batch.start - 1] if batch.start else self.parent,
            **fields,
        )

    def _names(self, first: int, stop: int) -> dict[str, Any]:
        """What names blocks ``[first, stop)`` (indices in the prompt) for the KV events: their
        engine block hashes, tokens and extra keys, and the LoRA adapter, those the operation
        has."""
        names: dict[str, Any] = {}
        if self.event_hashes and first >= self.event_first:
            hashes = self.event_hashes[first - self.event_first : stop - self.event_first]
            names["block_hashes"] = tuple(hashes)
            extra = self.event_extra_keys[first - self.event_first : stop - self.event_first]
            if len(extra) == len(hashes) and any(keys is not None for keys in extra):
                names["extra_keys"] = tuple(extra)
        if self.lora_name:
            names["lora_name"] = self.lora_name
        block = self.chunk_size // self.blocks_per_chunk
        if len(self.prompt_tokens) >= stop * block and (stop - first) * block <= MAX_EVENT_TOKENS:
            names["token_ids"] = pack_tokens(self.prompt_tokens[first * block : stop * block])
        return names

    def retrieve(self, start: int, **fields: Any) -> Retrieve:
        """A partial retrieve of chunks ``start …`` (indices into ``hashes``) to the end, with
        their names for the KV events (a chunk an earlier server left in L2 is known by its
        chunk hash alone until then)."""
        per = self.blocks_per_chunk
        first = (self.first + start) * per
        stop = min((self.first + self.chunks) * per, self.stop_block)
        for name, value in self._names(first, stop).items():
            fields.setdefault(name, value)
        return Retrieve(
            self.wire_id,
            (self.first + start) * self.chunk_size,
            (self.first + self.chunks) * self.chunk_size,
            self.hashes[start:],
            partial=True,
            **fields,
        )

    def loading(self, reply: RetrieveReply) -> int | None:
        """The index of the first chunk a partial retrieve's reply says is still loading."""
        loading = [s.chunk for s in reply.slots if s.status == "loading"]
        return min(loading) - self.first if loading else None

    def hashes_of(self, slots: Sequence[Any], status: str) -> tuple[bytes, ...]:
        """The chunk hashes of the slots with ``status``."""
        return tuple(self.hashes[s.chunk - self.first] for s in slots if s.status == status)


@attrs.define
class Retrieved:
    """What a retrieve loaded: chunk indices (in the prompt), and the causes of the chunks
    whose batch the server refused (the others not loaded are ``missing``)."""

    loaded: set[int] = attrs.field(factory=set)
    causes: dict[int, str] = attrs.field(factory=dict)


class WorkerCopies(Protocol):
    """How one worker adapter's operations move bytes (see the module docstring).

    Every method but :meth:`engine_event` runs in the adapter's transfer thread, one call at
    a time. Failures of single chunks or batches are counted in the adapter's
    :class:`~._failures.Failures`; the methods raise only for a failure of the whole
    operation (a :class:`~kvtrio.errors.KvtrioError` of its one request, ``ValueError`` for
    arguments it cannot serve), which the adapter counts.
    """

    layout: KVLayout
    device: str
    """The ``device`` of the ``register`` message: ``cpu`` or ``cuda``."""
    cuda: CudaCache | None
    """The ``cuda`` field of the ``register`` message (CUDA IPC exports), if any."""

    def engine_event(self) -> bytes:
        """At submission, in the engine's thread: an IPC event recorded on the engine's
        current stream, for the server's copies to wait for (empty if there is none)."""
        ...

    def attach(self, registered: Registered) -> None:
        """Make ready what the registration's operations use (map the arena it names);
        ``OSError`` saying why it cannot."""
        ...

    def close(self) -> None:
        """Release what :meth:`attach` made ready (at shutdown)."""
        ...

    def store(self, span: Span, event: bytes) -> list[Future[Reply]]:
        """Store the span's chunks in L1; the requests still to be answered (the commit),
        which the caller does not wait for in the transfer thread."""
        ...

    def retrieve(self, span: Span, keep_before: int, event: bytes) -> Retrieved:
        """Copy the chunks the server has into the engine's blocks, leaving the tokens before
        ``keep_before`` alone; which chunks were loaded, and why the others were not (the
        chunks the server did not answer). Raises for a failure of the whole operation: then
        none counts as loaded."""
        ...


def failure_cause(exc: BaseException) -> str:
    """The ``store_failures`` / ``retrieve_failures`` cause of a failed request."""
    if isinstance(exc, NotRegistered):
        return "not_registered"
    if isinstance(exc, KvtrioError):
        return "server"
    return "internal"


def reply_of(future: Future[Reply], reply_type: type[_R]) -> _R:
    """The reply a future settled with, checked against ``reply_type`` (raises what it
    raised)."""
    reply = future.result()
    if not isinstance(reply, reply_type):  # pragma: no cover - decode_reply guarantees it
        raise ProtocolError(f"expected {reply_type.__name__}, got {type(reply).__name__}")
    return reply


def when_all(futures: Sequence[Future[Reply]], then: Callable[[], None]) -> None:
    """Call ``then`` once every future is done (at once if there are none; else in the
    thread that settles the last one)."""
    left = [len(futures)]
    lock = threading.Lock()

    def one_done(_: Future[Reply]) -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            then()

    if not futures:
        then()
    for future in futures:
        future.add_done_callback(one_done)


def count_failed_slots(failures: Failures, request_id: str, reply: StoreReply) -> None:
    """Count the chunks a store's reply says there is no room for."""
    failed = sum(1 for slot in reply.slots if slot.status == "failed")
    if failed:
        failures.store(request_id, "no_room", failed, "L1 full of pinned chunks")
