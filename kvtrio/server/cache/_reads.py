"""Reads: ``retrieve`` pins a worker's chunks in L1 and says where they are, ``release`` unpins.

A retrieve takes its own read pin of each chunk before it consumes the lookup's pin, so a chunk
never drops to zero pins in between. Chunks still loading from L2 (started by the lookup) are
waited for, within a deadline that the retrieves of one request share while its loads last; a
``partial`` retrieve waits only for its first chunk and answers the chunks still loading after
the ready ones as ``loading`` (the worker asks again for those, copying the rest meanwhile).
What follows the pins is the registration's copy path (``_copy``).
"""

from __future__ import annotations

from collections.abc import Sequence

import trio

from ...protocol import Release, Released, Retrieve, RetrieveReply, Slot
from .._session import Session
from .._state import Later
from ._copy import Blocks, Job
from ._io import CacheIO
from ._keys import RequestKey, checked_hashes
from ._registry import Registration
from ._writes import SLICE

__all__ = ["Reads"]


class Reads:
    """The retrieve and release operations."""

    def __init__(self, io: CacheIO) -> None:
        self.io = io

    def retrieve(self, session: Session, retrieve: Retrieve) -> RetrieveReply | Later:
        """Pin and answer the slots now; waiting for the chunks' L2 loads is left to a Later.

        A ``partial`` retrieve waits only for its first chunk's load and answers the chunks
        still loading after the ready ones as ``loading`` (see :meth:`_read`). Cancellation of
        the Later (the session ends): nothing is pinned yet; the loads go on for the request.
        """
        io, core = self.io, self.io.core
        io.settle_copies()
        registration = core.registration(session.id)
        request, hashes, chunks = core.chunks(registration, retrieve)
        blocks = registration.copy.check(retrieve, chunks)  # before anything is pinned
        keys = [registration.space + h for h in hashes]
        announcer = io.announcer
        named = retrieve.block_hashes or retrieve.token_ids
        if announcer is not None and registration.rank == 0 and named:
            # (names a chunk that an earlier server left in L2 is known by here)
            announcer.names(keys, retrieve.block_hashes, registration.layout.block_size, retrieve)
        pending = io.prefetch.pending(request, keys[:1] if retrieve.partial else keys)
        if not pending:
            return self._read(session, registration, retrieve, request, hashes, chunks, blocks)
        # L2 → L1 loads started by the lookup: wait for them, within the deadline, which the
        # retrieves of this request share while its loads last (a worker may split one
        # operation into several retrieves: they wait once, not once each).
        deadline = io.prefetch.wait_deadline(
            request, registration.space, trio.current_time() + core.config.retrieve_timeout
        )

        async def loaded() -> RetrieveReply:
            with trio.move_on_at(deadline):
                for load in pending:
                    await load.done.wait()
            return self._read(session, registration, retrieve, request, hashes, chunks, blocks)

        return Later(loaded)

    def _loading_from(self, request: RequestKey, keys: Sequence[bytes], space: bytes) -> int:
        """A partial retrieve's answer: the index of its first chunk whose load is still
        running (``len(keys)`` if none is, or once the request's wait is over)."""
        prefetch = self.io.prefetch
        deadline = prefetch.deadline(request, space)
        if deadline is not None and trio.current_time() >= deadline:
            return len(keys)
        for index, object_key in enumerate(keys):
            if prefetch.pending(request, [object_key]):
                return index
        return len(keys)

    def _read(
        self,
        session: Session,
        registration: Registration,
        retrieve: Retrieve,
        request: RequestKey,
        hashes: Sequence[bytes],
        chunks: range,
        blocks: Blocks,
    ) -> RetrieveReply:
        """Pin the chunks of a retrieve that are in L1 (consuming the lookup's pins). A partial
        retrieve answers ``loading`` from its first chunk still loading on (not pinned)."""
        io, core = self.io, self.io.core
        reading = [registration.space + h for h in hashes]
        ready = len(reading)
        if retrieve.partial and io.prefetch.pending_count:
            ready = self._loading_from(request, reading, registration.space)
        reading, hashes = reading[:ready], hashes[:ready]
        core.admit_reads(session, reading, registration.chunk_bytes)
        slots = core.pin_reads(session.id, request, chunks, reading)
        slots += [Slot(index, "loading") for index in chunks[ready:]]
        job = Job(
            session.id,
            request,
            registration.space,
            registration.fingerprint,
            hashes,
            slots,
            blocks,
            retrieve.event,
        )
        return registration.copy.retrieve(job)

    def release(self, session: Session, release: Release) -> Released | Later:
        """Unpin this session's read pins of the named chunks (a worker's copies are done).
        More than :data:`SLICE` chunks: in a Later that yields between slices (issue 22;
        cancellation: at a yield, the pins not ended yet end with the session)."""
        io, core = self.io, self.io.core
        registration = core.registration(session.id)
        registration.copy.check_worker_end("release")
        request = core.worker_request(registration, release.request)
        object_keys = [
            registration.space + h for h in checked_hashes(release.chunk_hashes, "chunk_hashes")
        ]
        if len(object_keys) <= SLICE:
            return Released(core.end_reads(session.id, request, object_keys))

        async def sliced() -> Released:
            released = 0
            for first in range(0, len(object_keys), SLICE):
                released += core.end_reads(session.id, request, object_keys[first : first + SLICE])
                await io.turn()
            return Released(released)

        return Later(sliced)
