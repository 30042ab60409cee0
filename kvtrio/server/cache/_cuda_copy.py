"""The CUDA copy path: the server copies a CUDA worker's chunks by IPC (see ``_copy``).

A store's ``write`` slots and a retrieve's ``read`` slots take the same path: their engine
blocks and slots are queued on the GPU behind the engine's event (``CudaTransfers.submit``), the
reply carries the server's done event, and the operation's leases end when the watcher sees
that event complete — a store's chunks are committed then (or quarantined if the copy failed),
a retrieve's pins released then. Nothing waits for the GPU in the event loop.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal

from ...errors import ErrorCode, RequestError
from ...protocol import Retrieve, RetrieveReply, Slot, Store, StoreReply
from ...storage import Entry
from ...transfer import KVLayout
from ._copy import Blocks, Job, LeaseEnds
from ._cuda import CudaRegistration, CudaTransfers

__all__ = ["CudaCopy"]


class CudaCopy:
    """The copy path of one CUDA worker's registration (its IPC handles are open)."""

    copies_on_server = True

    def __init__(
        self,
        transfers: CudaTransfers,
        opened: CudaRegistration,
        ends: LeaseEnds,
        *,
        chunk_size: int,
        reservation_ttl: float,
    ) -> None:
        self._transfers = transfers
        self._opened = opened
        self._ends = ends
        self._layout: KVLayout = opened.layout
        self._chunk_size = chunk_size
        self._reservation_ttl = reservation_ttl

    def check_worker_end(self, op: Literal["commit", "release"]) -> None:
        """Refused: the server commits and releases a CUDA worker's chunks when its own copies
        are done; a worker's ``commit`` would make a slot visible under a queued copy, its
        ``release`` unpin one a queued copy still reads."""
        raise RequestError(
            ErrorCode.BAD_REQUEST,
            f"'{op}' is not for CUDA workers: the server {op}s their chunks itself once its "
            "copies are done",
        )

    def check(self, op: Store | Retrieve, chunks: range) -> Blocks:
        """The engine blocks of each chunk of a store or retrieve, checked: ints in
        ``[-1, num_blocks)``. A retrieve may name -1 anywhere (a block the engine keeps), and
        its blocks must differ. A store may name -1 only for the trailing blocks of its last
        chunk, after at least one real block: the prompt's partial chunk, whose slot the
        kernel fills with zeros after its blocks (a chunk of nothing, or with a hole, would be
        stored as if the engine had computed it)."""
        store = isinstance(op, Store)
        per_chunk = self._chunk_size // self._layout.block_size
        ids = op.block_ids
        if len(ids) < len(chunks) * per_chunk:
            raise RequestError(
                ErrorCode.BAD_REQUEST,
                f"block_ids: {len(chunks)} chunks of {per_chunk} blocks need "
                f"{len(chunks) * per_chunk} block ids, got {len(ids)}",
            )
        used = list(ids[: len(chunks) * per_chunk])
        num_blocks = self._layout.num_blocks
        if any(type(b) is not int or not -1 <= b < num_blocks for b in used):
            raise RequestError(
                ErrorCode.BAD_REQUEST,
                f"block_ids must be ints in [-1, {num_blocks})"
                + (" (-1: a partial chunk's tail)" if store else " (-1: a block the engine keeps)"),
            )
        if store:
            tail = used.index(-1) if -1 in used else len(used)  # where the zeros start
            if tail <= len(used) - per_chunk or any(b != -1 for b in used[tail:]):
                raise RequestError(
                    ErrorCode.BAD_REQUEST,
                    "block_ids of a store may be -1 only for the trailing blocks of its last "
                    "chunk (a partial chunk), after at least one block",
                )
        else:
            named = [b for b in used if b >= 0]
            if len(set(named)) != len(named):
                raise RequestError(ErrorCode.BAD_REQUEST, "block_ids of a retrieve must differ")
        return [used[i * per_chunk : (i + 1) * per_chunk] for i in range(len(chunks))]

    def store(self, job: Job, reserved: Sequence[Entry]) -> StoreReply:
        """Queue the GPU → L1 copies of the ``write`` slots; commit them once they are done
        (quarantine them if the copies failed). No zeroing here: the GPU writes every byte of
        each slot (zeros for a partial chunk's blocks -1), and only what it wrote is
        committed."""
        end_write, owner, request = self._ends.end_write, job.owner, job.request
        fingerprint = job.fingerprint

        def complete(object_keys: Sequence[bytes], ok: bool) -> None:
            # A lease that is gone expired or its session ended: quarantined, never committed.
            for object_key in object_keys:
                end_write(owner, request, object_key, "commit" if ok else "quarantine", fingerprint)

        def not_queued(object_keys: Sequence[bytes]) -> None:
            for object_key in object_keys:
                end_write(owner, request, object_key, "abort", fingerprint)

        slots, done = self._submit(job, "write", complete, not_queued, store=True)
        return StoreReply(tuple(slots), self._reservation_ttl, done_event=done)

    def retrieve(self, job: Job) -> RetrieveReply:
        """Queue the L1 → GPU copies of the ``read`` slots; unpin them once they are done."""
        end_reads, owner, request = self._ends.end_reads, job.owner, job.request

        def complete(object_keys: Sequence[bytes], ok: bool) -> None:
            end_reads(owner, request, object_keys)

        def not_queued(object_keys: Sequence[bytes]) -> None:
            end_reads(owner, request, object_keys)  # nothing was queued: unpin now

        slots, done = self._submit(job, "read", complete, not_queued, store=False)
        return RetrieveReply(tuple(slots), done_event=done)

    def _submit(
        self,
        job: Job,
        status: str,
        complete: Callable[[Sequence[bytes], bool], None],
        not_queued: Callable[[Sequence[bytes]], None],
        *,
        store: bool,
    ) -> tuple[Sequence[Slot], bytes]:
        """Queue the copies of ``job``'s ``status`` slots; ``complete(keys, ok)`` runs when they
        are done. Returns the reply's slots and done event: the slots turn ``failed`` if
        queueing failed halfway (``complete(keys, False)`` then runs later, after what is
        already queued). A ``RequestError`` (nothing queued) runs ``not_queued(keys)`` first."""
        moving, object_keys = job.object_keys(status)
        if not moving:
            return job.slots, b""
        first = job.slots[0].chunk
        chunks = [(job.blocks[s.chunk - first], s.offset, s.nbytes) for s in moving]
        try:
            done = self._transfers.submit(
                self._opened,
                chunks,
                job.event,
                lambda ok: complete(object_keys, ok),
                store=store,
            )
        except RequestError:
            not_queued(object_keys)
            raise
        if not done:  # queueing failed: nothing of it lands (the engine recomputes those)
            return [Slot(s.chunk, "failed") if s.status == status else s for s in job.slots], b""
        return job.slots, done

    def close(self) -> None:
        """Close the IPC handles once the copies queued so far are done."""
        self._transfers.close(self._opened)
