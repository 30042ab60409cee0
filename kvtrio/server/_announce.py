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
the adapter). The table is what tiers hold: its size follows L1 and what L2 is known to hold.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

from ..protocol import BlockRemoved, BlockStored, KVEvent

__all__ = ["MEDIUM_L1", "Announcer", "ChunkNames"]

SPACE_BYTES = 16
"""An object key's namespace: its first 16 bytes (``storage.keys``)."""

MEDIUM_L1 = "CPU"
"""The ``medium`` of L1 (vLLM's name for host memory)."""

PENDING = 65536
"""Stores whose names wait for their commit (the oldest forgotten beyond it: an abandoned
store's names are never needed)."""

Publish = Callable[[str, KVEvent], None]
"""``publish(tenant, event)``: queue an event for ``tenant``'s subscribers (never waits)."""


class ChunkNames:
    """How one chunk is named in events, and the tiers that announced it."""

    __slots__ = ("block_size", "hashes", "parent", "tenant", "tiers")

    def __init__(
        self, tenant: str, hashes: tuple[int | bytes, ...], block_size: int, parent: bytes | None
    ) -> None:
        self.tenant = tenant
        self.hashes = hashes
        self.block_size = block_size
        self.parent = parent
        """The object key of the chunk before this one, if known."""
        self.tiers: set[str] = set()


class Announcer:
    """The chunks the server announced, by object key, and the events of their changes."""

    def __init__(self, publish: Publish, chunk_size: int) -> None:
        self._publish = publish
        self.chunk_size = chunk_size
        self._spaces: dict[bytes, str] = {}
        """Namespaces whose chunks are announced (rank 0's of each model) → their tenant."""
        self._pending: OrderedDict[bytes, ChunkNames] = OrderedDict()
        self._known: dict[bytes, ChunkNames] = {}

    def __len__(self) -> int:
        return len(self._known)

    def announce_space(self, space: bytes, tenant: str) -> None:
        """Announce the chunks of namespace ``space`` (a rank 0 registered it) to ``tenant``."""
        self._spaces[space] = tenant

    def _tenant_of(self, key: bytes) -> str | None:
        return self._spaces.get(key[:SPACE_BYTES])

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
        tenant = self._tenant_of(keys[0])
        if tenant is None:
            return
        per = self.chunk_size // block_size
        pending = self._pending
        for i, key in enumerate(keys):
            hashes = tuple(block_hashes[i * per : (i + 1) * per])
            if not hashes:
                break
            if key not in self._known:
                pending[key] = ChunkNames(tenant, hashes, block_size, None)
                pending.move_to_end(key)
        while len(pending) > PENDING:
            pending.popitem(last=False)

    # ----------------------------------------------------------------- L1 (L1Listener)

    def ready(self, key: bytes, parent: bytes | None) -> None:
        """A chunk became readable in L1."""
        self.stored(key, MEDIUM_L1, parent)

    def removed(self, key: bytes, medium: str = MEDIUM_L1) -> None:
        """A readable chunk left ``medium``."""
        names = self._known.get(key)
        if names is None or medium not in names.tiers:
            return
        names.tiers.discard(medium)
        if not names.tiers:
            del self._known[key]
        self._publish(names.tenant, BlockRemoved(names.hashes, medium))

    # ----------------------------------------------------------------- any tier

    def stored(self, key: bytes, medium: str, parent: bytes | None = None) -> None:
        """A chunk is readable in ``medium`` (announced once per tier)."""
        names = self._known.get(key)
        if names is None:
            names = self._pending.pop(key, None)
            if names is None:
                tenant = self._tenant_of(key)
                if tenant is None:
                    return
                names = ChunkNames(tenant, (key[-16:],), self.chunk_size, None)
            self._known[key] = names
        if parent is not None and names.parent is None:
            names.parent = parent
        if medium in names.tiers:
            return
        names.tiers.add(medium)
        self._publish(
            names.tenant,
            BlockStored(names.hashes, self._parent_hash(names), (), names.block_size, medium),
        )

    def seen(self, keys: Sequence[bytes], found: int, medium: str) -> None:
        """A lookup in ``medium`` found the first ``found`` of ``keys`` and missed the next."""
        for key in keys[:found]:
            self.stored(key, medium)
        if found < len(keys):
            self.removed(keys[found], medium)

    def _parent_hash(self, names: ChunkNames) -> int | bytes | None:
        if names.parent is None:
            return None
        parent = self._known.get(names.parent)
        if parent is not None:
            return parent.hashes[-1]
        return names.parent[-16:] if names.block_size == self.chunk_size else None
