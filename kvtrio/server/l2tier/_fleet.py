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

What the server remembers of this is bounded (issue 32: with any L2, 800 registrations of
distinct 1 MiB model names kept 800 MB for the server's life): the models already checked are
kept as 32-byte digests, the latest :data:`MAX_SEEN` of them (a model forgotten is checked again
at its next registration: one more read of its record), and at most :data:`MAX_CHECKS` checks
run at once (a registration beyond them is not checked, logged once a minute).

The record is not a kvtrio frame: a load of it as a chunk would fail verification, and no
chunk key can equal it.
"""

from __future__ import annotations

import collections
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
MAX_SEEN = 4096
"""Models (with tenant and scheme) remembered as checked: a fleet serves a few dozen."""
MAX_CHECKS = 64
"""Checks of models' records running at once (each reads, maybe writes and reads again)."""
_SKIP_LOG_INTERVAL = 60.0


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
        self,
        backends: Sequence[TierBackend],
        calls: Calls,
        tasks: trio.Nursery,
        *,
        chunk_size: int,
        instance: str,
    ) -> None:
        """``tasks``: the tier's nursery, where the checks run."""
        self.backends = backends
        self._calls = calls
        self.chunk_size = chunk_size
        self.instance = instance
        self.host = socket.gethostname()
        self._tasks = tasks
        self._seen: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        """Digests of the (model, tenant, scheme, block size) checked, oldest first."""
        self.checks = 0
        """Checks running now (at most :data:`MAX_CHECKS`)."""
        self.skipped = 0
        """Registrations not checked because :data:`MAX_CHECKS` were running."""
        self._skip_logged = -_SKIP_LOG_INTERVAL
        self.verify_delay = VERIFY_DELAY

    def announce(self, model: str, tenant: str, hash_scheme: str, block_size: int) -> None:
        """A worker registered ``model``: check (once per model, tenant and scheme in this
        process) the model's record in every backend, in a task; never waits."""
        if not self.backends:
            return
        seen = hashlib.sha256(msgpack.packb([model, tenant, hash_scheme, block_size])).digest()
        if seen in self._seen:
            self._seen.move_to_end(seen)
            return
        shared = [b for b in self.backends if b.capabilities.shared]
        if self.checks + len(shared) > MAX_CHECKS:
            self._skip(model)
            return  # (not remembered: its next registration is checked)
        self._seen[seen] = None
        if len(self._seen) > MAX_SEEN:
            self._seen.popitem(last=False)
        mine = FleetRecord(self.chunk_size, hash_scheme, block_size, self.instance, self.host)
        for tier_backend in shared:
            self.checks += 1
            self._tasks.start_soon(self._counted_check, tier_backend, model, tenant, mine)

    def _skip(self, model: str) -> None:
        self.skipped += 1
        now = trio.current_time()
        if now - self._skip_logged < _SKIP_LOG_INTERVAL:
            return
        self._skip_logged = now
        log.warning(
            "%d fleet record checks are running: model %r's is skipped (%d skipped so far; "
            "it is checked at a later registration)",
            MAX_CHECKS,
            model[:128],
            self.skipped,
            extra=event("fleet_check_skipped", model=model[:128], skipped=self.skipped),
        )

    async def _counted_check(
        self, tier_backend: TierBackend, model: str, tenant: str, mine: FleetRecord
    ) -> None:
        try:
            await self._check(tier_backend, model, tenant, mine)
        finally:
            self.checks -= 1

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
            model[:128],
            text,
            theirs.host,
            extra=event(
                "fleet_mismatch",
                backend=tier_backend.label,
                model=model[:128],
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
