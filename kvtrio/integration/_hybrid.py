"""Loads and stores of an engine with several KV cache groups (vLLM's hybrid KV cache manager
on: full attention beside sliding-window, chunked-local or Mamba layers). No vLLM import.

The lookup asks for every group's chunks at once (:meth:`GroupSpread.lookup_hashes`,
:mod:`kvtrio.client._grouped`): the hit reported to vLLM is the longest prefix every group
holds (every chunk of it, for every group: a lookup answers leading chunks), and a Mamba group's
state at that prefix's end. The scheduler side then plans one request's transfers as for a
single group, on its *primary* group (the first full-attention group, else the first windowed
one): the load policy's decision, which chunks are held and which to store.
:class:`GroupSpread` then makes of each planned load or store one per group, with the group's
own blocks and keys:

* **loads** move of each group only what its layers read for the hit's end
  (:meth:`~._kv_groups.KvGroup.first_needed`): every block for full attention, the last
  ``window - 1`` tokens' blocks for a sliding window, the hit's last attention chunk for chunked
  local attention, the one block holding the state at the hit's end for Mamba. vLLM gives
  the blocks before them the null block; they are left alone;
* **stores** of a windowed group are skipped where one of their blocks is already the null
  block (vLLM freed it behind the window during a chunked prefill): what is stored is what a
  later hit can load, never a null block's bytes. Windowed groups' stores must be copied before
  vLLM reuses their blocks, which it may do while the request still runs: they are marked
  ``windowed`` and the workers wait for them before the next forward;
* a **Mamba** group (vLLM's ``align`` cache mode) stores, of a chunk, the state at its end
  when vLLM has it there (its block there is not the null block: a step ended there), in
  every block slot of the chunk (no null block is read); it is waited for as windowed stores
  are. In other cache modes the engine loads and stores nothing (every lookup misses).

Bytes per hit are counted (:attr:`GroupSpread.stats`): ``loaded_bytes`` moved, and
``hit_bytes_full`` what loading every group's every block of the same hits would have moved;
an INFO line says them at the 1st, 2nd, 4th, 8th, … hit.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from ..client import EventGroup
from ._kv_groups import KvGroup, group_block_hashes, token_block_hashes
from ._planner import PlannedTransfer, RequestPlan

__all__ = ["GroupSpread", "event_group", "primary_group"]

log = logging.getLogger("kvtrio.vllm")

RELOOKS = 2
"""How many times a request's lookup is asked again for a shorter hit (:meth:`GroupSpread.hit`)."""

NULL_BLOCK = 0
"""vLLM's null block id (its block pool hands block 0 out as the null block)."""


def event_group(group: KvGroup) -> EventGroup:
    """How vLLM's KV events name ``group`` (its index, spec kind and sliding window)."""
    return EventGroup(group.index, group.spec_kind, group.window if group.kind == "window" else 0)


def primary_group(groups: Sequence[KvGroup]) -> int:
    """The index of the group whose chunks a lookup asks for: the first full-attention one,
    else the first windowed one (the hit then covers every chunk of every group)."""
    for kind in ("full", "window", "chunked"):
        for group in groups:
            if group.kind == kind:
                return group.index
    return 0


class GroupSpread:
    """Per-group keys and transfers of one engine's requests (see the module docstring)."""

    def __init__(self, groups: Sequence[KvGroup], block_size: int) -> None:
        self.groups = tuple(groups)
        self.block_size = block_size
        self.primary = primary_group(self.groups)
        self.keeps_state = all(g.aligned for g in self.groups if g.kind == "mamba")
        """False with a Mamba group outside vLLM's ``align`` mode: nothing is loaded or
        stored."""
        self._state_group = next((g.index for g in self.groups if g.kind == "mamba"), None)
        """The first Mamba group (its state stands for every Mamba group's), if any."""
        self.stats: collections.Counter[str] = collections.Counter()
        """Counters since the engine started (``hits``, ``loaded_bytes``, ``hit_bytes_full``,
        ``stores_skipped_window``)."""
        self._reported: collections.Counter[str] = collections.Counter()
        self._hashes: dict[str, tuple[int, list[tuple[bytes, ...]]]] = {}
        self.windowed = any(g.kind in ("window", "chunked") for g in self.groups)
        self._ends: dict[str, int] = {}
        """Requests asked again for a shorter hit: the end asked for (:meth:`hit`)."""
        self._relooks: dict[str, int] = {}

    def hashes(self, request: Any, base: Sequence[bytes] | None) -> list[tuple[bytes, ...]]:
        """The request's block hashes of every group, from the engine's (``base``, hash mode)
        or its token ids; remembered, and extended only when the request has more blocks."""
        if base is None:
            base = token_block_hashes(request.all_token_ids, self.block_size)
        known = self._hashes.get(request.request_id)
        if known is not None and known[0] == len(base):
            return known[1]
        done = 0 if known is None else known[0]
        old = [()] * len(self.groups) if known is None else known[1]
        fresh = [old[g.index] + group_block_hashes(base[done:], g.index) for g in self.groups]
        self._hashes[request.request_id] = (len(base), fresh)
        return fresh

    def lookup_hashes(
        self, request_id: str, hashes: Sequence[Sequence[bytes]], num_tokens: int
    ) -> tuple[list[tuple[Sequence[bytes], int]], Sequence[bytes] | None]:
        """What the request's lookup asks for (the :class:`~kvtrio.client.SchedulerAdapter`'s
        ``groups`` and ``state``): the block hashes of every attention group, with the first
        token a hit at their end needs of it, and the Mamba group's, up to the hit's furthest
        end (the whole blocks before the prompt's last token of ``num_tokens``), or the end
        :meth:`hit` asks again for. Without a Mamba group, every whole block of the prompt is
        asked for (its last chunk may then be a whole one, hit and loaded in part). With
        several Mamba groups, the first's state stands for all: they store and load
        together."""
        end = self._ends.get(request_id, (num_tokens - 1) // self.block_size * self.block_size)
        blocks = max(0, end) // self.block_size
        state = self._state_group
        if request_id not in self._ends and state is None:
            # Every whole block, as a lookup of one group asks: a prompt of whole chunks hits
            # its last chunk, loaded in part up to ``end`` (asked only up to ``end``, that
            # chunk would be a partial chunk nobody stored). A state is only at ``end``.
            blocks = num_tokens // self.block_size
        attention = [
            (hashes[g.index][:blocks], g.first_needed(end) // self.block_size * self.block_size)
            for g in self.groups
            if g.kind != "mamba"
        ]
        return attention, (None if state is None else hashes[state][:blocks])

    def hit(self, request_id: str, hit: int, num_tokens: int) -> int | None:
        """The hit every group serves, from a lookup's answer ``hit``; None: ask again, for a
        shorter hit (:meth:`lookup_hashes` then asks for that end).

        A lookup asks windowed groups only for the chunks a hit at its end needs: an answer
        short of that end says the other groups hold its prefix, not whether the windowed ones
        hold what a hit *there* needs. So the lookup is asked again for that end (at most
        :data:`RELOOKS` times; then nothing is hit). A new lookup replaces the old one's pins.
        The end asked for is kept until :meth:`forget`: vLLM asking again (a request waiting
        for blocks) gets the same answer."""
        end = self._ends.get(request_id, (num_tokens - 1) // self.block_size * self.block_size)
        if hit >= end or hit <= 0 or not self.windowed:
            return max(0, min(hit, end))  # (vLLM may ask again: the same answer, kept)
        tries = self._relooks.get(request_id, 0)
        if tries >= RELOOKS:
            self._ends[request_id] = 0  # (and so if vLLM asks again)
            return 0
        self._relooks[request_id] = tries + 1
        self._ends[request_id] = hit - hit % self.block_size
        self.stats["relookups"] += 1
        return None

    def since_last(self) -> dict[str, int]:
        """The counters gained since the last call (for vLLM's stats logger)."""
        gained = {k: v - self._reported[k] for k, v in self.stats.items() if v > self._reported[k]}
        self._reported = self.stats.copy()
        return gained

    def summary(self) -> str:
        """The counters as a log line's end: hits and bytes loaded per hit."""
        hits = self.stats["hits"]
        if not hits:
            return "no hits loaded"
        loaded, full = self.stats["loaded_bytes"], self.stats["hit_bytes_full"]
        return (
            f"{hits} hits loaded {loaded} bytes ({loaded // hits} per hit; every block of "
            f"every group: {full // hits}, {loaded / max(1, full):.3f} of it); windowed stores "
            f"skipped: {self.stats['stores_skipped_window']}"
        )

    def forget(self, request_id: str) -> None:
        self._hashes.pop(request_id, None)
        self._ends.pop(request_id, None)
        self._relooks.pop(request_id, None)

    def loads(
        self,
        load_of: Callable[..., PlannedTransfer | None],
        block_ids: Sequence[Sequence[int]],
        hashes: Sequence[Sequence[bytes]],
        plan: RequestPlan,
        chunk_size: int,
    ) -> list[PlannedTransfer]:
        """The request's load, one per group: ``load_of(block_ids=, block_hashes=)`` plans it
        on the primary group (tokens ``[plan.local_tokens, end)`` beyond the engine's own
        prefix); each group's moves only what its layers read."""
        load = load_of(block_ids=block_ids[self.primary], block_hashes=tuple(hashes[self.primary]))
        if load is None:
            return []
        local_tokens = plan.local_tokens
        op, size = load.op, self.block_size
        end = op.end
        transfers = []
        full_bytes = moved = 0
        for group in self.groups:
            full_bytes += (end - local_tokens) // size * group.block_bytes
            needed = group.first_needed(end) // size * size
            first = max(local_tokens, needed)
            if first >= end:
                continue
            start = first // chunk_size * chunk_size
            blocks = block_ids[group.index][: end // size]
            if any(b == NULL_BLOCK for b in blocks[first // size :]):
                continue  # (vLLM allocates every block a group reads: never seen)
            moved += (end - first) // size * group.block_bytes
            group_op = attrs.evolve(
                op,
                block_ids=blocks,
                block_hashes=tuple(hashes[group.index]),
                start=start,
                skip_first_n_tokens=first - start,
            )
            transfers.append(
                PlannedTransfer(
                    load.request_id, "load", group_op, sync=load.sync, group=group.index
                )
            )
        self.stats["hits"] += 1
        self.stats["loaded_bytes"] += moved
        self.stats["hit_bytes_full"] += full_bytes
        hits = self.stats["hits"]
        if hits & (hits - 1) == 0:  # at 1, 2, 4, 8, … hits: a log line, not one per hit
            log.info("kvtrio KV cache groups: %s", self.summary())
        return transfers

    def stores(
        self,
        store_of: Callable[..., list[PlannedTransfer]],
        block_ids: Sequence[Sequence[int]],
        hashes: Sequence[Sequence[bytes]],
        plan: RequestPlan,
        chunk_size: int = 0,
    ) -> list[PlannedTransfer]:
        """The primary group's stores (``store_of(block_ids=, block_hashes=)``, which updates
        the request's plan) and the same token ranges of every other group, with its own
        blocks and keys; a windowed group's store that would read a null block is skipped; a
        Mamba group's is the state at the store's end, in its last chunk (``chunk_size``).
        A store skipped in every group is taken out of ``plan.stores``."""
        primary = store_of(block_ids=block_ids[self.primary], block_hashes=hashes[self.primary])
        transfers = []
        issued = [False] * len(primary)
        size = self.block_size
        for group in self.groups:
            windowed = group.kind in ("window", "chunked", "mamba")
            named = event_group(group)
            for i, store in enumerate(primary):
                op = store.op
                blocks = block_ids[group.index][: op.end // size]
                if group.kind == "mamba":
                    state = self._state_store(store, blocks, hashes[group.index], chunk_size)
                    if state is not None:
                        state = attrs.evolve(state, op=attrs.evolve(state.op, group=named))
                        transfers.append(attrs.evolve(state, group=group.index, windowed=True))
                        issued[i] = True
                    continue
                if windowed and NULL_BLOCK in blocks[op.start // size :]:
                    self.stats["stores_skipped_window"] += 1
                    continue
                if group.index != self.primary:
                    # (the engine names a block alike in every group: the same event hashes)
                    op = attrs.evolve(
                        op,
                        block_ids=blocks,
                        block_hashes=tuple(hashes[group.index][: op.end // size]),
                    )
                op = attrs.evolve(op, group=named)
                transfers.append(attrs.evolve(store, op=op, group=group.index, windowed=windowed))
                issued[i] = True
        # (no worker will report such a store done: counted, vLLM would keep the request's
        # blocks after it finishes, for ever)
        plan.stores -= issued.count(False)
        return transfers

    def _state_store(
        self,
        store: PlannedTransfer,
        blocks: Sequence[int],
        hashes: Sequence[bytes],
        chunk_size: int,
    ) -> PlannedTransfer | None:
        """A Mamba group's store of ``store``'s range: its last chunk, every block slot the
        block holding the state at the range's end (None when vLLM keeps no state there)."""
        op, size = store.op, self.block_size
        last = op.end // size - 1
        if last < 0 or len(blocks) <= last or blocks[last] == NULL_BLOCK:
            self.stats["stores_skipped_state"] += 1
            return None
        start = max(op.start, (op.end - 1) // chunk_size * chunk_size) if chunk_size else op.start
        state_blocks = list(blocks)
        state_blocks[start // size : last + 1] = [blocks[last]] * (last + 1 - start // size)
        skipped = (start - op.start) // size  # (the event names start at the op's start)
        state_op = attrs.evolve(
            op,
            block_ids=tuple(state_blocks),
            block_hashes=tuple(hashes[: op.end // size]),
            start=start,
            skip_first_n_tokens=0,
            event_hashes=None if op.event_hashes is None else tuple(op.event_hashes[skipped:]),
            event_extra_keys=(
                None if op.event_extra_keys is None else tuple(op.event_extra_keys[skipped:])
            ),
        )
        return attrs.evolve(store, op=state_op)
