"""What the server announces in its KV events, and when: chunks entering and leaving tiers.

:class:`Announcer` is told of every change (synchronously, from the L1 index and the L2 tier,
no I/O) and turns it into vLLM's events for the chunk's tenant, handed to ``publish`` (the
publisher's non-blocking queue, ``_events``):

* ``BlockStored`` when a chunk becomes readable in a tier: L1 (``CPU``) at its commit or at the
  end of its load from L2, never before (a failed or aborted write is never announced); an L2
  backend once its store answered true, or when a lookup finds it there (a chunk an earlier
  server stored);
* ``BlockRemoved`` when a readable chunk leaves L1 (evicted, or dropped as corrupt), or when the
  server learns it left an L2 backend (deleted as unreadable, or a lookup missed it there: a
  backend evicts on its own and tells no one);
* each ``medium`` once: the tiers speak vLLM's vocabulary (:class:`Tier`: L1 is ``CPU``, every
  L2 backend ``STORAGE`` with its ``locality`` and its label as ``ownership``), and a chunk is
  ``BlockStored`` in a medium when the first of its tiers holds it, ``BlockRemoved`` when the
  last one lost it (a router keyed by ``medium``, as llm-d's and Dynamo's are, never drops a
  chunk that a second disk of the cascade still holds).

A chunk is named by the engine's block hashes its store carried (``Store.block_hashes``, kept
here while any tier holds the chunk), else by its kvtrio chunk hash as one block of
``chunk_size`` tokens. ``parent_block_hash`` is the last block hash of the chunk before it when
that is known. The store's ``token_ids`` (4 bytes a token here), ``extra_keys``, ``lora_name``
and group fields are kept with the names, so that a router that keys blocks itself (llm-d)
can. An L2 backend that keeps names (the disk L2) is given them with each chunk it writes
(:meth:`Announcer.names_of`); after a restart the L2 tier reads them back when a namespace's
rank 0 registers or its tenant's topic gets a first subscriber (the ``recall`` it is made with) and
the chunks are announced under them (:meth:`Announcer.recovered`) before any lookup. A chunk
first announced without them (found in L2 by a lookup) is announced again, removed then stored
under its new names, when a store, a retrieve or the L2's names carry them. The table is what
tiers hold: its size follows L1 and what L2 is known to hold, within two bounds per tenant:

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
from collections.abc import Callable, Iterator, Mapping, Sequence

from ..protocol import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    PackedTokens,
    Retrieve,
    Store,
    msgpack_uint32s,
)
from ._chunknames import ChunkNames, NamesRecord, StoreNames, decode_names, kept_names
from ._tiers import MEDIUM_L1, MEDIUM_STORAGE, Tier, l2_tiers

__all__ = ["MEDIUM_L1", "NAMES_BYTES", "Announcer", "ChunkNames", "StoreNames", "Tier", "l2_tiers"]

SPACE_BYTES = 16
"""An object key's namespace: its first 16 bytes (``storage.keys``)."""


_L1_TIER = Tier(MEDIUM_L1)

PENDING = 65536
"""Stores whose names wait for their commit, per tenant (the oldest forgotten beyond it: an
abandoned store's names are never needed)."""

NAMES_BYTES = 64 << 20
"""The most bytes of names a tenant's announced and pending chunks keep (an estimate)."""

Publish = Callable[[str, KVEvent], None]
"""``publish(tenant, event)``: queue an event for ``tenant``'s subscribers (never waits)."""

Subscribed = Callable[[str], bool]
"""``subscribed(tenant)``: whether anyone may want ``tenant``'s events now."""

Recall = Callable[[bytes, int], bool]
"""``recall(space, limit)``: ask for the names the L2 keeps of namespace ``space``'s chunks (at
most ``limit`` bytes), to be handed to :meth:`Announcer.recovered`; never waits. False: the
request could not be queued (asked again at the next occasion)."""


def _always(_tenant: str) -> bool:
    return True


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
        tiers: Mapping[str, Tier] | None = None,
        recall: Recall | None = None,
    ) -> None:
        self._publish = publish
        self.chunk_size = chunk_size
        self._tier_of = {MEDIUM_L1: _L1_TIER, **(tiers or {})}
        """Tier labels → how events name them (a label not here: ``STORAGE``, local)."""
        self._subscribed = subscribed
        self.names_bytes = names_bytes
        self._spaces: dict[bytes, str] = {}
        """Namespaces whose chunks are announced (rank 0's of each model) → their tenant."""
        self._tenants: dict[str, _TenantNames] = {}
        self._ask_recall = recall
        """Asks the L2 tier for the names it keeps (:data:`Recall`; the server queues the
        requests, which the tier serves once made: it is made after this)."""
        self._recalled: set[bytes] = set()
        """Namespaces recalled while their tenant's names are kept."""

    def __len__(self) -> int:
        return sum(len(t.known) for t in self._tenants.values())

    def names_size(self, tenant: str) -> int:
        """Bytes of names kept for ``tenant`` (an estimate)."""
        names = self._tenants.get(tenant)
        return 0 if names is None else names.size

    def announce_space(self, space: bytes, tenant: str) -> None:
        """Announce the chunks of namespace ``space`` (a rank 0 registered it) to ``tenant``,
        those the L2 kept names of too (:meth:`_recall`)."""
        self._spaces[space] = tenant
        self._recall(space, tenant)

    def subscriber(self, tenant: str | None) -> None:
        """A first subscriber came for ``tenant``'s topic (None: for every tenant's, over
        ipc): recall what the L2 keeps of the tenant's namespaces, if not done yet."""
        for space, owner in list(self._spaces.items()):
            if tenant is None or owner == tenant:
                self._recall(space, owner)

    def _recall(self, space: bytes, tenant: str) -> None:
        """Have the L2 tier read back the names kept beside ``space``'s chunks (within the
        tenant's bytes of names), once while the tenant's names are kept, if anyone wants them.
        The chunks are then announced in the L2's medium before any lookup finds them."""
        if self._ask_recall is None or space in self._recalled or not self._subscribed(tenant):
            return
        limit = max(0, self.names_bytes - self.names_size(tenant)) // 2
        if self._ask_recall(space, limit):
            self._recalled.add(space)

    def names_of(self, key: bytes) -> NamesRecord | None:
        """The names of chunk ``key`` to keep beside it in an L2 backend (those a store gave:
        not a chunk known by its chunk hash alone), or None."""
        tenant = self._spaces.get(key[:SPACE_BYTES])
        table = None if tenant is None else self._tenants.get(tenant)
        names = None if table is None else table.known.get(key)
        if table is None or names is None or not names.named:
            return None
        parent = self._parent_hash(table, names)
        return NamesRecord(
            names.hashes, names.block_size, parent, names.tokens, names.extra, names.store
        )

    def recovered(self, key: bytes, medium: str, record: bytes) -> None:
        """Tier ``medium`` holds chunk ``key`` and kept its names (``record``, read back after
        a restart): announce it under them (a record that does not decode is left out: a
        lookup announces the chunk as before)."""
        found = self._table(key)
        if found is None:
            return
        tenant, table = found
        known = table.known.get(key)
        names = None if known and known.named else decode_names(record, tenant, self.chunk_size)
        if names is None:
            if known is not None:
                self.stored(key, medium)
            return
        if known is not None:  # (found by a lookup first: renamed, as a retrieve would)
            self._rename(table, key, known, names)
        else:
            table.known[key] = names
            table.size += names.cost
        if medium not in names.tiers:
            self._announce(table, names, medium)
        self._trim(table)

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
                self._recalled -= {s for s, t in self._spaces.items() if t == tenant}
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
            self._unannounce(old)

    def names(
        self,
        keys: Sequence[bytes],
        block_hashes: Sequence[int | bytes],
        block_size: int,
        store: Store | Retrieve | None = None,
    ) -> None:
        """A store (or retrieve) of ``keys`` carried the engine's ``block_hashes`` (in order,
        ``chunk_size / block_size`` per chunk, the last chunk maybe fewer), or none (token
        mode: each chunk one block of ``chunk_size``), and what else ``store`` says of them:
        remember them until the chunks' commits. A chunk already announced keeps its names,
        unless it was announced without any (found in L2 after a restart): it is announced
        again under these. Tokens or extra keys that do not match the blocks are left out."""
        if not keys or (block_hashes and (block_size <= 0 or self.chunk_size % block_size)):
            return
        if not block_hashes and (store is None or not store.token_ids):
            return
        found = self._table(keys[0])
        if found is None:
            return
        tenant, table = found
        if block_hashes:
            per, size, blocks = self.chunk_size // block_size, block_size, len(block_hashes)
        else:
            per, size, blocks = 1, self.chunk_size, len(keys)
        tokens, extra, kept = kept_names(store)
        count = len(tokens) // 4
        if tokens and not (count == blocks * size if block_hashes else count <= blocks * size):
            tokens = b""
        elements = msgpack_uint32s(tokens) if tokens else b""  # (once a store)
        if extra and len(extra) != blocks:
            extra = ()
        pending = table.pending
        for i, key in enumerate(keys):
            hashes = tuple(block_hashes[i * per : (i + 1) * per]) if block_hashes else (key[-16:],)
            if not hashes:
                break
            known = table.known.get(key)
            if known is not None and known.named:
                continue
            names = ChunkNames(
                tenant,
                hashes,
                size,
                None,
                (
                    PackedTokens.of(elements[5 * i * per * size : 5 * (i + 1) * per * size])
                    if elements
                    else None
                ),
                extra[i * per : (i + 1) * per] if extra else None,
                kept,
            )
            if block_hashes and i:
                names.parent_hash = block_hashes[i * per - 1]
            if known is not None:
                self._rename(table, key, known, names)
                continue
            old = pending.pop(key, None)
            if old is not None:
                table.size -= old.cost
            pending[key] = names
            table.size += names.cost
        while len(pending) > PENDING:
            table.size -= pending.popitem(last=False)[1].cost
        self._trim(table)

    def _rename(self, table: _TenantNames, key: bytes, old: ChunkNames, new: ChunkNames) -> None:
        """Announce a chunk known by its chunk hash alone under the names a store gave it."""
        self._unannounce(old)
        new.parent, new.tiers = old.parent, set()
        if new.parent_hash is None and old.block_size == new.block_size:
            new.parent_hash = old.parent_hash
        table.known[key] = new
        table.size += new.cost - old.cost
        for label in sorted(old.tiers):
            self._announce(table, new, label)

    # ----------------------------------------------------------------- L1 (L1Listener)

    def ready(self, key: bytes, parent: bytes | None) -> None:
        """A chunk became readable in L1."""
        self.stored(key, MEDIUM_L1, parent)

    def removed(self, key: bytes, medium: str = MEDIUM_L1) -> None:
        """A readable chunk left tier ``medium`` (``CPU`` or an L2 backend's label)."""
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
        tier = self._tier(medium)
        if not self._held_in(names, tier.medium):
            self._publish(names.tenant, self._removed(names, tier))

    # ----------------------------------------------------------------- any tier

    def stored(self, key: bytes, medium: str, parent: bytes | None = None) -> None:
        """A chunk is readable in tier ``medium`` (``CPU`` or an L2 backend's label; announced
        once per vLLM ``medium``)."""
        found = self._table(key)
        if found is None:
            return
        tenant, table = found
        names = table.known.get(key)
        if names is None:
            names = table.pending.pop(key, None)
            if names is None:
                names = ChunkNames(tenant, (key[-16:],), self.chunk_size, None, named=False)
                table.size += names.cost
            table.known[key] = names
            self._trim(table)
        if parent is not None and names.parent is None:
            names.parent = parent
        if medium not in names.tiers:
            self._announce(table, names, medium)

    def seen(self, keys: Sequence[bytes], found: int, medium: str) -> None:
        """A lookup in ``medium`` found the first ``found`` of ``keys`` and missed the next."""
        for key in keys[:found]:
            self.stored(key, medium)
        if found < len(keys):
            self.removed(keys[found], medium)

    def snapshot(self, tenant: str) -> Iterator[BlockStored]:
        """``tenant``'s chunks as the ``BlockStored`` events of every medium that holds them
        (what a subscriber that applied every event holds). The chunks and their media are
        taken at the call; the events are built as the iterator is consumed."""
        table = self._tenants.get(tenant)
        if table is None:
            return iter(())
        taken = [(names, self._media(names)) for names in table.known.values()]
        return (self._stored(table, names, tier) for names, tiers in taken for tier in tiers)

    # ----------------------------------------------------------------- events

    def _tier(self, label: str) -> Tier:
        tier = self._tier_of.get(label)
        if tier is None:
            tier = self._tier_of[label] = Tier(MEDIUM_STORAGE, "LOCAL", label)
        return tier

    def _held_in(self, names: ChunkNames, medium: str) -> bool:
        """Whether a tier of ``medium`` holds ``names`` (a loop: no generator per event)."""
        for label in names.tiers:  # noqa: SIM110 (no generator per event)
            if self._tier(label).medium == medium:
                return True
        return False

    def _media(self, names: ChunkNames) -> list[Tier]:
        """The tiers announcing ``names``: one per medium, the first label's (sorted)."""
        media: dict[str, Tier] = {}
        for label in sorted(names.tiers):
            tier = self._tier(label)
            media.setdefault(tier.medium, tier)
        return list(media.values())

    def _announce(self, table: _TenantNames, names: ChunkNames, label: str) -> None:
        """``names`` became readable in tier ``label``: ``BlockStored`` if no tier of its
        medium held it."""
        tier = self._tier(label)
        new = not self._held_in(names, tier.medium)
        names.tiers.add(label)
        if new:
            self._publish(names.tenant, self._stored(table, names, tier))

    def _unannounce(self, names: ChunkNames) -> None:
        """``names`` are forgotten: removed from every medium that announced them."""
        for tier in self._media(names):
            self._publish(names.tenant, self._removed(names, tier))

    def _stored(self, table: _TenantNames, names: ChunkNames, tier: Tier) -> BlockStored:
        store = names.store
        return BlockStored(
            names.hashes,
            self._parent_hash(table, names),
            () if names.tokens is None else names.tokens,
            names.block_size,
            tier.medium,
            None,
            store.lora_name or None,
            names.extra,
            None if store.group_idx < 0 else store.group_idx,
            store.spec_kind or None,
            store.sliding_window or None,
            tier.locality,
            tier.ownership,
        )

    def _removed(self, names: ChunkNames, tier: Tier) -> BlockRemoved:
        group = names.store.group_idx
        return BlockRemoved(
            names.hashes, tier.medium, None if group < 0 else group, tier.locality, tier.ownership
        )

    def _parent_hash(self, table: _TenantNames, names: ChunkNames) -> int | bytes | None:
        if names.parent_hash is not None or names.parent is None:
            return names.parent_hash
        parent = table.known.get(names.parent)
        if parent is not None:
            names.parent_hash = parent.hashes[-1]
        elif names.block_size == self.chunk_size:
            names.parent_hash = names.parent[-16:]
        return names.parent_hash
