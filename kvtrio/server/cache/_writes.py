"""Writes: ``store`` reserves L1 slots for a worker's chunks, ``commit`` makes them visible.

A store reserves one slot per chunk that is not in L1 yet (``write``), says which ones are
``present``, ``busy`` (someone else writes it) or ``failed`` (no room), and hands the rest to the
registration's copy path (``_copy``): the worker copies and commits, or the server copies and
commits when the GPU is done. A chunk becomes visible to lookups only through a commit of this
connection's live reservation, so a failed or expired write is never read.
"""

from __future__ import annotations

import trio

from ...protocol import Commit, CommitReply, Slot, Store, StoreReply
from ...storage import Entry, LeaseKind, Reservation
from .._session import Session
from .._state import Later
from ._copy import Job
from ._core import CacheCore
from ._keys import checked_hashes

__all__ = ["Writes"]


class Writes:
    """The store and commit operations."""

    def __init__(self, core: CacheCore) -> None:
        self.core = core

    def store(self, session: Session, store: Store) -> StoreReply | Later:
        """Reserve the slots now; what must wait (zeroing many bytes) is left to a Later."""
        core = self.core
        registration = core.registration(session)
        request, hashes, chunks = core.chunks(registration, store)
        copy = registration.copy
        blocks = copy.check(store, chunks)  # before anything is reserved
        core.quotas.admit(session, len(chunks), registration.chunk_bytes)
        expires = trio.current_time() + core.config.reservation_ttl
        core.limits.admit_pins(core.leases, len(chunks))
        slots = []
        reserved: list[Entry] = []
        parent: bytes | None = None  # the range's first chunk's parent, if the client knows it
        if store.parent_hash:
            parent = registration.space + checked_hashes((store.parent_hash,), "parent_hash")[0]
        for index, chunk_hash in zip(chunks, hashes, strict=True):
            object_key = registration.space + chunk_hash
            outcome = core.l1.reserve(object_key, registration.chunk_bytes, parent=parent)
            parent = object_key
            if isinstance(outcome, Entry):
                core.leases.add(LeaseKind.WRITE, request, session.id, object_key, 1, expires)
                slots.append(Slot(index, "write", core.local(outcome.offset), outcome.nbytes))
                reserved.append(outcome)
            elif outcome is Reservation.PRESENT:
                slots.append(Slot(index, "present"))
            elif outcome is Reservation.IN_PROGRESS:
                slots.append(Slot(index, "busy"))
            else:
                slots.append(Slot(index, "failed"))
        job = Job(
            session.id,
            request,
            registration.space,
            registration.fingerprint,
            hashes,
            slots,
            blocks,
            store.event,
        )
        return copy.store(job, reserved)

    def commit(self, session: Session, commit: Commit) -> CommitReply:
        """Make the ``written`` chunks visible (and queue them for L2), drop the ``failed``
        ones; a written chunk without a live reservation of this session is ``rejected``."""
        core = self.core
        registration = core.registration(session)
        registration.copy.check_worker_end("commit")
        request = core.worker_request(registration, commit.request)
        committed, rejected = 0, []
        written = checked_hashes(commit.written, "written")
        failed = checked_hashes(commit.failed, "failed")
        fingerprint = registration.fingerprint
        for chunk_hash, ok in [(h, True) for h in written] + [(h, False) for h in failed]:
            object_key = registration.space + chunk_hash
            ended = core.end_write(
                session.id, request, object_key, "commit" if ok else "abort", fingerprint
            )
            if ok and ended:
                committed += 1
            elif ok:
                rejected.append(chunk_hash)  # never reserved, or the reservation expired
        return CommitReply(committed, tuple(rejected))
