"""Messages of the cache operations: lookup, store/commit, retrieve/release, ends.

Who sends what (vLLM kv_offload style, interfaces split by caller):

* the engine's **scheduler**: ``lookup``, ``free_lookup_locks``, ``end_session``;
* each **worker** (one per rank): ``register`` / ``unregister`` its KV cache
  (:mod:`._registration`), then ``store`` + ``commit`` and ``retrieve`` + ``release``.

CPU workers copy the bytes themselves: ``store`` answers with arena slots to write, ``commit``
makes them visible; ``retrieve`` answers with pinned slots to read, ``release`` unpins them.
CUDA workers register their KV tensors by CUDA IPC (:class:`CudaCache`) and the server copies:
``store`` and ``retrieve`` carry the engine blocks and an interprocess event, the reply carries
the server's event, which completes when the bytes are in place (no commit or release).
"""

from __future__ import annotations

from typing import ClassVar

from attrs import field, frozen

from ._events import ExtraKeys
from ._messages import Reply, Request
from ._registration import Register, Released, Unregister

__all__ = [
    "CACHE_REQUEST_TYPES",
    "MAX_HASHES",
    "MAX_LOOKUP_BATCH",
    "MAX_LOOKUP_KEYS",
    "MAX_WORLD_SIZE",
    "Commit",
    "CommitReply",
    "EndSession",
    "FreeLookupLocks",
    "Lookup",
    "LookupBatch",
    "LookupBatchReply",
    "LookupFailure",
    "LookupReply",
    "Release",
    "Retrieve",
    "RetrieveReply",
    "Slot",
    "Store",
    "StoreReply",
]

IntTuple = tuple[int, ...]
BytesTuple = tuple[bytes, ...]

# --------------------------------------------------------------------------- bounds (issue 22)
# What one message may ask of the server, known before any of its work starts: the server runs
# a message's work in its event loop, so these bound how long one message can keep it from
# everyone else (docs/design.md, "Bounded work per message").

MAX_WORLD_SIZE = 256
"""The largest ``world_size`` of a registration or lookup: every lookup makes one key per rank
and chunk, so the world size multiplies its work. Real engines shard a model's KV cache over
TP × PP ranks of one engine: 8 × 8 on a large node group, a few hundred at most (data parallel
replicas are engines of their own)."""

MAX_HASHES = 8192
"""The most chunk hashes one array of a message may carry (a lookup's, a store's, a commit's
``written`` and ``failed`` each, a release's, a retrieve's): a 2M-token prompt at the default
256-token chunks (a 1M-token prompt is 4,096). A longer range goes as several messages."""

MAX_LOOKUP_KEYS = 1 << 16
"""The most object keys one ``lookup`` or ``lookup_batch`` may name: ``world_size`` times its
chunk hashes, summed over a batch's lookups (a 1M-token prompt at world size 16). Beyond it the
message is refused (``bad_request``) before any of its work starts."""


# --------------------------------------------------------------------------- lookup


@frozen
class LookupReply(Reply):
    """The hit: ``hit_chunks`` leading chunks (``hit_tokens`` tokens) every rank has, of which
    the first ``l1_chunks`` were in L1 at the lookup (the rest come from L2, loaded into L1
    in the background). ``l1_chunks`` -1: not said (a server older than the field). It is a
    hint for the engine's load policy, left out of equality: the same hit compares equal
    whatever its tiers were."""

    hit_tokens: int
    hit_chunks: int
    l1_chunks: int = field(default=-1, eq=False)


@frozen
class Lookup(Request):
    """How many leading chunks of this prompt does the cache hold for every rank?

    ``chunk_hashes`` are the prompt's chunk hashes (16 bytes each, computed by the client, see
    ``kvtrio.protocol._hashes``); the server adds the namespace of the engine's registration. The
    hit chunks are pinned for the request ``(engine, model, tenant, request)``: ``num_readers``
    pins per object (0: one per rank's object, or ``world_size`` when all ranks share one
    object, as with MLA). A new lookup of the same request replaces the previous one's pins.
    """

    op: ClassVar[str] = "lookup"
    reply_type: ClassVar[type[Reply]] = LookupReply

    request: str
    model: str
    world_size: int
    chunk_hashes: BytesTuple = ()
    num_readers: int = 0
    tenant: str = ""
    engine: str = ""


@frozen
class LookupFailure:
    """Why one lookup of a :class:`LookupBatch` failed (an error code, as in error replies)."""

    index: int
    code: str
    message: str


@frozen
class LookupBatchReply(Reply):
    """The answers to a :class:`LookupBatch`, in its order (a failed lookup has 0 hits and an
    entry in ``failed``)."""

    hit_tokens: IntTuple
    hit_chunks: IntTuple
    failed: tuple[LookupFailure, ...] = ()
    l1_chunks: IntTuple = field(default=(), eq=False)
    """Each lookup's ``l1_chunks`` (as in :class:`LookupReply`; empty: not said)."""


MAX_LOOKUP_BATCH = 1024
"""The most lookups one :class:`LookupBatch` may carry: the server runs a batch's lookups in
one go, so a bound keeps one client from holding the event loop (a larger burst goes as several
batches)."""


@frozen
class LookupBatch(Request):
    """Several lookups of one engine's scheduler in one message: lookup ``i`` is that of
    request ``requests[i]`` with ``chunk_hashes[i]``; every other field is shared. Each is
    handled as its own :class:`Lookup` would be, in order; one reply answers them all.
    """

    op: ClassVar[str] = "lookup_batch"
    reply_type: ClassVar[type[Reply]] = LookupBatchReply

    model: str
    world_size: int
    requests: tuple[str, ...]
    chunk_hashes: tuple[BytesTuple, ...]
    num_readers: int = 0
    tenant: str = ""
    engine: str = ""

    def lookups(self) -> list[Lookup]:
        """The lookups of the batch (``ValueError`` if its arrays differ in length, a request
        id repeats, or it carries more than :data:`MAX_LOOKUP_BATCH`). A lookup's hashes are
        not checked here: each lookup's own are checked where it is handled, so one bad lookup
        fails alone."""
        if len(self.requests) != len(self.chunk_hashes):
            raise ValueError(
                f"{len(self.requests)} requests but {len(self.chunk_hashes)} chunk hash lists"
            )
        if len(set(self.requests)) != len(self.requests):
            raise ValueError(
                "a request id appears twice (each lookup replaces its request's previous one: "
                "send one lookup per request)"
            )
        if len(self.requests) > MAX_LOOKUP_BATCH:
            raise ValueError(
                f"{len(self.requests)} lookups in one batch, at most {MAX_LOOKUP_BATCH}: "
                "send the rest in another batch"
            )
        return [
            Lookup(
                request,
                self.model,
                self.world_size,
                hashes,
                self.num_readers,
                self.tenant,
                self.engine,
            )
            for request, hashes in zip(self.requests, self.chunk_hashes, strict=True)
        ]


# --------------------------------------------------------------------------- store / retrieve


@frozen
class Slot:
    """What to do for one chunk of a store or retrieve."""

    chunk: int
    """Chunk index in the prompt (token ``chunk * chunk_size`` onward)."""
    status: str
    """store: ``write`` (copy into the slot, then commit), ``present`` (already cached),
    ``busy`` (someone else is writing it), ``failed`` (no room); retrieve: ``read`` (copy out of
    the slot, then release), ``failed`` (recompute it) or, answering a ``partial`` retrieve,
    ``loading`` (still coming from L2: retrieve it again)."""
    offset: int = 0
    nbytes: int = 0


@frozen
class StoreReply(Reply):
    slots: tuple[Slot, ...]
    expires_in: float
    """Seconds left to write the ``write`` slots and commit them."""
    done_event: bytes = b""
    """CUDA workers: IPC handle of the server's event; the ``write`` chunks are copied out of
    the engine when it has completed (the server commits them itself)."""


@frozen
class Store(Request):
    """Reserve L1 slots for the full chunks of tokens ``[start, end)`` of a request.

    ``start`` is a multiple of the chunk size; ``end`` is rounded down to one. ``chunk_hashes``
    are the hashes of exactly those chunks (16 bytes each, computed by the client from the
    prompt); the server keeps no prompts. ``block_ids``: the engine blocks (CUDA workers only).
    ``event`` (CUDA workers, optional) is the IPC handle of an interprocess event the engine
    recorded after the forward step that wrote those blocks; the server's copy waits for it.
    ``parent_hash`` (optional) is the hash of the chunk before ``start`` (empty for the
    prompt's first chunk, or unknown): it links the range's first chunk to its prefix for the
    prefix-aware eviction policies, as the chunks inside the range are linked.
    ``block_hashes`` (optional): the range's engine block hashes for KV events (events.md).
    The other optional fields name the range's blocks for the KV events' routers, as vLLM's
    ``BlockStored`` does: ``token_ids`` the range's tokens as unsigned 32-bit little-endian
    integers (``pack_tokens``; ``end - start`` of them, or the tokens of ``block_hashes``'
    blocks), ``extra_keys`` one entry per block (or per chunk in
    token mode; ``()`` when none), ``lora_name`` (``""``: none), ``group_idx`` (-1: none),
    ``kv_cache_spec_kind`` and ``kv_cache_spec_sliding_window`` (``""`` and 0: none).
    """

    op: ClassVar[str] = "store"
    reply_type: ClassVar[type[Reply]] = StoreReply

    request: str
    start: int
    end: int
    chunk_hashes: BytesTuple = ()
    block_ids: IntTuple = ()
    event: bytes = b""
    parent_hash: bytes = b""
    block_hashes: tuple[int | bytes, ...] = ()
    token_ids: bytes = b""
    extra_keys: ExtraKeys = ()
    lora_name: str = ""
    group_idx: int = -1
    kv_cache_spec_kind: str = ""
    kv_cache_spec_sliding_window: int = 0


@frozen
class CommitReply(Reply):
    committed: int
    rejected: BytesTuple = field(factory=tuple)
    """Chunk hashes whose reservation had expired (or never existed): not stored."""


@frozen
class Commit(Request):
    """After a store: ``written`` chunks become visible, ``failed`` ones are dropped.

    Both name chunks by their chunk hashes (as sent in the store)."""

    op: ClassVar[str] = "commit"
    reply_type: ClassVar[type[Reply]] = CommitReply

    request: str
    written: BytesTuple = ()
    failed: BytesTuple = ()


@frozen
class RetrieveReply(Reply):
    slots: tuple[Slot, ...]
    done_event: bytes = b""
    """CUDA workers: IPC handle of the server's event; the ``read`` chunks are in the engine's
    blocks when it has completed (the server releases them itself)."""


@frozen
class Retrieve(Request):
    """Pinned slots of the full chunks of tokens ``[start, end)``; same fields as Store.

    Consumes the pins this rank's share of the request's lookup took. CUDA workers may give
    block id -1 for blocks the engine already has: those are left alone. A ``partial``
    retrieve does not wait for every L2 load of its chunks: only for its first chunk's; the
    chunks from the first one still loading on are answered ``loading`` (not pinned, their
    lookup pins kept), to be retrieved again while the ready ones are copied. The optional
    ``block_hashes``, ``token_ids``, ``extra_keys`` and ``lora_name`` name the chunks for KV
    events as a store's do: a chunk found in L2 by its chunk hash alone (stored before a
    restart) is announced under them.
    """

    op: ClassVar[str] = "retrieve"
    reply_type: ClassVar[type[Reply]] = RetrieveReply

    request: str
    start: int
    end: int
    chunk_hashes: BytesTuple = ()
    block_ids: IntTuple = ()
    event: bytes = b""
    partial: bool = False
    block_hashes: tuple[int | bytes, ...] = ()
    token_ids: bytes = b""
    extra_keys: ExtraKeys = ()
    lora_name: str = ""


@frozen
class Release(Request):
    """After a retrieve: the worker is done reading these chunks (named by chunk hash)."""

    op: ClassVar[str] = "release"
    reply_type: ClassVar[type[Reply]] = Released

    request: str
    chunk_hashes: BytesTuple = ()


# --------------------------------------------------------------------------- request ends


@frozen
class FreeLookupLocks(Request):
    """Release every pin the request's lookups still hold."""

    op: ClassVar[str] = "free_lookup_locks"
    reply_type: ClassVar[type[Reply]] = Released

    request: str
    model: str
    tenant: str = ""
    engine: str = ""


@frozen
class EndSession(Request):
    """The engine is done with the request: release its lookup pins and cancel its loads."""

    op: ClassVar[str] = "end_session"
    reply_type: ClassVar[type[Reply]] = Released

    request: str
    model: str
    tenant: str = ""
    engine: str = ""


CACHE_REQUEST_TYPES: tuple[type[Request], ...] = (
    Register,
    Unregister,
    Lookup,
    LookupBatch,
    Store,
    Commit,
    Retrieve,
    Release,
    FreeLookupLocks,
    EndSession,
)
