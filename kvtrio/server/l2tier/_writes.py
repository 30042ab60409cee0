"""Write-behind: committed L1 chunks go to every backend, a batch at a time, off the request path.

A committed chunk is queued (bounded channel) to flusher tasks that frame it and store it in
every usable backend (with its L1 parent, to a backend that ``accepts_parents``, and its
tenant's tag, to one that ``accepts_owners``); while queued or being written it is pinned in L1.
A full queue, in chunks or in bytes, skips the chunk and counts it: never an unbounded queue.

**Tenants share the queue fairly.** Once the queue is half full (in chunks or in bytes), a
tenant that already holds its share of it (``1 / tenants``, counting the tenants the server has
L1 arenas for and any that queued chunks) is skipped, so one tenant's commit flood cannot take
the room another tenant's chunks need; below half, any tenant may use the room.

**A chunk not written is written again when it is used again.** A chunk skipped (queue full, its
tenant over its share) or whose store did not reach every backend (backed off, failed, refused)
is remembered (at most :data:`_UNWRITTEN` chunks, the oldest forgotten) and queued again when a
store finds it already in L1 or a lookup hits it there (:meth:`WriteBehind.rewrite`). Without
this a hot prefix that stays in L1 through an L2 outage is never written: in a fleet, the other
servers would miss it for as long as this one keeps it (found by ``tests/fleet``: a killed
primary, a prefix used by every request, never a hit on the other server again).

**Admission** (``_admission``; ``--l2-admission``). With ``reuse`` a committed chunk is
queued only if it is likely to be read again; a refused one is queued when it is used again
while still in L1 (:meth:`WriteBehind.rewrite`, with its refused ancestors first). A refused
chunk gets no write-through event: nothing is written for it.

**Write-through.** A chunk queued with ``wait`` gets an event, set once its batch's stores
ended (written, refused or failed): the commit that queued it waits on it (bounded by
``--l2-write-through``), so that once a store is finished here its chunks are already in the
shared L2 for the other servers of a fleet (docs/fleet.md).
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Callable, Iterable, Sequence

import trio

from ...l2 import MAX_NAMES, header
from ...shm import SharedArena
from ...storage import L1Cache
from ._admission import Admission
from ._backends import Calls, NamesRecord, TierBackend

__all__ = ["WriteBehind", "owner_tag"]

CPU_THREADS = 2
"""Checksums of chunks (xxh3, ~7 GB/s) run in worker threads, two at a time per server (its
stores and loads share one limiter, the tier's)."""
_BATCH_CHUNKS = 32
_BATCH_BYTES = 64 << 20
"""A flusher writes at most this many queued chunks (or about this many bytes) per backend call:
one thread hop for the frames and one store per backend for many small chunks."""
_UNWRITTEN = 16384
"""Chunks not written to every backend that are remembered, to be queued again when used."""


Queued = tuple[bytes, bytes, str, trio.Event | None]
"""A queued chunk: (object key, fingerprint, tenant, the event a write-through waits on)."""


def owner_tag(tenant: str) -> bytes:
    """The 16-byte tag a backend that ``accepts_owners`` keeps for ``tenant``'s objects."""
    return hashlib.sha256(b"kvtrio tenant\0" + tenant.encode()).digest()[:16]


class WriteBehind:
    """The write-behind queue of one tier and its flushers."""

    def __init__(
        self,
        backends: Sequence[TierBackend],
        l1: L1Cache,
        arena: SharedArena,
        calls: Calls,
        *,
        queue_size: int,
        flushers: int,
        tenants: Callable[[], int] = lambda: 1,
        write_through: bool = False,
        admission: str = "all",
        cpu: trio.CapacityLimiter | None = None,
    ) -> None:
        """``cpu``: the tier's limiter of checksum threads (:data:`CPU_THREADS`);
        ``tenants`` says how many tenants the server serves now (its L1 arenas');
        ``write_through``: every chunk queued gets an event (see the module docstring);
        ``admission``: ``all`` or ``reuse`` (see ``_admission``)."""
        self.backends = backends
        self._cpu = cpu if cpu is not None else trio.CapacityLimiter(CPU_THREADS)
        self._tenant_count = tenants
        self.l1 = l1
        self.arena = arena
        self._calls = calls
        self._flushers = flushers
        self.queue_size = queue_size
        self._send, self._receive = trio.open_memory_channel[Queued](queue_size)
        self.queued = 0
        """Chunks in the queue (not yet taken by a flusher)."""
        self._queued_bytes = 0
        self.max_queued_bytes = arena.size // 4
        """Bytes of L1 the queue may pin (a quarter of it): a long queue of large chunks must
        not starve L1 of evictable space."""
        self.skipped_stores = 0
        self.skipped_by_share = collections.Counter[str]()
        """Chunks skipped because their tenant held its share of a busy queue, per tenant."""
        self._tenants: dict[str, list[int]] = {}  # tenant → [chunks, bytes] queued now
        self.write_through = write_through
        self.unwritten: collections.OrderedDict[bytes, tuple[bytes, str]] = (
            collections.OrderedDict()
        )
        """Chunks not written to every backend: key → (fingerprint, tenant), oldest first."""
        self.rewrites = 0
        """Chunks queued again because they were used again (see the module docstring)."""
        self.admission = Admission[tuple[bytes, str]](admission)
        """Which committed chunks are written (``reuse``: those likely to be read again)."""

    def start(self, nursery: trio.Nursery) -> None:
        """Start the flushers in ``nursery`` (none without backends); they run until it is
        cancelled."""
        for _ in range(self._flushers if self.backends else 0):
            nursery.start_soon(self._flush, self._receive.clone())

    def commit(self, key: bytes, fingerprint: bytes, tenant: str = "") -> trio.Event | None:
        """``tenant``'s chunk ``key`` was committed to L1: queue it (:meth:`write_behind`) if
        admission admits it, else remember it until it is used again (:meth:`rewrite`). Never
        waits. Returns what :meth:`write_behind` returns (None where refused)."""
        if not self.backends:
            return None
        entry = self.l1.get(key)
        parent = None if entry is None else entry.parent
        admitted = self.admission.commit(key, parent, (fingerprint, tenant), trio.current_time())
        for older, (older_fingerprint, older_tenant) in self.admission.backlog():
            if self.l1.get(older) is not None:
                self.write_behind(older, older_fingerprint, older_tenant)
        return self.write_behind(key, fingerprint, tenant) if admitted else None

    def write_behind(self, key: bytes, fingerprint: bytes, tenant: str = "") -> trio.Event | None:
        """Queue ``tenant``'s committed L1 chunk for the backends (pinned until written); never
        waits. Skipped (and counted) when the queue is full, in chunks or in bytes, or when it
        is half full and the tenant holds its share of it (see the module docstring).

        Returns, with :attr:`write_through`, the event set once the chunk's stores ended (None
        where it was skipped, or without backends)."""
        if not self.backends:
            return None
        size = self._size(key)
        if self._queued_bytes + size > self.max_queued_bytes:
            self.skipped_stores += 1
            self._remember(key, fingerprint, tenant)
            return None
        mine = self._tenants.setdefault(tenant, [0, 0])
        if self._over_share(mine, size):
            self.skipped_stores += 1
            self.skipped_by_share[tenant] += 1
            self._remember(key, fingerprint, tenant)
            return None
        written = trio.Event() if self.write_through else None
        self.l1.pin(key)
        try:
            self._send.send_nowait((key, fingerprint, tenant, written))
        except trio.WouldBlock:
            self.l1.unpin(key)
            self.skipped_stores += 1
            self._remember(key, fingerprint, tenant)
            return None
        self.queued += 1
        self._queued_bytes += size
        mine[0] += 1
        mine[1] += size
        return written

    def rewrite(self, keys: Iterable[bytes]) -> None:
        """``keys`` are in L1 and used again (a store found them there, a lookup hit them), in
        prompt order: queue those admission refused (now proven reused, their refused
        ancestors first) and those that were not written to every backend. Never waits."""
        if self.admission.waiting:
            keys = list(keys)
            for key, (fingerprint, tenant) in self.admission.used(keys):
                if self.l1.get(key) is not None:
                    self.write_behind(key, fingerprint, tenant)
        if not self.unwritten:
            return
        for key in keys:
            remembered = self.unwritten.pop(key, None)
            if remembered is not None and self.l1.get(key) is not None:
                self.rewrites += 1
                self.write_behind(key, *remembered)

    def _remember(self, key: bytes, fingerprint: bytes, tenant: str) -> None:
        self.unwritten[key] = (fingerprint, tenant)
        self.unwritten.move_to_end(key)
        if len(self.unwritten) > _UNWRITTEN:
            self.unwritten.popitem(last=False)

    def _over_share(self, mine: list[int], size: int) -> bool:
        """Whether a tenant holding ``mine`` (chunks, bytes) may not add a chunk of ``size``:
        the queue is half full and the tenant would hold more than its share of it."""
        tenants = max(len(self._tenants), self._tenant_count())
        if tenants < 2:
            return False
        chunks, nbytes = self.queue_size, self.max_queued_bytes
        busy = self.queued * 2 >= chunks or self._queued_bytes * 2 >= nbytes
        return busy and ((mine[0] + 1) * tenants > chunks or (mine[1] + size) * tenants > nbytes)

    def _dequeued(self, item: Queued) -> int:
        """Count ``item`` out of the queue (no longer its tenant's); its size."""
        size = self._size(item[0])
        self.queued -= 1
        self._queued_bytes -= size
        mine = self._tenants.get(item[2])
        if mine is not None:
            mine[0] -= 1
            mine[1] -= size
        return size

    async def _flush(self, receive: trio.MemoryReceiveChannel[Queued]) -> None:
        """Write queued chunks to the backends, a batch at a time, until cancelled.

        A batch is the chunk received plus what is already queued (up to ``_BATCH_CHUNKS``
        chunks or ``_BATCH_BYTES``). Every chunk taken off the queue is unpinned exactly once,
        also when the store fails or the flusher is cancelled, and its write-through event is
        set then.
        """
        async for first in receive:
            batch = [first]
            try:
                nbytes = self._dequeued(first)
                while len(batch) < _BATCH_CHUNKS and nbytes < _BATCH_BYTES:
                    try:
                        item = receive.receive_nowait()
                    except (trio.WouldBlock, trio.EndOfChannel):
                        break
                    batch.append(item)  # (no checkpoint before the finally can see it)
                    nbytes += self._dequeued(item)
                await self._store_batch(batch)
            finally:
                for key, _, _, written in batch:
                    self.l1.unpin(key)
                    if written is not None:
                        written.set()

    def _size(self, key: bytes) -> int:
        entry = self.l1.get(key)
        return 0 if entry is None else entry.nbytes

    async def _store_batch(self, batch: Sequence[Queued]) -> None:
        """Frame the (pinned) chunks in one worker thread (and encode their names' records, for
        a backend that keeps names) and store them with one call per usable backend; count per
        key. Cancellation: the running store is cancelled."""
        keys: list[bytes] = []
        parents: list[bytes | None] = []
        fingerprints: list[bytes] = []
        owners: list[bytes] = []
        payloads: list[memoryview] = []
        tenants: list[str] = []
        for key, fingerprint, tenant, _ in batch:
            entry = self.l1.get(key)
            if entry is None:  # cannot happen while pinned; be safe
                continue
            keys.append(key)
            tenants.append(tenant)
            owners.append(owner_tag(tenant))
            parents.append(entry.parent)
            fingerprints.append(fingerprint)
            payloads.append(self.arena.memory(entry.offset, entry.nbytes))
        if not keys:
            return
        listener = self._calls.listener
        records = (
            [listener.names_of(key) for key in keys]
            if listener is not None and any(b.capabilities.names for b in self.backends)
            else None
        )
        heads, names = await trio.to_thread.run_sync(
            _headers, keys, fingerprints, payloads, records, limiter=self._cpu
        )
        buffers = [
            [memoryview(head), payload] for head, payload in zip(heads, payloads, strict=True)
        ]
        written = [True] * len(keys)
        for tier_backend in self.backends:
            if not tier_backend.usable(trio.current_time()):
                tier_backend.count("stores_skipped", len(keys))
                written = [False] * len(keys)
                continue
            with self._calls.call(tier_backend, "store", "store", heals=True) as call:
                results = await tier_backend.store(
                    keys, buffers, parents=parents, owners=owners, names=names
                )
            if call.failed:
                written = [False] * len(keys)
                continue
            for i, (key, ok, payload) in enumerate(zip(keys, results, payloads, strict=True)):
                tier_backend.count("stores" if ok else "stores_refused")
                tier_backend.count("store_bytes", payload.nbytes if ok else 0)
                written[i] = written[i] and ok
                if ok and listener is not None:
                    listener.stored(key, tier_backend.label)
        for key, fingerprint, tenant, ok in zip(keys, fingerprints, tenants, written, strict=True):
            if ok:
                self.unwritten.pop(key, None)
            else:
                self._remember(key, fingerprint, tenant)


def _headers(
    keys: Sequence[bytes],
    fingerprints: Sequence[bytes],
    payloads: Sequence[memoryview],
    records: Sequence[NamesRecord | None] | None,
) -> tuple[list[bytes], list[bytes | None] | None]:
    """The frame headers of a batch of chunks, and their names' records encoded where a
    backend keeps names (in a worker thread)."""
    heads = [header(k, f, p) for k, f, p in zip(keys, fingerprints, payloads, strict=True)]
    if records is None:
        return heads, None
    names = [None if r is None else r.encode() for r in records]
    return heads, [None if n is None or len(n) > MAX_NAMES else n for n in names]
