"""Copy paths: how a registered worker's chunks move between its engine and L1.

A worker registers with ``device`` ``cpu`` or ``cuda``, and its registration keeps the copy path
chosen then (:attr:`Registration.copy <._registry.Registration.copy>`). The store and retrieve
operations do the same for both — check the range, reserve or pin the slots — and hand the
rest to the path, through :class:`CopyPath`:

- :class:`HostCopy` (``cpu``): the *worker* copies, through the shared L1 arena. The server
  hands out slots; a store's slots are zeroed first (an unwritten slot never shows a previous
  chunk); the worker's ``commit`` and ``release`` end the leases.
- :class:`~._cuda_copy.CudaCopy` (``cuda``): the *server* copies, by CUDA IPC, and ends the
  leases itself when the GPU is done (commit or quarantine, unpin).

Why not :class:`kvtrio.transfer.Transfer`: that interface copies one chunk between an engine's
layers and a host buffer and returns when the bytes are there. On the server, the host path
copies nothing, and the CUDA path must not wait in the event loop: it queues an operation's
chunks behind the engine's event and learns of their end from the watcher
(``_cuda.CudaTransfers``). What the operations need is who copies and how the operation's
leases end, which is this interface; the CUDA path uses the same pipeline as ``Transfer``'s
CUDA engine underneath.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, Protocol

import attrs

from ...protocol import Retrieve, RetrieveReply, Slot, Store, StoreReply
from ...shm import SharedArena
from ...storage import Entry
from .._state import Later
from ._keys import RequestKey, WriteEnd
from ._scrub import Scrubber

__all__ = ["NO_BLOCKS", "Blocks", "CopyPath", "HostCopy", "Job", "LeaseEnds", "WriteEnd"]

Blocks = Sequence[Sequence[int]]
"""Per chunk of an operation, the engine blocks the server copies (empty for a worker that
copies itself)."""
NO_BLOCKS: Blocks = ()


@attrs.frozen
class Job:
    """One store's or retrieve's chunks as the copy path gets them, slots decided."""

    owner: str
    """The session that holds the operation's leases."""
    request: RequestKey
    space: bytes
    """The namespace of the registration's objects."""
    fingerprint: bytes
    """The registration's profile digest (committed chunks carry it to L2)."""
    hashes: Sequence[bytes]
    """The chunk hashes of ``slots``, in order (``hashes[i]`` is chunk ``slots[0].chunk + i``)."""
    slots: Sequence[Slot]
    blocks: Blocks
    """From :meth:`CopyPath.check`."""
    event: bytes
    """The engine's event the copies must wait for (server-side copies only)."""

    def object_keys(self, status: str) -> tuple[list[Slot], list[bytes]]:
        """The slots with ``status`` and the keys of their objects."""
        first = self.slots[0].chunk if self.slots else 0
        slots = [slot for slot in self.slots if slot.status == status]
        return slots, [self.space + self.hashes[slot.chunk - first] for slot in slots]


class LeaseEnds(Protocol):
    """How the leases of one operation end (implemented by the cache core; used by the commit
    and release operations, and by a copy path that copies on the server)."""

    def end_write(
        self, owner: str, request: RequestKey, object_key: bytes, how: WriteEnd, fingerprint: bytes
    ) -> bool:
        """End ``owner``'s write reservation of ``object_key`` for ``request``; False if there
        is none (never reserved, expired, or its session ended)."""
        ...

    def end_reads(self, owner: str, request: RequestKey, object_keys: Sequence[bytes]) -> int:
        """Unpin ``owner``'s read pins of ``object_keys`` for ``request`` that still exist;
        returns how many."""
        ...


class CopyPath(Protocol):
    """Who copies a registration's chunks, and how its stores and retrieves end."""

    copies_on_server: bool
    """Whether the server writes the L1 slots itself: when the registration goes, its
    reservations are quarantined (a copy may still be writing them), even on a clean
    unregister."""

    def check(self, op: Store | Retrieve, chunks: range) -> Blocks:
        """Check the operation's copy arguments before anything is reserved or pinned
        (``RequestError`` if one is wrong); what :attr:`Job.blocks` will be."""
        ...

    def check_worker_end(self, op: Literal["commit", "release"]) -> None:
        """``RequestError`` if the worker may not end its copies itself with ``op`` (the
        server ends them when its own copies are done)."""
        ...

    def store(self, job: Job, reserved: Sequence[Entry]) -> StoreReply | Later:
        """The reply to a store whose ``write`` slots are reserved (``reserved``)."""
        ...

    def retrieve(self, job: Job) -> RetrieveReply:
        """The reply to a retrieve whose ``read`` slots are pinned."""
        ...

    def close(self) -> None:
        """The registration is gone: release what the path holds (once its copies are done)."""
        ...


class HostCopy:
    """The worker copies through the shared arena (see the module doc). One per server."""

    copies_on_server = False

    def __init__(self, arena: SharedArena, reservation_ttl: float) -> None:
        self._scrub = Scrubber(arena)
        self._reservation_ttl = reservation_ttl

    def check(self, op: Store | Retrieve, chunks: range) -> Blocks:
        return NO_BLOCKS

    def check_worker_end(self, op: Literal["commit", "release"]) -> None:
        return None  # the worker copies, so it says when they are done

    def store(self, job: Job, reserved: Sequence[Entry]) -> StoreReply | Later:
        """Zero the reserved slots, inline if they are few enough, else in a :class:`Later`
        (a worker thread; cancellation: see :meth:`~._scrub.Scrubber.in_thread`)."""
        reply = StoreReply(tuple(job.slots), self._reservation_ttl)
        if self._scrub.now(reserved):  # an unwritten slot never shows a previous chunk
            return reply

        async def scrubbed() -> StoreReply:
            await self._scrub.in_thread(reserved)
            return reply

        return Later(scrubbed)

    def retrieve(self, job: Job) -> RetrieveReply:
        return RetrieveReply(tuple(job.slots))

    def close(self) -> None:
        pass
