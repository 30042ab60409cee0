"""Writes: ``store`` reserves L1 slots for a worker's chunks, ``commit`` makes them visible.

A store reserves one slot per chunk that is not in L1 yet (``write``), says which ones are
``present``, ``busy`` (someone else writes it) or ``failed`` (no room), and hands the rest to the
registration's copy path (``_copy``): the worker copies and commits, or the server copies and
commits when the GPU is done. A chunk becomes visible to lookups only through a commit of this
connection's live reservation, so a failed or expired write is never read.

A store or commit of more than :data:`SLICE` chunks runs in a :class:`Later` (in the session's
order) that yields to the event loop after every :data:`SLICE` chunks (issue 22: a store of
8,192 chunks held the loop 0.5–0.7 s on a loaded machine). Each chunk's step is atomic; what a
yield lets happen in between concerns other chunks only (another writer may reserve or commit
one of the same chunks meanwhile, exactly as if it had come before or after).

With ``--l2-write-through S`` a commit's reply also waits, up to S seconds, until its chunks'
L2 writes ended (in a :class:`Later`, in the session's order: that session's next requests
wait behind it): once the worker sees its store finished, other servers sharing the L2 find
the chunks there (docs/fleet.md).
"""

from __future__ import annotations

from collections.abc import Sequence

import trio

from ...protocol import Commit, CommitReply, Slot, Store, StoreReply
from ...storage import Entry
from .._session import Session
from .._state import Later
from ._copy import Job
from ._core import L2Write
from ._io import CacheIO
from ._keys import RequestKey, checked_hashes
from ._registry import Registration

__all__ = ["SLICE", "Writes"]

SLICE = 1024
"""Chunks a store, commit or release handles between two yields to the event loop (a few ms
of work each on an idle machine, tens on a loaded one)."""


class Writes:
    """The store and commit operations."""

    def __init__(self, io: CacheIO) -> None:
        self.io = io

    def store(self, session: Session, store: Store) -> StoreReply | Later:
        """Reserve the slots now; what must wait (zeroing many bytes) is left to a Later."""
        io, core = self.io, self.io.core
        registration = core.registration(session.id)
        request, hashes, chunks = core.chunks(registration, store)
        copy = registration.copy
        blocks = copy.check(store, chunks)  # before anything is reserved
        core.admit_store(session, registration, len(chunks))
        expires = core.clock() + core.config.reservation_ttl
        parent: bytes | None = None  # the range's first chunk's parent, if the client knows it
        if store.parent_hash:
            parent = registration.space + checked_hashes((store.parent_hash,), "parent_hash")[0]
        slots: list[Slot] = []
        reserved: list[Entry] = []

        def job() -> Job:
            return Job(
                session.id,
                request,
                registration.space,
                registration.fingerprint,
                hashes,
                slots,
                blocks,
                store.event,
            )

        announcer = io.announcer
        named = store.block_hashes or store.token_ids
        if announcer is not None and registration.rank == 0 and named:
            announcer.names(
                [registration.space + h for h in hashes],
                store.block_hashes,
                registration.layout.block_size,
                store,
            )
        if len(chunks) <= SLICE:
            self._reserve(session, registration, request, chunks, hashes, parent, expires,
                          slots, reserved)  # fmt: skip
            return copy.store(job(), reserved)

        async def sliced() -> StoreReply:
            # Cancellation (the session ends): at a yield; what was reserved is the session's,
            # released with it.
            last = parent
            for first in range(0, len(chunks), SLICE):
                part, part_hashes = chunks[first : first + SLICE], hashes[first : first + SLICE]
                last = self._reserve(session, registration, request, part, part_hashes, last,
                                     expires, slots, reserved)  # fmt: skip
                await io.turn()
            reply = copy.store(job(), reserved)
            return await reply.run() if type(reply) is Later else reply  # type: ignore[return-value]

        return Later(sliced)

    def _reserve(
        self,
        session: Session,
        registration: Registration,
        request: RequestKey,
        chunks: range,
        hashes: Sequence[bytes],
        parent: bytes | None,
        expires: float,
        slots: list[Slot],
        reserved: list[Entry],
    ) -> bytes | None:
        """Reserve the slots of ``chunks`` (the core's step), appending to ``slots`` and
        ``reserved``; the chunks present already are rewritten to L2 (if they never reached
        it). Returns the last chunk's object key (the next parent)."""
        present: list[bytes] = []
        parent = self.io.core.reserve(session.id, registration, request, chunks, hashes, parent,
                                      expires, slots, reserved, present)  # fmt: skip
        if present:
            self.io.l2.writes.rewrite(present)
        return parent

    def commit(self, session: Session, commit: Commit) -> CommitReply | Later:
        """Make the ``written`` chunks visible (and queue them for L2), drop the ``failed``
        ones; a written chunk without a live reservation of this session is ``rejected``.
        More than :data:`SLICE` chunks: in a Later that yields between slices (cancellation:
        at a yield; the reservations not ended yet end with the session)."""
        io, core = self.io, self.io.core
        registration = core.registration(session.id)
        registration.copy.check_worker_end("commit")
        request = core.worker_request(registration, commit.request)
        written = checked_hashes(commit.written, "written")
        failed = checked_hashes(commit.failed, "failed")
        items = [(h, True) for h in written] + [(h, False) for h in failed]
        rejected: list[bytes] = []
        through = core.config.l2_write_through
        in_l2: list[trio.Event] | None = [] if through else None
        if len(items) <= SLICE:
            committed = self._end(session, registration, request, items, rejected, in_l2)
            if not in_l2:
                return CommitReply(committed, tuple(rejected))

            async def written_through() -> CommitReply:
                await _wait_written(in_l2, through)
                return CommitReply(committed, tuple(rejected))

            return Later(written_through)

        async def sliced() -> CommitReply:
            committed = 0
            for first in range(0, len(items), SLICE):
                part = items[first : first + SLICE]
                committed += self._end(session, registration, request, part, rejected, in_l2)
                await io.turn()
            if in_l2:
                await _wait_written(in_l2, through)
            return CommitReply(committed, tuple(rejected))

        return Later(sliced)

    def _end(
        self,
        session: Session,
        registration: Registration,
        request: RequestKey,
        items: Sequence[tuple[bytes, bool]],
        rejected: list[bytes],
        in_l2: list[trio.Event] | None = None,
    ) -> int:
        """Commit (True) or abort (False) each chunk's reservation (the core's steps); how
        many were committed. A chunk to commit without a live reservation is appended to
        ``rejected``; the committed ones go to the L2 write-behind (with write-through, each
        one's L2-written event to ``in_l2``)."""
        core = self.io.core
        committed = 0
        fingerprint = registration.fingerprint
        writes: list[L2Write] = []
        for chunk_hash, ok in items:
            object_key = registration.space + chunk_hash
            ended = core.end_write(
                session.id, request, object_key, "commit" if ok else "abort", fingerprint, writes
            )
            if ok and ended:
                committed += 1
            elif ok:
                rejected.append(chunk_hash)  # never reserved, or the reservation expired
        self.io.write_behind(writes, in_l2)
        return committed


async def _wait_written(events: Sequence[trio.Event], limit: float) -> None:
    """Wait until every chunk's L2 writes ended, for at most ``limit`` seconds (write-through:
    the commit is answered then, written or not; the writes go on). Cancellation: the wait
    ends, the writes go on."""
    with trio.move_on_after(limit):
        for written in events:
            await written.wait()
