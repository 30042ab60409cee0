"""Bounds on what clients can make the server hold: registration shapes, tracked requests, pins.

A registration whose shape could not be served (a chunk larger than the L1 arena, absurd
counts that would overflow a computation further on) is refused with one ``bad_request`` line.
Requests holding leases and the leases themselves (pins, reservations) are bounded by the
``max_requests`` and ``max_pins`` settings: beyond them a request gets ``busy``. A request that
holds nothing costs nothing (the server keeps no prompts). ``max_requests`` is shared fairly
(issue 32): each tenant may hold at most ``max_requests / l1_tenants`` of them (only tenants
with an arena can hold any, so no tenant's flood can take what another's share needs), and
within it each CURVE client key at most ``lease_share_per_key`` of its tenant's share; a
tenant's leases likewise at most ``max_pins / l1_tenants``.

The work of a lookup is bounded before it starts (issue 22): it names ``world_size`` × hashes
object keys, at most ``MAX_LOOKUP_KEYS`` per message (a batch's summed), and the keys whose L2
part is still running count against budgets per session and per client key
(:class:`KeyBudget`) and against ``max_pins``. Synchronous, no I/O.
"""

from __future__ import annotations

import collections

from ...errors import ErrorCode, RequestError
from ...protocol import MAX_LOOKUP_KEYS, MAX_WORLD_SIZE, Register
from ...storage import LeaseTable
from ._registry import layout_of

__all__ = [
    "SESSION_KEYS",
    "USER_KEYS",
    "KeyBudget",
    "RequestLimits",
    "check_lookup_keys",
    "check_registration",
    "key_group",
    "tenant_group",
]

SESSION_KEYS = 2 * MAX_LOOKUP_KEYS
"""Object keys one session's lookups may have in their L2 part at once: two of the largest
lookup messages (a scheduler's batch in flight while the next is admitted)."""
USER_KEYS = 4 * MAX_LOOKUP_KEYS
"""The same, for all the sessions of one client key (a key may hold several sessions)."""

_SHAPE_LIMITS = {
    "world_size": MAX_WORLD_SIZE,
    "num_layers": 1 << 12,
    "num_blocks": 1 << 32,
    "block_size": 1 << 20,
    "num_heads": 1 << 16,
    "head_dim": 1 << 16,
}
"""Sane upper bounds of a registration's counts (far beyond any model, far below overflow)."""


def check_registration(register: Register, chunk_size: int, arena_size: int) -> None:
    """Refuse (``bad_request``, one line) a registration the server could not serve."""
    spec = register.layout
    counts = {
        "world_size": register.world_size,
        **{name: getattr(spec, name) for name in _SHAPE_LIMITS if name != "world_size"},
    }
    for name, value in counts.items():
        limit = _SHAPE_LIMITS[name]
        if type(value) is not int or not 1 <= value <= limit:
            raise RequestError(
                ErrorCode.BAD_REQUEST, f"{name} must be an integer in 1…{limit}, got {value!r}"
            )
    layout = layout_of(spec)
    if chunk_size % layout.block_size:
        return  # (the registry refuses it, saying why)
    chunk_bytes = layout.chunk_nbytes(chunk_size)
    if chunk_bytes > arena_size:
        raise RequestError(
            ErrorCode.BAD_REQUEST,
            f"a chunk of this layout is {chunk_bytes} bytes, more than the whole L1 arena "
            f"({arena_size} bytes): start kvtrio with a larger --l1-size or a smaller --chunk-size",
        )


def check_lookup_keys(world_size: int, hashes: int) -> int:
    """The object keys a lookup (or a batch, with its hashes summed) of ``hashes`` chunk
    hashes at ``world_size`` names; ``bad_request`` naming the bound if it is out of range."""
    if type(world_size) is not int or not 1 <= world_size <= MAX_WORLD_SIZE:
        raise RequestError(
            ErrorCode.BAD_REQUEST,
            f"world_size must be an integer in 1…{MAX_WORLD_SIZE} (MAX_WORLD_SIZE), "
            f"got {world_size!r}",
        )
    keys = world_size * hashes
    if keys > MAX_LOOKUP_KEYS:
        raise RequestError(
            ErrorCode.BAD_REQUEST,
            f"world_size {world_size} × {hashes} chunk hashes is {keys} keys, at most "
            f"{MAX_LOOKUP_KEYS} in one message (MAX_LOOKUP_KEYS): look up a shorter prefix, "
            "or send the lookups in several messages",
        )
    return keys


class KeyBudget:
    """Object keys whose lookup is still running its L2 part, per session and per client key.

    :meth:`take` admits (or refuses ``busy``, naming the budget) before the work starts;
    :meth:`give` returns them when the part has ended, however it ended. A client key of ``""``
    (the local user of an ipc server, or ``--insecure``) has the per-session budget only.
    """

    def __init__(self, per_session: int = SESSION_KEYS, per_user: int = USER_KEYS) -> None:
        self.per_session = per_session
        self.per_user = per_user
        self.by_session: collections.Counter[str] = collections.Counter()
        self.by_user: collections.Counter[str] = collections.Counter()
        self.total = 0
        """Keys in flight, all sessions together (``max_pins`` counts them as pins to come)."""
        self.refused = 0

    def check(self, session: str, user: str, keys: int) -> None:
        """Raise ``busy`` if ``keys`` more would exceed the session's or its key's budget."""
        if self.by_session[session] + keys > self.per_session:
            bound, name, held = self.per_session, "per session", self.by_session[session]
        elif user and self.by_user[user] + keys > self.per_user:
            bound, name, held = self.per_user, "per client key", self.by_user[user]
        else:
            return
        self.refused += 1
        raise RequestError(
            ErrorCode.BUSY,
            f"lookups of {held} keys are still running ({bound} keys at most {name}): "
            "wait for their answers, or retry later",
        )

    def take(self, session: str, user: str, keys: int) -> None:
        """:meth:`check`, then count ``keys`` as in flight."""
        self.check(session, user, keys)
        self.by_session[session] += keys
        if user:
            self.by_user[user] += keys
        self.total += keys

    def give(self, session: str, user: str, keys: int) -> None:
        """The work of ``keys`` taken by :meth:`take` has ended."""
        self.total -= keys
        for table, name in ((self.by_session, session), (self.by_user, user)):
            if name in table:
                table[name] -= keys
                if table[name] <= 0:
                    del table[name]


def tenant_group(tenant: str) -> str:
    """The lease table's group of a tenant's requests (see :class:`RequestLimits`)."""
    return "t:" + tenant


def key_group(tenant: str, user: str) -> str:
    """The lease table's group of a client key's requests in a tenant ("" has none)."""
    return f"k:{user}\x00{tenant}"


class RequestLimits:
    """Admission of new tracked requests and of new pins (see the module docstring).

    The lease table counts the requests holding leases per tenant and per client key (its
    groups, :func:`tenant_group` and :func:`key_group`, named from each request's first lease).
    """

    def __init__(
        self, max_requests: int, max_pins: int, tenants: int = 1, share_per_key: float = 1.0
    ) -> None:
        self.max_requests = max_requests
        self.max_pins = max_pins
        self.per_tenant = max(1, max_requests // tenants)
        """Requests one tenant may hold (its share of ``max_requests``)."""
        self.per_key = max(1, int(self.per_tenant * share_per_key))
        """Requests one CURVE client key may hold (its share of its tenant's)."""
        self.pins_per_tenant = max(1, max_pins // tenants)
        """Pins (leases) one tenant may hold (its share of ``max_pins``)."""
        self.refused = 0
        """Requests answered ``busy`` because a limit was reached."""

    def admit_request(self, leases: LeaseTable, key: str, tenant: str = "", user: str = "") -> None:
        """Raise ``busy`` if ``key`` of ``tenant``, asked for by client key ``user``, would be
        one request too many holding leases: for the server, for the tenant or for the key.

        A request that already holds leases passes; one that holds none costs the server nothing
        (protocol 2 keeps no prompts), so only requests holding pins or reservations count.
        """
        if leases.holds(key):
            return
        by_group = leases.requests_by_group
        if leases.requests >= self.max_requests:
            held, bound, whose = leases.requests, self.max_requests, "max_requests"
        elif by_group[tenant_group(tenant)] >= self.per_tenant:
            held, bound = by_group[tenant_group(tenant)], self.per_tenant
            whose = "this tenant's share of max_requests"
        elif user and by_group[key_group(tenant, user)] >= self.per_key:
            held, bound = by_group[key_group(tenant, user)], self.per_key
            whose = "this client key's share of its tenant's max_requests"
        else:
            return
        self.refused += 1
        raise RequestError(
            ErrorCode.BUSY,
            f"{held} requests hold pins or reservations ({bound} at most: {whose}): end "
            "finished requests, or retry later",
        )

    def admit_pins(
        self, leases: LeaseTable, count: int, pending: int = 0, tenant: str | None = None
    ) -> None:
        """Raise ``busy`` if ``count`` more pins would exceed ``max_pins``, counting the
        ``pending`` pins that lookups still in their L2 part may take, or ``tenant``'s share of
        it (``max_pins / l1_tenants`` leases, as for requests)."""
        if not count:
            return
        if leases.live + pending + count > self.max_pins:
            self.refused += 1
            raise RequestError(
                ErrorCode.BUSY,
                f"the server holds {leases.live} pins and lookups under way may take {pending} "
                f"more (max_pins {self.max_pins}): release or end requests, or retry later",
            )
        held = 0 if tenant is None else leases.leases_by_group[tenant_group(tenant)]
        if held + count > self.pins_per_tenant:
            self.refused += 1
            raise RequestError(
                ErrorCode.BUSY,
                f"this tenant holds {held} pins ({self.pins_per_tenant} at most: its share of "
                "max_pins): release or end requests, or retry later",
            )
