"""What an engine connector's scheduler side decides, without the engine: which chunks of a
request to load from kvtrio and which to store, in whole chunks.

The vLLM connector (:mod:`kvtrio.integration.vllm`) feeds this from vLLM's scheduler calls; the
rules live here so they can be read, and tested, without vLLM:

* a lookup hit is usable up to the last whole block *before* the request's last token (the
  engine must compute at least one token to sample from): the hit's last chunk may be loaded
  in part;
* a load covers the chunks from the one holding the engine's first missing token up to the hit,
  and leaves the blocks the engine already has (its own prefix cache) alone;
* a store covers the whole chunks the engine has computed beyond what kvtrio already holds
  (lookup hits count as held), each chunk once per request; once the prompt is computed, also
  its *partial chunk* (the whole blocks after its last full chunk), so that the same prompt
  later loads up to its last block, not its last chunk.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal

import attrs

from ..client import LoadStoreOp

__all__ = [
    "PlannedTransfer",
    "RequestPlan",
    "held_after_lookup",
    "may_store",
    "plan_load",
    "plan_store",
    "usable_hit",
]


@attrs.frozen
class PlannedTransfer:
    """One load or store the scheduler side hands to the workers for a step."""

    request_id: str
    kind: Literal["load", "store"]
    op: LoadStoreOp
    sync: bool = False
    """Loads: done before the step's forward (True) or between steps (False)."""
    tier: str = "l1"
    """Loads: ``l1`` if every chunk was in the server's L1 at lookup (the worker times such
    loads as the copy's own cost), else ``l2``."""
    group: int = 0
    """The engine's KV cache group whose blocks it moves (vLLM's ``group_idx``)."""
    windowed: bool = False
    """Stores of a windowed group: vLLM may reuse their blocks while the request runs, so the
    workers finish them before the next forward."""


@attrs.define
class RequestPlan:
    """The scheduler side's record of one request."""

    request_id: str
    load: bool = True
    """Loading from kvtrio is allowed for this request."""
    save: bool = True
    """Storing into kvtrio is allowed for this request."""
    hit_tokens: int = 0
    """Usable tokens kvtrio had at lookup (a whole number of blocks)."""
    local_tokens: int = 0
    """Tokens the engine's own prefix cache had at lookup."""
    held_tokens: int = 0
    """Prefix of full chunks known to be in kvtrio: lookup hits, then stores issued."""
    tail_held: bool = False
    """The prompt's partial chunk is in kvtrio (a lookup hit it, or a store was issued)."""
    load_end: int | None = None
    """The load policy's decision on this request's hit, once made: the token its load ends
    at (at most the engine's own prefix: nothing loaded). vLLM asks again at every step until
    it can allocate the blocks: the hit is judged, and counted, once."""
    load_tier: str = "l1"
    """Where the decided load comes from: ``l1``, or ``l2`` if some of its chunks do."""
    load_in_step: bool = False
    """The load policy chose to load inside the request's first step, before its forward,
    rather than between steps (a short L1 load that costs the batch less than a step)."""
    locked: bool = False
    """The lookup pinned chunks at kvtrio that no load has taken over yet."""
    load_issued: bool = False
    """A load of this request went to the workers (the scheduler side loads once)."""
    stores: int = 0
    """Stores issued for this request (the engine must then wait for them before freeing);
    one that no KV cache group hands to the workers is taken back (``GroupSpread.stores``)."""


def usable_hit(hit_tokens: int, num_tokens: int, block_size: int) -> int:
    """The part of a lookup hit the engine may load: whole blocks, at least one token short of
    the request's ``num_tokens``."""
    return min(hit_tokens, (num_tokens - 1) // block_size * block_size) if num_tokens > 0 else 0


def held_after_lookup(plan: RequestPlan, hit_tokens: int, chunk_size: int) -> None:
    """Record a lookup's hit (tokens, the partial chunk's included) as held by kvtrio."""
    plan.held_tokens = max(plan.held_tokens, hit_tokens - hit_tokens % chunk_size)
    plan.tail_held |= hit_tokens % chunk_size > 0


def plan_load(
    plan: RequestPlan,
    *,
    tokens: Sequence[int],
    block_ids: Sequence[int],
    external_tokens: int,
    block_size: int,
    chunk_size: int,
    sync: bool,
    block_hashes: Sequence[bytes] | None = None,
    event_hashes: Callable[[int, int], Sequence[bytes | int]] | None = None,
) -> PlannedTransfer | None:
    """The load of ``external_tokens`` tokens after the engine's ``plan.local_tokens``; None
    when there is nothing to load.

    ``block_ids`` are all the request's blocks, from its first token; ``tokens`` the prompt
    as it was looked up (and ``block_hashes`` its engine block hashes, in hash mode). The
    load starts at the chunk holding the first missing token, skips the blocks before it, and
    ends at a block boundary (its last chunk may be loaded in part). ``event_hashes`` as for
    :func:`plan_store`: the loaded chunks' names go with the retrieve (KV events).
    """
    if external_tokens <= 0 or plan.hit_tokens <= plan.local_tokens:
        return None
    end = min(plan.local_tokens + external_tokens, plan.hit_tokens)
    end -= end % block_size
    start = plan.local_tokens // chunk_size * chunk_size
    if end <= plan.local_tokens:
        return None
    op = LoadStoreOp(
        block_ids=tuple(block_ids[: end // block_size]),
        token_ids=tuple(tokens),
        block_hashes=None if block_hashes is None else tuple(block_hashes),
        start=start,
        end=end,
        skip_first_n_tokens=plan.local_tokens - start,
        **_event_names(
            None if event_hashes is None else event_hashes(start // block_size, end // block_size)
        ),
    )
    return PlannedTransfer(plan.request_id, "load", op, sync=sync, tier=plan.load_tier)


def may_store(
    plan: RequestPlan, computed_tokens: int, prompt_tokens: int, block_size: int, chunk_size: int
) -> bool:
    """False when :func:`plan_store` would plan nothing for ``computed_tokens`` (no chunk
    completed beyond what kvtrio holds, and no partial chunk due): a check of a few integer
    operations that spares a step the request's blocks and hashes (most decode steps)."""
    if not plan.save:
        return False
    if computed_tokens - computed_tokens % chunk_size > plan.held_tokens:
        return True
    whole = prompt_tokens - prompt_tokens % block_size
    return not plan.tail_held and prompt_tokens - prompt_tokens % chunk_size < whole <= (
        computed_tokens
    )


def plan_store(
    plan: RequestPlan,
    *,
    tokens: Sequence[int],
    block_ids: Sequence[int],
    computed_tokens: int,
    prompt_tokens: int,
    block_size: int,
    chunk_size: int,
    block_hashes: Sequence[bytes] | None = None,
    event_hashes: Callable[[int, int], Sequence[bytes | int]] | None = None,
) -> list[PlannedTransfer]:
    """The stores of what the engine will have computed (``computed_tokens``, this step
    included) and kvtrio does not hold: the prompt's partial chunk once the prompt is
    computed, and the whole chunks beyond ``plan.held_tokens``. In hash mode
    (``block_hashes``: the engine's, one per block) only the blocks hashed so far.
    ``event_hashes(first, stop)`` gives the engine's block hashes of blocks ``[first, stop)``
    as its KV events name them (they go with the stores, for the server's KV events). Updates
    ``plan``."""
    if not plan.save:
        return []
    end = min(computed_tokens, len(tokens), len(block_ids) * block_size)
    if block_hashes is not None:
        end = min(end, len(block_hashes) * block_size)
    stores = []
    whole = prompt_tokens - prompt_tokens % block_size  # the prompt's whole blocks
    full = prompt_tokens - prompt_tokens % chunk_size  # and its full chunks
    if not plan.tail_held and full < whole <= end:
        start = min(plan.held_tokens, full)
        stores.append(
            _store(plan, tokens, block_ids, block_size, start, whole, block_hashes, event_hashes)
        )
        plan.held_tokens = max(plan.held_tokens, full)
        plan.tail_held = True
    end -= end % chunk_size
    if end > plan.held_tokens:
        stores.append(
            _store(
                plan,
                tokens,
                block_ids,
                block_size,
                plan.held_tokens,
                end,
                block_hashes,
                event_hashes,
            )
        )
        plan.held_tokens = end
    return stores


def _store(
    plan: RequestPlan,
    tokens: Sequence[int],
    block_ids: Sequence[int],
    block_size: int,
    start: int,
    end: int,
    block_hashes: Sequence[bytes] | None,
    event_hashes: Callable[[int, int], Sequence[bytes | int]] | None = None,
) -> PlannedTransfer:
    """The store of tokens ``[start, end)``: full chunks, then the partial chunk of the whole
    blocks after them if ``end`` is not at a chunk boundary."""
    # Only this store's blocks: converting a long prompt's every hash at each step costs the
    # scheduler ~0.6 µs a block (1.3 ms for 2,048 blocks).
    named = None if event_hashes is None else event_hashes(start // block_size, end // block_size)
    op = LoadStoreOp(
        block_ids=tuple(block_ids[: end // block_size]),
        token_ids=tuple(tokens[:end]),
        block_hashes=None if block_hashes is None else tuple(block_hashes[: end // block_size]),
        start=start,
        end=end,
        **_event_names(named),
    )
    plan.stores += 1
    return PlannedTransfer(plan.request_id, "store", op)


def _event_names(names: Sequence[bytes | int] | None) -> dict[str, Any]:
    """An operation's KV event fields from ``event_hashes``' answer: the hashes, and the
    blocks' extra keys and LoRA adapter where it has them (``integration._events.BlockNames``)."""
    if names is None:
        return {}
    return {
        "event_hashes": tuple(names),
        "event_extra_keys": getattr(names, "extra_keys", None),
        "lora_name": getattr(names, "lora_name", ""),
    }
