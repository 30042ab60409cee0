"""The L2 backend interface: what a backend implements, ours and third parties' alike.

A backend stores opaque objects under 32-byte keys. It does not interpret them: the server frames
every object (a header with version, key, layout fingerprint, length and checksum, then the
chunk) and verifies it after loading, so a backend only moves bytes, and integrity is enforced
the same way for all of them.

Every method is a trio coroutine; blocking I/O goes through ``trio.to_thread.run_sync`` with the
backend's own ``CapacityLimiter``. Cancellation must leave nothing locked and no half-written
object visible. Backends register under the entry-point group ``kvtrio.backends``.

**Optional capabilities.** A backend's class may declare, each with a class attribute set to
``True``, that it takes more than :class:`Backend`'s calls (:class:`Capabilities`): a backend
without the attribute (or with it ``False``) is called without, so backends written before a
capability keep working unchanged. :func:`capabilities` reads them; nothing else should.

- ``accepts_parents``: ``store(keys, buffers, parents=…)``, ``parents`` index-aligned with
  ``keys``: the key of the object before each one in its prompt (``None`` for a first chunk
  or unknown), for a prefix-aware eviction policy;
- ``accepts_owners``: ``store(keys, buffers, owners=…)``, ``owners`` index-aligned with
  ``keys``: the 16-byte tag of the tenant each object was stored for (kept across restarts),
  to share the backend's capacity fairly; with ``parents=`` too where both are declared;
- ``accepts_touches``: ``async def touch(keys: Sequence[bytes]) -> None`` (:class:`Touching`):
  the objects were used (hits served from the server's L1, which never reach
  ``lookup_and_lock``), last given last used, to refresh them in its eviction policy as a
  lookup hit would. Unknown keys are ignored; it changes nothing visible (no lock, no load).
  The server calls it in batches, from a task, never once per hit.
- ``accepts_names`` (:class:`Naming`): ``store(keys, buffers, names=…)``, ``names``
  index-aligned with ``keys``: each object's names (opaque bytes, at most :data:`MAX_NAMES`,
  or ``None``: what the server's KV events call the chunk), kept with the object and
  authenticated as the object's own record is (a backend may leave out names it has no room
  for: the store still succeeds); and ``async def names(prefix, limit)``: the ``(key, names)``
  of its objects whose keys start with ``prefix`` and that were stored with names, the newest
  first, at most ``limit`` bytes of names, so that a restarted server announces them before
  any lookup finds them. Only a backend that is this server's own declares it (the disk L2):
  listing a store that a fleet shares would list other servers' chunks, at every start.

One more class attribute is a property rather than a call: ``shared_store`` (``True`` for the
``redis`` and ``s3`` backends): the objects are in a store that other kvtrio servers may use
too, so the server keeps a fleet record of each model there (``docs/fleet.md``); a backend
without it is taken as this server's own (the disk L2) and is never given one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Protocol, runtime_checkable

import attrs

from ..errors import KvtrioError

__all__ = [
    "MAX_NAMES",
    "Backend",
    "BackendError",
    "BackendMisconfigured",
    "BackendUnavailable",
    "Buffers",
    "Capabilities",
    "Naming",
    "Touching",
    "UnreadableObjects",
    "capabilities",
]

MAX_NAMES = 4096
"""The most bytes of names the server gives ``store`` for one object (``accepts_names``)."""

Buffers = Sequence[memoryview]
"""An object's bytes as consecutive parts: the concatenation of the parts is the object."""


class BackendError(KvtrioError):
    """A backend failed at an operation (the server counts it and treats it as a miss)."""


class BackendUnavailable(BackendError):
    """The backend's service cannot be reached (connection refused, timed out)."""


class BackendMisconfigured(BackendError):
    """The backend's service answers, but is not what the backend's options say it is (a Redis
    Cluster node reached without ``cluster=true``, say), or its local path can never work or is
    another server's (``disk``): no call can work until the options change. The message says
    which option to set. Found by the server's start-up probe, it stops the start (one line);
    found later, it is a failure like any other."""


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
        A backend that declares ``accepts_parents`` or ``accepts_owners`` (see the module
        docstring) is given those too, as keyword arguments.
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


class Touching(Protocol):
    """What a backend that declares ``accepts_touches`` has besides :class:`Backend`'s calls."""

    async def touch(self, keys: Sequence[bytes]) -> None:
        """The objects were used, the last key last (see the module docstring)."""
        ...


class Naming(Protocol):
    """What a backend that declares ``accepts_names`` has besides :class:`Backend`'s calls."""

    async def names(self, prefix: bytes, limit: int) -> Sequence[tuple[bytes, bytes]]:
        """``(key, names)`` of the objects under ``prefix`` stored with names, the newest first,
        at most ``limit`` bytes of names (see the module docstring)."""
        ...


@attrs.frozen
class Capabilities:
    """The optional capabilities a backend's class declares (see the module docstring)."""

    parents: bool = False
    """``accepts_parents``: ``store`` takes ``parents=``."""
    owners: bool = False
    """``accepts_owners``: ``store`` takes ``owners=``."""
    touches: bool = False
    """``accepts_touches``: it has ``touch`` (:class:`Touching`)."""
    shared: bool = False
    """``shared_store``: other servers may use the same store (see the module docstring)."""
    names: bool = False
    """``accepts_names``: ``store`` takes ``names=`` and it has ``names`` (:class:`Naming`)."""


def capabilities(backend: Backend) -> Capabilities:
    """The optional capabilities ``backend`` declares (its class attributes
    ``accepts_parents``, ``accepts_owners``, ``accepts_touches``, ``shared_store``,
    ``accepts_names``; absent ones are False)."""
    return Capabilities(
        parents=bool(getattr(backend, "accepts_parents", False)),
        owners=bool(getattr(backend, "accepts_owners", False)),
        touches=bool(getattr(backend, "accepts_touches", False)),
        shared=bool(getattr(backend, "shared_store", False)),
        names=bool(getattr(backend, "accepts_names", False)),
    )
