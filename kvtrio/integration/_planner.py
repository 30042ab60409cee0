"""What an engine connector's scheduler side decides, without the engine: which chunks of a
request to load from kvtrio and which to store, in whole chunks.

The vLLM connector (:mod:`kvtrio.integration.vllm`) feeds this from vLLM's scheduler calls; the
rules live here so they can be read, and tested, without vLLM:

* a lookup hit is usable up to the last whole chunk *before* the request's last token (the
  engine must compute at least one token to sample from);
* a load covers the chunks from the one holding the engine's first missing token up to the hit,
  and leaves the blocks the engine already has (its own prefix cache) alone;
* a store covers the whole chunks the engine has computed beyond what kvtrio already holds
  (lookup hits count as held), each chunk once per request.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import attrs

from ..client import LoadStoreOp

__all__ = ["RequestPlan", "Transfer", "plan_load", "plan_store", "usable_hit"]


@attrs.frozen
class Transfer:
    """One load or store the scheduler side hands to the workers for a step."""

    request_id: str
    kind: Literal["load", "store"]
    op: LoadStoreOp
    sync: bool = False
    """Loads: done before the step's forward (True) or between steps (False)."""


@attrs.define
class RequestPlan:
    """The scheduler side's record of one request."""

    request_id: str
    load: bool = True
    """Loading from kvtrio is allowed for this request."""
    save: bool = True
    """Storing into kvtrio is allowed for this request."""
    hit_tokens: int = 0
    """Usable tokens kvtrio had at lookup (a whole number of chunks)."""
    local_tokens: int = 0
    """Tokens the engine's own prefix cache had at lookup."""
    held_tokens: int = 0
    """Prefix known to be in kvtrio: lookup hits, then stores issued."""
    locked: bool = False
    """The lookup pinned chunks at kvtrio that no load has taken over yet."""
    stores: int = 0
    """Stores issued for this request (the engine must then wait for them before freeing)."""


def usable_hit(hit_tokens: int, num_tokens: int, chunk_size: int) -> int:
    """The part of a lookup hit the engine may load: whole chunks, at least one token short of
    the request's ``num_tokens``."""
    return min(hit_tokens, (num_tokens - 1) // chunk_size * chunk_size) if num_tokens > 0 else 0


def plan_load(
    plan: RequestPlan,
    *,
    tokens: Sequence[int],
    block_ids: Sequence[int],
    external_tokens: int,
    block_size: int,
    chunk_size: int,
    sync: bool,
) -> Transfer | None:
    """The load of ``external_tokens`` tokens after the engine's ``plan.local_tokens``; None
    when there is nothing to load.

    ``block_ids`` are all the request's blocks, from its first token. The load starts at the
    chunk holding the first missing token and skips the blocks before it.
    """
    if external_tokens <= 0 or plan.hit_tokens <= plan.local_tokens:
        return None
    end = min(plan.local_tokens + external_tokens, plan.hit_tokens)
    end -= end % chunk_size
    start = plan.local_tokens // chunk_size * chunk_size
    if end <= start:
        return None
    op = LoadStoreOp(
        block_ids=tuple(block_ids[: end // block_size]),
        token_ids=tuple(tokens[:end]),
        start=start,
        end=end,
        skip_first_n_tokens=plan.local_tokens - start,
    )
    return Transfer(plan.request_id, "load", op, sync=sync)


def plan_store(
    plan: RequestPlan,
    *,
    tokens: Sequence[int],
    block_ids: Sequence[int],
    computed_tokens: int,
    block_size: int,
    chunk_size: int,
) -> Transfer | None:
    """The store of the whole chunks the engine will have computed (``computed_tokens``, this
    step included) beyond ``plan.held_tokens``; None when there are none. Updates ``plan``."""
    if not plan.save:
        return None
    end = min(computed_tokens, len(tokens), len(block_ids) * block_size)
    end -= end % chunk_size
    if end <= plan.held_tokens:
        return None
    op = LoadStoreOp(
        block_ids=tuple(block_ids[: end // block_size]),
        token_ids=tuple(tokens[:end]),
        start=plan.held_tokens,
        end=end,
    )
    plan.held_tokens = end
    plan.stores += 1
    return Transfer(plan.request_id, "store", op)
