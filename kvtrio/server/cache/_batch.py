"""The ``lookup_batch`` operation: the lookups of many requests of one scheduler in one message.

A scheduler facing a burst of new requests sends their lookups together: one message to
decode, one scheduling round, one reply, instead of one of each per request. Every lookup of
the batch is handled as its own ``lookup`` would be (same handler, same pins, same limits),
in order; a lookup that fails (its hashes malformed, a limit reached) is reported in the reply
with its index, the others still answer. The L2 parts of the lookups (a :class:`Later` each)
run concurrently, at most :data:`L2_PARTS` of a batch at once, and the reply waits for all.

Bounded work (issue 22): the keys of the whole batch (``world_size`` × hashes, summed) are
checked against ``MAX_LOOKUP_KEYS`` and the session's budget before any lookup runs; a batch
of more than :data:`SLICE_KEYS` keys runs its lookups in a task that yields to the event loop
after every :data:`SLICE_KEYS` keys (a lookup's first slice at once, as a lookup sent alone).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import trio

from ...errors import ProtocolError, RequestError
from ...protocol import Lookup, LookupBatch, LookupBatchReply, LookupFailure, LookupReply
from .._session import Session
from .._state import Later, ServerState
from ._core import SLICE_KEYS
from ._limits import KeyBudget, check_lookup_keys

__all__ = ["L2_PARTS", "SLICE_KEYS", "register_lookup_batch"]

LookupHandler = Callable[[Session, Lookup], "LookupReply | Later"]
Turn = Callable[[], Awaitable[None]]
checkpoint: Turn = trio.lowlevel.checkpoint

L2_PARTS = 8
"""L2 parts of one batch's lookups running at once (each asks the backends for its ranks' chunks):
a batch of 1,024 lookups does not make 1,024 runnable tasks at once."""


def register_lookup_batch(
    state: ServerState,
    lookup: LookupHandler,
    budget: KeyBudget | None = None,
    turn: Turn = checkpoint,
) -> None:
    """Serve ``lookup_batch`` with the handler of ``lookup`` (inline, L2 parts concurrent);
    ``budget``: the keys in flight of each session, checked for the whole batch first;
    ``turn``: awaited between the slices of a big batch."""

    def lookup_batch(session: Session, message: LookupBatch) -> LookupBatchReply | Later:
        try:
            lookups = message.lookups()
        except ValueError as exc:
            raise ProtocolError(f"invalid 'lookup_batch' request: {exc}") from None
        hashes = sum(len(h) for h in message.chunk_hashes if type(h) is tuple)
        keys = check_lookup_keys(message.world_size, hashes)  # the batch's, before any work
        if budget is not None:
            budget.check(session.id, session.principal.user_id, keys)
        batch = _Batch(lookup, session, len(lookups), turn)
        if keys > SLICE_KEYS:
            return Later(lambda: batch.run_sliced(lookups))
        later = [part for index, item in enumerate(lookups) if (part := batch.run(index, item))]
        if not later:
            return batch.reply()  # small: answered inline
        return Later(lambda: batch.finish(later))

    state.register_inline(LookupBatch, lookup_batch, concurrent=True)


class _Batch:
    """One batch's lookups and their answers as they come."""

    def __init__(
        self, lookup: LookupHandler, session: Session, size: int, turn: Turn = checkpoint
    ) -> None:
        self.lookup = lookup
        self.turn = turn
        """Awaited between slices (the cache's :meth:`~._io.CacheIO.turn`)."""
        self.session = session
        self.hit_tokens = [0] * size
        self.hit_chunks = [0] * size
        self.l1_chunks = [0] * size
        self.failed: list[LookupFailure] = []

    def run(self, index: int, item: Lookup) -> tuple[int, Later] | None:
        """Run lookup ``index`` of the batch; its L2 part, if it has one."""
        try:
            result = self.lookup(self.session, item)
        except RequestError as exc:
            self.fail(index, exc)
            return None
        if type(result) is Later:
            return index, result
        self.answer(index, result)  # type: ignore[arg-type]
        return None

    async def run_sliced(self, lookups: list[Lookup]) -> LookupBatchReply:
        """Run the lookups in order, yielding after every :data:`SLICE_KEYS` keys; then their
        L2 parts. Cancellation (the session ends): at a yield; the lookups not run yet are not
        run (those that ran hold their pins until their request or session ends).
        """
        later: list[tuple[int, Later]] = []
        done = 0
        try:
            for index, item in enumerate(lookups):
                part = self.run(index, item)
                if part is not None:
                    later.append(part)
                if type(item.chunk_hashes) is tuple:
                    done += len(item.chunk_hashes) * item.world_size
                if done >= SLICE_KEYS:
                    done = 0
                    await self.turn()
        except BaseException:
            for _, dropped in later:  # (their keys go back to the budget)
                if dropped.abandon is not None:
                    dropped.abandon()
            raise
        if not later:
            return self.reply()
        return await self.finish(later)

    def answer(self, index: int, reply: LookupReply) -> None:
        self.hit_tokens[index] = reply.hit_tokens
        self.hit_chunks[index] = reply.hit_chunks
        self.l1_chunks[index] = reply.l1_chunks

    def fail(self, index: int, error: RequestError) -> None:
        self.failed.append(LookupFailure(index, error.code.value, error.message))

    def reply(self) -> LookupBatchReply:
        failed = tuple(sorted(self.failed, key=lambda failure: failure.index))
        return LookupBatchReply(
            tuple(self.hit_tokens), tuple(self.hit_chunks), failed, tuple(self.l1_chunks)
        )

    async def finish(self, later: list[tuple[int, Later]]) -> LookupBatchReply:
        """Run the lookups' L2 parts concurrently, :data:`L2_PARTS` at a time; the reply once
        all have answered.

        Cancellation (the session ends): cancels them all (a part that had not started is
        abandoned: its keys go back to the budget).
        """
        limiter = trio.CapacityLimiter(L2_PARTS)

        async def one(index: int, part: Later) -> None:
            try:
                async with limiter:
                    reply = await part.run()
            except RequestError as exc:
                self.fail(index, exc)
                return
            finally:
                if part.abandon is not None:
                    part.abandon()
            self.answer(index, reply)  # type: ignore[arg-type]

        async with trio.open_nursery() as nursery:
            for index, part in later:
                nursery.start_soon(one, index, part)
        return self.reply()
