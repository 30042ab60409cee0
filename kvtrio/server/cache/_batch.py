"""The ``lookup_batch`` operation: the lookups of many requests of one scheduler in one message.

A scheduler facing a burst of new requests sends their lookups together: one message to
decode, one scheduling round, one reply, instead of one of each per request. Every lookup of
the batch is handled as its own ``lookup`` would be (same handler, same pins, same limits),
in order; a lookup that fails is reported in the reply, the others still answer. The L2 parts
of the lookups (a :class:`Later` each) run concurrently, and the reply waits for all of them.
"""

from __future__ import annotations

from collections.abc import Callable

import trio

from ...errors import ProtocolError, RequestError
from ...protocol import Lookup, LookupBatch, LookupBatchReply, LookupFailure, LookupReply
from .._session import Session
from .._state import Later, ServerState

__all__ = ["register_lookup_batch"]

LookupHandler = Callable[[Session, Lookup], "LookupReply | Later"]


def register_lookup_batch(state: ServerState, lookup: LookupHandler) -> None:
    """Serve ``lookup_batch`` with the handler of ``lookup`` (inline, L2 parts concurrent)."""

    def lookup_batch(session: Session, request: LookupBatch) -> LookupBatchReply | Later:
        try:
            lookups = request.lookups()
        except ValueError as exc:
            raise ProtocolError(f"invalid 'lookup_batch' request: {exc}") from None
        batch = _Answers(len(lookups))
        later: list[tuple[int, Later]] = []
        for index, item in enumerate(lookups):
            try:
                result = lookup(session, item)
            except RequestError as exc:
                batch.fail(index, exc)
                continue
            if type(result) is Later:
                later.append((index, result))
            else:
                batch.answer(index, result)  # type: ignore[arg-type]
        if not later:
            return batch.reply()
        return Later(lambda: batch.finish(later))

    state.register_inline(LookupBatch, lookup_batch, concurrent=True)


class _Answers:
    """The answers of one batch as they come."""

    def __init__(self, size: int) -> None:
        self.hit_tokens = [0] * size
        self.hit_chunks = [0] * size
        self.failed: list[LookupFailure] = []

    def answer(self, index: int, reply: LookupReply) -> None:
        self.hit_tokens[index] = reply.hit_tokens
        self.hit_chunks[index] = reply.hit_chunks

    def fail(self, index: int, error: RequestError) -> None:
        self.failed.append(LookupFailure(index, error.code.value, error.message))

    def reply(self) -> LookupBatchReply:
        failed = tuple(sorted(self.failed, key=lambda failure: failure.index))
        return LookupBatchReply(tuple(self.hit_tokens), tuple(self.hit_chunks), failed)

    async def finish(self, later: list[tuple[int, Later]]) -> LookupBatchReply:
        """Run the lookups' L2 parts concurrently; the reply once all have answered.

        Cancellation (the session ends): cancels them all.
        """

        async def one(index: int, part: Later) -> None:
            try:
                reply = await part.run()
            except RequestError as exc:
                self.fail(index, exc)
                return
            self.answer(index, reply)  # type: ignore[arg-type]

        async with trio.open_nursery() as nursery:
            for index, part in later:
                nursery.start_soon(one, index, part)
        return self.reply()
