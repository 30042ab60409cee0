"""The L2 backend interface: what a backend implements, ours and third parties' alike.

A backend stores opaque objects under 32-byte keys. It does not interpret them: the server frames
every object (a header with version, key, layout fingerprint, length and checksum, then the
chunk) and verifies it after loading, so a backend only moves bytes, and integrity is enforced
the same way for all of them.

Every method is a trio coroutine; blocking I/O goes through ``trio.to_thread.run_sync`` with the
backend's own ``CapacityLimiter``. Cancellation must leave nothing locked and no half-written
object visible. Backends register under the entry-point group ``kvtrio.backends``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Protocol, runtime_checkable

from ..errors import KvtrioError

__all__ = ["Backend", "BackendError", "BackendUnavailable", "Buffers", "UnreadableObjects"]

Buffers = Sequence[memoryview]
"""An object's bytes as consecutive parts: the concatenation of the parts is the object."""


class BackendError(KvtrioError):
    """A backend failed at an operation (the server counts it and treats it as a miss)."""


class BackendUnavailable(BackendError):
    """The backend's service cannot be reached (connection refused, timed out)."""


class UnreadableObjects(BackendError):
    """A ``load`` could not read some of its objects, for reasons of their own (e.g. ``EIO``
    under one record), and did read the others: the error is the objects', not the backend's.

    ``results`` is what ``load`` would have returned (index-aligned with its keys; ``False`` for
    the unreadable ones), ``unreadable`` the keys that could not be read. The server fails those
    loads, deletes an object whose reads fail twice, and backs the backend off only when
    distinct objects keep failing with no read succeeding in between. Raise a plain
    :class:`BackendError` for an error that is not specific to objects (a connection, a file
    that cannot be opened)."""

    def __init__(self, message: str, results: Sequence[bool], unreadable: Sequence[bytes]) -> None:
        super().__init__(message)
        self.results = list(results)
        self.unreadable = list(unreadable)


@runtime_checkable
class Backend(Protocol):
    """An L2 backend. See ``docs/backends.md`` for the full contract.

    Construction (``cls(options)``) must be cheap and must not connect: a backend whose service is
    down still constructs, and reconnects by itself later.
    """

    name: ClassVar[str]
    """The name it is registered under (``disk``, ``redis``, …)."""
    Options: ClassVar[type[Any]]
    """A frozen attrs class of typed options; each field's ``metadata["help"]`` is one line."""

    async def lookup_and_lock(self, keys: Sequence[bytes]) -> int:
        """Length of the longest prefix of ``keys`` stored here; those objects are locked.

        Locked means not evicted or deleted until unlocked, counted per key (two lookups of one
        key need two unlocks). Where the store cannot promise it (e.g. Redis eviction), a backend
        documents that, and a load of an evicted object is simply a miss.
        """
        ...

    async def unlock(self, keys: Sequence[bytes]) -> None:
        """Undo one lock per key (unknown or unlocked keys are ignored)."""
        ...

    async def load(self, keys: Sequence[bytes], buffers: Sequence[Buffers]) -> list[bool]:
        """Read each object into its buffers; per key, False if it is missing or is not exactly
        as long as its buffers. A False key's buffers may have been partly written.

        A read error of some objects only (the others read) may be raised as
        :class:`UnreadableObjects`, naming them; any other exception fails the whole call.
        """
        ...

    async def store(self, keys: Sequence[bytes], buffers: Sequence[Buffers]) -> list[bool]:
        """Write each object (the concatenation of its buffers); per key whether it is stored.

        An object is visible to lookups only once completely written (no torn objects), and a
        failed or cancelled store leaves no object behind. Storing an existing key replaces it.

        Optional capability: a backend whose class sets ``accepts_parents = True`` is called as
        ``store(keys, buffers, parents=…)``, ``parents`` index-aligned with ``keys``: the key of
        the object before each one in its prompt (``None`` for a first chunk or unknown), for a
        prefix-aware eviction policy. Backends without the flag are called without it.

        Optional capability: a backend whose class sets ``accepts_touches = True`` implements
        ``async def touch(keys: Sequence[bytes]) -> None``: the objects were used (hits served
        from the server's L1, which never reach ``lookup_and_lock``), last given last used, to
        refresh them in its eviction policy as a lookup hit would. Unknown keys are ignored;
        it changes nothing visible (no lock, no load). The server calls it in batches, from a
        task, never once per hit.
        """
        ...

    async def delete(self, keys: Sequence[bytes]) -> None:
        """Remove the objects (missing keys are ignored; locked objects go once unlocked)."""
        ...

    async def aclose(self) -> None:
        """Release connections and threads; operations still running fail or are cancelled."""
        ...

    def statistics(self) -> Mapping[str, float]:
        """Counters and levels for ``stats`` and metrics (names are the backend's own)."""
        ...
