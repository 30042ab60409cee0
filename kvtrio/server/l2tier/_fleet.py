"""Fleet records: servers sharing an L2 tell each other how they name a model's chunks.

Servers of a fleet share a model's chunks only where they cut prompts the same way: the same
chunk size and the same key scheme (the hash scheme, and the engine block size in hash mode).
Otherwise a prompt stored through one server is a miss through the other, for ever; in hash
mode two chunk sizes even give one key to two objects of different sizes, which each server
then deletes as not at its size. Nothing else would tell the user why the fleet shares nothing.

So when a model is first registered on a server (per model, tenant and scheme, once per
process), the server reads the model's *fleet record* in every backend that declares
``shared_store`` (Redis, S3; not the disk L2, which is the server's own): one small object under
a key of its own (``SHA-256("kvtrio/fleet/v1" ‖ model ‖ tenant)``, 32 bytes like every object
key, never a chunk's key). Absent: it writes its own (chunk size, hash scheme, block size, its
instance and host), and reads it again :data:`VERIFY_DELAY` seconds later, so that of two
servers that started together the one whose record was overwritten finds out. Present and from
another server instance: the two are compared, and a difference is logged as a warning
(``fleet_mismatch``, naming both settings and the other server's host) and counted
(``fleet_mismatches`` in the backend's counters, so in ``/metrics``); the record is then left
as it is (the first server's settings stay the reference). Registration never waits for any of
this, and a backend that fails here counts a failure like any other call.

The record is not a kvtrio frame: a load of it as a chunk would fail verification, and no
chunk key can equal it.
"""

from __future__ import annotations

import hashlib
import logging
import socket
import struct
from collections.abc import Sequence

import attrs
import msgpack
import trio

from ..._logging import event
from ._backends import Calls, TierBackend

__all__ = ["VERIFY_DELAY", "Fleet", "FleetRecord", "record_key"]

log = logging.getLogger("kvtrio.l2")

RECORD_SIZE = 512
"""Bytes of a stored record: a 2-byte length, the msgpack map, zeros (backends load objects of
a known size only)."""
VERIFY_DELAY = 2.0
"""Seconds after writing a record before reading it back (see the module docstring)."""


def record_key(model: str, tenant: str) -> bytes:
    """The object key of a model's fleet record (32 bytes, like every object key)."""
    packed: bytes = msgpack.packb(["kvtrio/fleet/v1", model, tenant])
    return hashlib.sha256(packed).digest()


@attrs.frozen
class FleetRecord:
    """How one server names a model's chunks, and which server that is."""

    chunk_size: int
    hash_scheme: str
    block_size: int
    """The engine block size in hash mode (it decides which block ends a chunk); 0 in token
    mode."""
    instance: str
    host: str

    def pack(self) -> bytes:
        body: bytes = msgpack.packb({**attrs.asdict(self), "host": self.host[:64]})
        return (struct.pack("<H", len(body)) + body).ljust(RECORD_SIZE, b"\0")

    @classmethod
    def unpack(cls, raw: bytes) -> FleetRecord | None:
        """The record in ``raw``, or None if it is not one (another version, garbage)."""
        try:
            (length,) = struct.unpack_from("<H", raw)
            fields = msgpack.unpackb(raw[2 : 2 + length])
            return cls(**{a.name: fields[a.name] for a in attrs.fields(cls)})
        except (ValueError, TypeError, KeyError, struct.error, msgpack.UnpackException):
            return None

    def differences(self, other: FleetRecord) -> list[str]:
        """``setting: mine vs theirs`` for each naming setting that differs."""
        names = ("chunk_size", "hash_scheme", "block_size")
        return [
            f"{name} {getattr(self, name)!r} here vs {getattr(other, name)!r} there"
            for name in names
            if getattr(self, name) != getattr(other, name)
        ]


class Fleet:
    """The fleet records of one tier's backends (see the module docstring)."""

    def __init__(
        self, backends: Sequence[TierBackend], calls: Calls, *, chunk_size: int, instance: str
    ) -> None:
        self.backends = backends
        self._calls = calls
        self.chunk_size = chunk_size
        self.instance = instance
        self.host = socket.gethostname()
        self.nursery: trio.Nursery | None = None
        """Where the checks run; set by the tier while it serves."""
        self._seen: set[tuple[str, str, str, int]] = set()
        self.verify_delay = VERIFY_DELAY

    def announce(self, model: str, tenant: str, hash_scheme: str, block_size: int) -> None:
        """A worker registered ``model``: check (once per model, tenant and scheme in this
        process) the model's record in every backend, in a task; never waits."""
        seen = (model, tenant, hash_scheme, block_size)
        if self.nursery is None or not self.backends or seen in self._seen:
            return
        self._seen.add(seen)
        mine = FleetRecord(self.chunk_size, hash_scheme, block_size, self.instance, self.host)
        for tier_backend in self.backends:
            if tier_backend.capabilities.shared:
                self.nursery.start_soon(self._check, tier_backend, model, tenant, mine)

    async def _check(
        self, tier_backend: TierBackend, model: str, tenant: str, mine: FleetRecord
    ) -> None:
        """Read the record; write ours where there is none and read it back later; report a
        difference. Cancellation (the server stops): the check is abandoned."""
        key = record_key(model, tenant)
        theirs = await self._read(tier_backend, key)
        if theirs is None:
            if not await self._write(tier_backend, key, mine):
                return
            await trio.sleep(self.verify_delay)
            theirs = await self._read(tier_backend, key)
            if theirs is None:
                return
        if theirs.instance == self.instance:
            return
        differences = mine.differences(theirs)
        if not differences:
            return
        tier_backend.count("fleet_mismatches")
        text = "; ".join(differences)
        log.warning(
            "L2 backend %s is shared with a server that names model %r's chunks otherwise "
            "(%s; that server runs on %s): prompts stored through one are never hits through "
            "the other. Give every server of the fleet the same --chunk-size and the engines "
            "the same hash scheme and block size",
            tier_backend.name,
            model,
            text,
            theirs.host,
            extra=event(
                "fleet_mismatch",
                backend=tier_backend.label,
                model=model,
                differences=text,
                other_host=theirs.host,
                other_instance=theirs.instance,
            ),
        )

    async def _read(self, tier_backend: TierBackend, key: bytes) -> FleetRecord | None:
        """The record under ``key``, or None (absent, unreadable, or the backend failed)."""
        buffer = bytearray(RECORD_SIZE)
        with self._calls.call(tier_backend, "fleet_read", metered=False) as call:
            found = await tier_backend.backend.load([key], [[memoryview(buffer)]])
        if call.failed or not found or not found[0]:
            return None
        return FleetRecord.unpack(bytes(buffer))

    async def _write(self, tier_backend: TierBackend, key: bytes, record: FleetRecord) -> bool:
        """Store ``record`` under ``key``; whether it was stored."""
        with self._calls.call(tier_backend, "fleet_write", "store", metered=False) as call:
            stored = await tier_backend.store([key], [[memoryview(record.pack())]], parents=[None])
        return not call.failed and bool(stored and stored[0])
