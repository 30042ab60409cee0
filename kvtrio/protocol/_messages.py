"""Wire messages as frozen attrs classes.

Every request class names its operation (``op``) and the class of its successful reply
(``reply_type``); :data:`OPERATIONS` maps operation names to request classes and is the tagged
union the codec decodes with (the tag travels in the frame header, not in the body). No class here
knows how it is serialised: :mod:`kvtrio.protocol._codec` does that at the edge.

Adding an operation means adding a request class and its reply class here, listing the request in
:data:`REQUEST_TYPES`, documenting both in ``docs/protocol.md``, and registering a handler in
the server.
"""

from __future__ import annotations

from typing import Any, ClassVar

from attrs import field, frozen

__all__ = [
    "CORE_REQUEST_TYPES",
    "PROTOCOL_VERSION",
    "CacheStats",
    "ChunkSize",
    "ErrorReply",
    "GetChunkSize",
    "GetStats",
    "Goodbye",
    "Header",
    "Hello",
    "HelloReply",
    "L2Stats",
    "Ping",
    "Pong",
    "Probe",
    "ProbeReply",
    "Reply",
    "Request",
    "ServerCounters",
    "SessionStats",
    "StatsReply",
]

PROTOCOL_VERSION = 2
"""Version of the wire protocol. Bumped on any incompatible change of a frame or message.

2: clients send chunk hashes (not prompts) and name their engine; commit/release by chunk hash."""


@frozen
class Header:
    """First frame of every message: ``[version, call_id, kind]`` as a msgpack array.

    In a request ``kind`` is the operation name; in a reply it is the same operation name for a
    result and ``"error"`` for an :class:`ErrorReply`. This layout never changes between protocol
    versions, so a peer can always read the version and call id of any message.
    """

    version: int
    call_id: int
    kind: str


class Reply:
    """Base class of reply bodies."""

    __slots__ = ()


class Request:
    """Base class of request bodies. Subclasses set :attr:`op` and :attr:`reply_type`."""

    __slots__ = ()
    op: ClassVar[str]
    reply_type: ClassVar[type[Reply]]


@frozen
class ErrorReply(Reply):
    """The reply to a request that failed: a stable code (see ``ErrorCode``) and a message."""

    code: str
    message: str


# --------------------------------------------------------------------------- ping


@frozen
class Pong(Reply):
    """Reply to :class:`Ping`. ``instance_id`` changes every time a server process starts."""

    instance_id: str


@frozen
class Ping(Request):
    """Liveness check and heartbeat: any request counts as a heartbeat, ping is the cheapest."""

    op: ClassVar[str] = "ping"
    reply_type: ClassVar[type[Reply]] = Pong


@frozen
class Goodbye(Request):
    """The client is closing: the server answers, then ends the session at once (releasing what
    it held) instead of at the heartbeat timeout. Servers before it answer ``unknown_operation``.
    """

    op: ClassVar[str] = "goodbye"
    reply_type: ClassVar[type[Reply]] = Pong


# --------------------------------------------------------------------------- hello


@frozen
class HelloReply(Reply):
    """What the server tells a client about itself."""

    server_version: str
    protocol_version: int
    instance_id: str
    chunk_size: int
    heartbeat_timeout: float
    """Seconds of silence after which the server ends a client's session."""
    max_message_size: int


@frozen
class Hello(Request):
    """A client announces itself; refused with ``unsupported_version`` if the protocols differ."""

    op: ClassVar[str] = "hello"
    reply_type: ClassVar[type[Reply]] = HelloReply

    client_name: str
    client_version: str
    protocol_version: int


# --------------------------------------------------------------------------- get_chunk_size


@frozen
class ChunkSize(Reply):
    chunk_size: int


@frozen
class GetChunkSize(Request):
    """The server's chunk size in tokens."""

    op: ClassVar[str] = "get_chunk_size"
    reply_type: ClassVar[type[Reply]] = ChunkSize


# --------------------------------------------------------------------------- stats


@frozen
class SessionStats:
    """Counters of one client session."""

    session_id: str
    """Hex form of the ZeroMQ routing id the server assigned to the client's connection."""
    client_name: str
    client_version: str
    age_seconds: float
    idle_seconds: float
    requests: int
    errors: int
    in_flight: int


@frozen
class ServerCounters:
    """Counters of the whole server since it started."""

    requests: int
    """Requests whose header could be read (each got exactly one reply)."""
    errors: int
    """Error replies sent."""
    errors_by_code: dict[str, int]
    frames_dropped: int
    """Messages dropped because no call id could be read from them."""
    replies_undeliverable: int
    """Replies dropped because the client had disconnected or stopped reading."""
    sessions_started: int
    sessions_ended: int
    sessions_expired: int
    """Sessions ended because the client was silent longer than the heartbeat timeout."""


@frozen
class CacheStats:
    """Levels and counters of the cache."""

    l1_capacity_bytes: int
    l1_used_bytes: int
    l1_entries: int
    l1_ready: int
    l1_writing: int
    l1_pinned_entries: int
    l1_pins: int
    """Pins held right now, over all entries."""
    l1_evictions: int
    store_failures: int
    """Chunks a store could not place (no room even after eviction)."""
    leases: int
    """Live leases (lookup pins, reads, write reservations)."""
    leases_expired: int
    registrations: int
    requests: int
    """Requests whose prompt the server remembers."""
    lookups: int
    lookup_hit_chunks: int
    """Chunks found, in L1 or L2."""
    lookup_miss_chunks: int
    lookup_l2_chunks: int = 0
    """Of the hit chunks, those found in L2 (then loaded into L1)."""
    lookup_timeouts: int = 0
    loads_pending: int = 0
    loads_failed: int = 0
    write_behind_queued: int = 0
    write_behind_skipped: int = 0
    """Chunks not written to L2 because the write-behind queue was full."""
    l2_corrupt: int = 0
    l2_admitted: int = 0
    """Committed chunks admitted to L2 at their commit (every one with ``l2_admission=all``)."""
    l2_refused: int = 0
    """Committed chunks L2 admission refused at their commit (seen once, nothing reused)."""
    l2_admitted_later: int = 0
    """Refused chunks admitted when used again while in L1."""


@frozen
class L2Stats:
    """One L2 backend: whether it is in use right now, and its counters."""

    name: str
    healthy: bool | None
    """False while an operation fails (lookups or stores: a backend that cannot store is
    unhealthy although lookups answer), until one of that kind succeeds again; None (unknown)
    until its start-up health check or a first operation has answered."""
    counters: dict[str, float]
    problem: str = ""
    """Why it is unhealthy, in one line (``stores fail: disk: cannot use /proc/nope: …``)."""


@frozen
class StatsReply(Reply):
    server_version: str
    instance_id: str
    uptime_seconds: float
    counters: ServerCounters
    sessions: tuple[SessionStats, ...] = field(factory=tuple)
    cache: CacheStats | None = None
    l2: tuple[L2Stats, ...] = ()
    phase: str = "serving"
    """``starting``, ``serving`` or ``draining``."""
    config: dict[str, Any] = field(factory=dict)
    """A summary of the server's settings (no backend options: they may hold credentials)."""


@frozen
class GetStats(Request):
    """Server counters and one entry per live session."""

    op: ClassVar[str] = "stats"
    reply_type: ClassVar[type[Reply]] = StatsReply


# --------------------------------------------------------------------------- probe


@frozen
class ProbeReply(Reply):
    tokens: int
    block_ids: int


@frozen
class Probe(Request):
    """Integer arrays shaped like a lookup; answered with their lengths and nothing else done.

    For measuring the protocol's own cost (``bench/protocol.py``) and for checking that a
    client in another language encodes integer arrays the way the server reads them.
    """

    op: ClassVar[str] = "probe"
    reply_type: ClassVar[type[Reply]] = ProbeReply

    tokens: tuple[int, ...]
    block_ids: tuple[int, ...]


CORE_REQUEST_TYPES: tuple[type[Request], ...] = (
    Ping,
    Hello,
    GetChunkSize,
    GetStats,
    Probe,
    Goodbye,
)
"""Operation name → request class: the tagged union of requests."""
