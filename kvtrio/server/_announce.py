"""What the server announces in its KV events, and when: chunks entering and leaving tiers.

:class:`Announcer` is told of every change (synchronously, from the L1 index and the L2 tier,
no I/O) and turns it into vLLM's events for the chunk's tenant, handed to ``publish`` (the
publisher's non-blocking queue, ``_events``):

* ``BlockStored`` when a chunk becomes readable in a tier: L1 (``CPU``) at its commit or at the
  end of its load from L2, never before (a failed or aborted write is never announced); an L2
  backend (its label, ``disk``) once its store answered true, or when a lookup finds it there
  (a chunk an earlier server stored);
* ``BlockRemoved`` when a readable chunk leaves L1 (evicted, or dropped as corrupt), or when the
  server learns it left an L2 backend (deleted as unreadable, or a lookup missed it there: a
  backend evicts on its own and tells no one);
* each tier once: a chunk in L1 and on disk was announced twice, once per ``medium``.

A chunk is named by the engine's block hashes its store carried (``Store.block_hashes``, kept
here while any tier holds the chunk), else by its kvtrio chunk hash as one block of
``chunk_size`` tokens. ``parent_block_hash`` is the last block hash of the chunk before it when
that is known. ``token_ids`` are empty: the server keeps no prompts (design rule), and a router
keys by block hashes; ``lora_*`` are left out (the block hashes of hash mode already include
the adapter). The table is what tiers hold: its size follows L1 and what L2 is known to hold,
within two bounds per tenant:

* **bytes**: a tenant's names take at most :data:`NAMES_BYTES` (an estimate of what Python
  holds for them: 64-byte hashes at ``block_size`` 1 are ~28 KiB a chunk). Beyond, the names
  of the stores waiting for their commit go first, then the chunks announced first: each is
  announced removed from every tier it was announced in (a router forgets it; it may still be
  a hit) and is named by its chunk hash if it is announced again.
* **nobody subscribes**: the server announces nothing to a tenant nobody subscribes to (the
  publisher's ``subscribed``, which stays true for :data:`~kvtrio.server._events.GRACE`
  seconds after the last subscriber left, so a reconnect or a late subscriber replays as
  usual), and keeps no names for it. When it stops announcing, it forgets the tenant's names
  and says so: ``AllBlocksCleared``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

from ..protocol import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

__all__ = ["MEDIUM_L1", "NAMES_BYTES", "Announcer", "ChunkNames"]

SPACE_BYTES = 16
"""An object key's namespace: its first 16 bytes (``storage.keys``)."""

MEDIUM_L1 = "CPU"
"""The ``medium`` of L1 (vLLM's name for host memory)."""

PENDING = 65536
"""Stores whose names wait for their commit, per tenant (the oldest forgotten beyond it: an
abandoned store's names are never needed)."""

NAMES_BYTES = 64 << 20
"""The most bytes of names a tenant's announced and pending chunks keep (an estimate)."""

_ENTRY_BYTES = 512
"""What a chunk's entry costs besides its hashes: its key, its ``ChunkNames``, tuple, set and
table slots (CPython 3.11, measured with ``sys.getsizeof``, rounded up)."""

Publish = Callable[[str, KVEvent], None]
"""``publish(tenant, event)``: queue an event for ``tenant``'s subscribers (never waits)."""

Subscribed = Callable[[str], bool]
"""``subscribed(tenant)``: whether anyone may want ``tenant``'s events now."""


def _always(_tenant: str) -> bool:
    return True


class ChunkNames:
    """How one chunk is named in events, and the tiers that announced it."""

    __slots__ = ("block_size", "cost", "hashes", "parent", "tenant", "tiers")

    def __init__(
        self, tenant: str, hashes: tuple[int | bytes, ...], block_size: int, parent: bytes | None
    ) -> None:
        self.tenant = tenant
        self.hashes = hashes
        self.block_size = block_size
        self.parent = parent
        """The object key of the chunk before this one, if known."""
        self.tiers: set[str] = set()
        self.cost = _ENTRY_BYTES + sum(48 + len(h) if type(h) is bytes else 44 for h in hashes)
        """Bytes these names hold (an estimate)."""


class _TenantNames:
    """One tenant's names: pending (until their commit) and announced, and their bytes."""

    __slots__ = ("known", "pending", "size")

    def __init__(self) -> None:
        self.pending: OrderedDict[bytes, ChunkNames] = OrderedDict()
        self.known: dict[bytes, ChunkNames] = {}
        """Announced chunks, the first announced first."""
        self.size = 0


class Announcer:
    """The chunks the server announced, by object key, and the events of their changes."""

    def __init__(
        self,
        publish: Publish,
        chunk_size: int,
        subscribed: Subscribed = _always,
        *,
        names_bytes: int = NAMES_BYTES,
    ) -> None:
        self._publish = publish
        self.chunk_size = chunk_size
        self._subscribed = subscribed
        self.names_bytes = names_bytes
        self._spaces: dict[bytes, str] = {}
        """Namespaces whose chunks are announced (rank 0's of each model) → their tenant."""
        self._tenants: dict[str, _TenantNames] = {}

    def __len__(self) -> int:
        return sum(len(t.known) for t in self._tenants.values())

    def names_size(self, tenant: str) -> int:
        """Bytes of names kept for ``tenant`` (an estimate)."""
        names = self._tenants.get(tenant)
        return 0 if names is None else names.size

    def announce_space(self, space: bytes, tenant: str) -> None:
        """Announce the chunks of namespace ``space`` (a rank 0 registered it) to ``tenant``."""
        self._spaces[space] = tenant

    def _table(self, key: bytes) -> tuple[str, _TenantNames] | None:
        """The tenant of ``key`` and its names, if anyone wants its events (forgetting the
        names of a tenant nobody wants any more)."""
        tenant = self._spaces.get(key[:SPACE_BYTES])
        if tenant is None:
            return None
        table = self._tenants.get(tenant)
        if not self._subscribed(tenant):
            if table is not None:
                del self._tenants[tenant]
                if table.known:
                    self._publish(tenant, AllBlocksCleared())
            return None
        if table is None:
            table = self._tenants[tenant] = _TenantNames()
        return tenant, table

    def _trim(self, table: _TenantNames) -> None:
        """Forget names beyond the tenant's bytes: pending ones first, then the chunks
        announced first (announced removed); the newest chunk stays."""
        while table.size > self.names_bytes and (table.pending or len(table.known) > 1):
            if table.pending:
                table.size -= table.pending.popitem(last=False)[1].cost
                continue
            key = next(iter(table.known))
            old = table.known.pop(key)
            table.size -= old.cost
            for medium in sorted(old.tiers):
                self._publish(old.tenant, BlockRemoved(old.hashes, medium))

    def names(
        self,
        keys: Sequence[bytes],
        block_hashes: Sequence[int | bytes],
        block_size: int,
    ) -> None:
        """A store of ``keys`` carried the engine's ``block_hashes`` of its blocks (in order,
        ``chunk_size / block_size`` per chunk, the last chunk maybe fewer): remember them until
        the chunks' commits (a chunk already announced keeps its names)."""
        if not block_hashes or block_size <= 0 or self.chunk_size % block_size or not keys:
            return
        found = self._table(keys[0])
        if found is None:
            return
        tenant, table = found
        per = self.chunk_size // block_size
        pending = table.pending
        for i, key in enumerate(keys):
            hashes = tuple(block_hashes[i * per : (i + 1) * per])
            if not hashes:
                break
            if key not in table.known:
                old = pending.pop(key, None)
                if old is not None:
                    table.size -= old.cost
                names = pending[key] = ChunkNames(tenant, hashes, block_size, None)
                table.size += names.cost
        while len(pending) > PENDING:
            table.size -= pending.popitem(last=False)[1].cost
        self._trim(table)

    # ----------------------------------------------------------------- L1 (L1Listener)

    def ready(self, key: bytes, parent: bytes | None) -> None:
        """A chunk became readable in L1."""
        self.stored(key, MEDIUM_L1, parent)

    def removed(self, key: bytes, medium: str = MEDIUM_L1) -> None:
        """A readable chunk left ``medium``."""
        found = self._table(key)
        if found is None:
            return
        table = found[1]
        names = table.known.get(key)
        if names is None or medium not in names.tiers:
            return
        names.tiers.discard(medium)
        if not names.tiers:
            del table.known[key]
            table.size -= names.cost
        self._publish(names.tenant, BlockRemoved(names.hashes, medium))

    # ----------------------------------------------------------------- any tier

    def stored(self, key: bytes, medium: str, parent: bytes | None = None) -> None:
        """A chunk is readable in ``medium`` (announced once per tier)."""
        found = self._table(key)
        if found is None:
            return
        tenant, table = found
        names = table.known.get(key)
        if names is None:
            names = table.pending.pop(key, None)
            if names is None:
                names = ChunkNames(tenant, (key[-16:],), self.chunk_size, None)
                table.size += names.cost
            table.known[key] = names
            self._trim(table)
        if parent is not None and names.parent is None:
            names.parent = parent
        if medium in names.tiers:
            return
        names.tiers.add(medium)
        self._publish(
            names.tenant,
            BlockStored(
                names.hashes, self._parent_hash(table, names), (), names.block_size, medium
            ),
        )

    def seen(self, keys: Sequence[bytes], found: int, medium: str) -> None:
        """A lookup in ``medium`` found the first ``found`` of ``keys`` and missed the next."""
        for key in keys[:found]:
            self.stored(key, medium)
        if found < len(keys):
            self.removed(keys[found], medium)

    def _parent_hash(self, table: _TenantNames, names: ChunkNames) -> int | bytes | None:
        if names.parent is None:
            return None
        parent = table.known.get(names.parent)
        if parent is not None:
            return parent.hashes[-1]
        return names.parent[-16:] if names.block_size == self.chunk_size else None
