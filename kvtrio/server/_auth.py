"""Who a client is, what it may use, and how many sessions it may hold.

Three modes, decided at start from the endpoint and the settings (:func:`configure_auth`):

* ``curve`` (every ``tcp://`` endpoint unless ``insecure``): ZeroMQ CURVE; the ZAP handler
  accepts only the allowed client keys; each key is a principal with its own tenants.
* ``ipc``: the socket file is 0600 (or 0660 for ``ipc_group``): whoever can connect is this
  user (or that group), trusted like the user the server runs as, with every tenant.
* ``insecure`` (``tcp://`` with ``insecure = true``): nobody is authenticated, so there is
  exactly one tenant, ``""``; a request naming another is refused.

No I/O here except reading key files at start.
"""

from __future__ import annotations

import collections
import functools
import ipaddress
import logging
import time
from pathlib import Path

import attrs
import zmq

from .._logging import event
from ..config import ServerConfig
from ..errors import ErrorCode, RequestError
from ..transport import (
    ANY_TENANT,
    AllowedKey,
    KeyPair,
    default_key_dir,
    ensure_default_keys,
    load_allowed_keys,
    load_keypair,
)

__all__ = ["EVENTS_ZAP_DOMAIN", "Principal", "ServerAuth", "configure_auth", "is_loopback"]

log = logging.getLogger("kvtrio.server")


@attrs.frozen
class Principal:
    """The authenticated identity behind a connection."""

    name: str
    user_id: str
    """The ZAP user id (the client's public key, Z85) or "" when not authenticated."""
    tenants: frozenset[str]

    def may_use(self, tenant: str) -> bool:
        return ANY_TENANT in self.tenants or tenant in self.tenants


ZAP_DOMAIN = b"kvtrio"
"""The request socket's ZAP domain."""
EVENTS_ZAP_DOMAIN = b"kvtrio-events"
"""The KV events sockets' ZAP domain (so that a key can be refused there alone)."""

_LOCAL = Principal("local user", "", frozenset({ANY_TENANT}))
_ANONYMOUS = Principal("anonymous", "", frozenset({""}))


def is_loopback(endpoint: str) -> bool:
    """Whether a ``tcp://HOST:PORT`` endpoint listens on a loopback address only."""
    host = endpoint[len("tcp://") :].rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # an interface name or a wildcard: reachable from the network


class ServerAuth:
    """The server's authentication state: mode, keys, principals, session counts."""

    def __init__(
        self,
        mode: str,
        *,
        server_keys: KeyPair | None = None,
        allowed: dict[bytes, AllowedKey] | None = None,
        key_dir: Path | None = None,
        max_sessions: int = 1024,
        max_sessions_per_key: int = 256,
    ) -> None:
        self.mode = mode
        self.server_keys = server_keys
        self.allowed = allowed or {}
        self.key_dir = key_dir
        self.max_sessions = max_sessions
        self.max_sessions_per_key = max_sessions_per_key
        self.sessions_by_user: collections.Counter[str] = collections.Counter()
        self.handshakes_refused = 0
        self.events_banned: dict[bytes, float] = {}
        """Client keys (Z85) refused by the KV events sockets until a ``time.monotonic()``:
        keys whose connection sent them a message that is not a subscription (``_events``)."""

    @property
    def curve(self) -> bool:
        return self.mode == "curve"

    def socket_options(self, domain: bytes = ZAP_DOMAIN) -> dict[int, int | bytes]:
        """Options of a server socket for this mode (CURVE server keys, ZAP ``domain``: the
        request socket's, or :data:`EVENTS_ZAP_DOMAIN` for the KV events sockets)."""
        if not self.curve:
            return {}
        assert self.server_keys is not None
        assert self.server_keys.secret is not None
        return {
            zmq.CURVE_SERVER: 1,
            zmq.CURVE_SECRETKEY: self.server_keys.secret,
            zmq.ZAP_DOMAIN: domain,
        }

    def authorize(self, public: bytes, domain: bytes = ZAP_DOMAIN) -> str | None:
        """ZAP decision for a client public key (Z85) on a socket of ``domain``: its user id,
        or None to refuse (a key the events sockets banned is refused there alone)."""
        banned = domain == EVENTS_ZAP_DOMAIN and self._events_banned(public)
        if public in self.allowed and not banned:
            return public.decode()
        self.handshakes_refused += 1
        return None

    def ban_from_events(self, user_id: str, seconds: float) -> None:
        """Refuse key ``user_id``'s handshakes on the KV events sockets for ``seconds``."""
        if user_id:
            self.events_banned[user_id.encode()] = time.monotonic() + seconds

    def _events_banned(self, public: bytes) -> bool:
        until = self.events_banned.get(public)
        if until is None:
            return False
        if until > time.monotonic():
            return True
        del self.events_banned[public]
        return False

    def principal(self, user_id: str) -> Principal | None:
        """The principal of a connection with this ZAP user id; None if it is not (any more)
        one the server accepts."""
        if not self.curve:
            return _LOCAL if self.mode == "ipc" else _ANONYMOUS
        key = self.allowed.get(user_id.encode())
        if key is None:
            return None
        return Principal(key.name, user_id, key.tenants)

    def session_refusal(self, principal: Principal, sessions: int) -> str | None:
        """Why a new session of ``principal`` may not start now (``sessions`` live), or None."""
        if sessions >= self.max_sessions:
            return f"the server holds its maximum of {self.max_sessions} sessions; retry later"
        user = principal.user_id  # "" (ipc, --insecure): one principal, the global limit only
        if user and self.sessions_by_user[user] >= self.max_sessions_per_key:
            return (
                f"{principal.name} holds its maximum of {self.max_sessions_per_key} sessions; "
                "end some, or retry later"
            )
        return None

    def describe(self, endpoint: str) -> str:
        """One line for the log at start: how clients are authenticated."""
        if self.curve:
            public = self.server_keys.public.decode() if self.server_keys else "?"
            return (
                f"CURVE authentication on {endpoint}: {len(self.allowed)} allowed client "
                f"key(s), server public key {public}"
                + (f", keys in {self.key_dir}" if self.key_dir else "")
            )
        if self.mode == "ipc":
            return f"{endpoint}: only this user (or the ipc_group) can connect; no CURVE"
        return (
            f"INSECURE: no authentication on {endpoint}: anyone who can reach it can read and "
            "write the cached KV; one tenant only"
        )


def check_tenant(principal: Principal, tenant: str) -> None:
    """Refuse (``forbidden``) a request naming a tenant its principal may not use."""
    if not principal.may_use(tenant):
        if principal.user_id:
            message = f"this client key ({principal.name}) may not use tenant {tenant!r}"
        else:
            message = "tenants need an authenticated connection (CURVE); this one may only use ''"
        raise RequestError(ErrorCode.FORBIDDEN, message)


def configure_auth(config: ServerConfig) -> ServerAuth:
    """The authentication of a server with ``config``; reads (or on first start, creates)
    keys. :class:`~kvtrio.errors.ConfigError` for unusable key files."""
    new = functools.partial(
        ServerAuth,
        max_sessions=config.max_sessions,
        max_sessions_per_key=config.max_sessions_per_key,
    )
    endpoint = config.endpoint
    if endpoint.startswith("ipc://"):
        return new("ipc")
    if config.insecure:
        auth = new("insecure")
        if not is_loopback(endpoint):
            log.warning("%s", auth.describe(endpoint), extra=event("insecure", endpoint=endpoint))
        return auth
    key_dir = None
    if not (config.curve_secret_key and config.curve_allowed_keys):
        key_dir = ensure_default_keys(default_key_dir())
    secret = config.curve_secret_key or str(key_dir / "server.key_secret" if key_dir else "")
    allowed_path = config.curve_allowed_keys or str(key_dir / "clients" if key_dir else "")
    return new(
        "curve",
        server_keys=load_keypair(secret),
        allowed=load_allowed_keys(allowed_path),
        key_dir=key_dir,
    )
