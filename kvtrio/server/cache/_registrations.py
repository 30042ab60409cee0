"""Registrations: a worker says which KV cache it holds, and gets its copy path.

``register`` checks the shapes (``_limits``), opens the tenant's L1 arena (claimed until the
worker is recorded: an idle tenant's arena may be renewed for another, see ``_tenants``),
records the worker in the registry (which refuses a profile its engine's other workers
disagree with) and chooses the copy path once: the host path (the worker copies through the
shared arena), or for a ``cuda`` worker the CUDA path, after its layers' IPC handles are
checked and opened (``_cuda``). A re-registration first drops the session's previous one;
``unregister`` and the session's end drop it (see :meth:`~._io.CacheIO.release_session`).
"""

from __future__ import annotations

import logging

from ..._logging import event
from ...protocol import Register, Registered, Released, Unregister
from ...shm import SharedArena
from ...transfer import KVLayout
from .._session import Session
from ._copy import CopyPath, HostCopy
from ._cuda import CudaTransfers
from ._cuda_copy import CudaCopy
from ._io import CacheIO
from ._limits import check_registration

__all__ = ["Registrations"]

log = logging.getLogger("kvtrio.cache")


class Registrations:
    """The register and unregister operations."""

    def __init__(self, io: CacheIO, cuda: CudaTransfers) -> None:
        self.io = io
        self.cuda = cuda
        self.host_copy = HostCopy(io.core.arenas.memory, io.config.reservation_ttl)

    async def register(self, session: Session, register: Register) -> Registered:
        """Record the worker's registration (replacing the session's previous one) with its
        copy path, chosen before it is recorded.

        Cancellation: while the CUDA handles open, they finish opening and are closed again;
        the registration is then not recorded.
        """
        io, core = self.io, self.io.core
        config = core.config
        check_registration(register, config.chunk_size, core.arenas.arena_size)
        async with core.arenas.opened(register.tenant, core.arena_idle) as tenant_arena:
            released = await io.release_session(session.id, quarantine=False)
            layout, _profile, chunk_bytes = core.registry.check(register)
            copy: CopyPath = self.host_copy
            if register.device == "cuda":
                tenant_arena.keep = True  # its mapping is pinned for GPU copies: never renewed
                copy = await self._cuda_path(register, layout, chunk_bytes, tenant_arena.arena)
            try:
                # (checked again: other workers may have registered while the handles opened)
                registration = core.registry.register(session.id, register, copy)
            except BaseException:
                copy.close()
                raise
            core.arenas.bind(registration.space, tenant_arena)
        if io.announcer is not None and register.rank == 0:
            # Rank 0's chunks stand for the engine's in KV events (every rank stores its own
            # part of each chunk; a router needs one name per chunk, not one per rank).
            io.announcer.announce_space(registration.space, register.tenant)
        profile = registration.profile
        io.l2.fleet.announce(
            register.model, register.tenant, profile.hash_scheme, profile.block_size
        )
        io.watch(session)
        log.info(
            "session %s registered %s rank %d/%d (%s, %s)%s",
            session.id,
            register.model,
            register.rank,
            register.world_size,
            register.layout.kind,
            register.layout.dtype,
            f", replacing its registration ({released} released)" if released else "",
            extra=event(
                "registration",
                session=session.id,
                model=register.model,
                rank=register.rank,
                world_size=register.world_size,
                layout=register.layout.kind,
                dtype=register.layout.dtype,
            ),
        )
        return Registered(
            chunk_size=config.chunk_size,
            arena_path=tenant_arena.arena.path,  # its own tenant's arena, never another's
            arena_size=tenant_arena.arena.size,
            chunk_bytes=registration.chunk_bytes,
            reservation_ttl=config.reservation_ttl,
            pin_ttl=config.pin_ttl,
        )

    async def _cuda_path(
        self, register: Register, layout: KVLayout, chunk_bytes: int, arena: SharedArena
    ) -> CopyPath:
        """Open a CUDA worker's layers (``RequestError`` says what is wrong) and its path, with
        the slots in its tenant's ``arena``."""
        opened = await self.cuda.open(register.cuda, layout, chunk_bytes, arena)
        config = self.io.config
        return CudaCopy(
            self.cuda,
            opened,
            self.io,
            chunk_size=config.chunk_size,
            reservation_ttl=config.reservation_ttl,
        )

    async def unregister(self, session: Session, unregister: Unregister) -> Released:
        """Drop the session's registration and everything it holds."""
        return Released(await self.io.release_session(session.id, quarantine=False))
