"""A client of a server that may still be starting: what ``kvtrio ping`` and ``kvtrio status``
run, so that ``kvtrio serve … &`` followed by ``kvtrio ping --timeout N`` does not race."""

from __future__ import annotations

import logging
import os
import time

from ..errors import ConfigError, ServerUnavailable
from ._sync import Client

__all__ = ["connect_waiting"]

log = logging.getLogger("kvtrio.client")

_KEY_VARIABLES = ("KVTRIO_SERVER_KEY", "KVTRIO_CLIENT_KEY", "KVTRIO_INSECURE")


def connect_waiting(
    endpoint: str,
    timeout: float,
    *,
    client_name: str,
    server_key: str | None = None,
    client_key: str | None = None,
    insecure: bool | None = None,
) -> Client:
    """A :class:`Client` of ``endpoint`` (no heartbeat, requests of ``timeout``) once its
    connection is up, waiting (blocking) up to ``timeout`` seconds for a server that is
    starting: for its default CURVE keys (a server makes them at its first start) and for it to
    listen. A refused handshake (a key problem) ends the wait at once, and the request made next
    says why. :class:`ServerUnavailable` when nothing answered in time, in one line that says
    what it waited for; :class:`ConfigError` for keys that are wrong or still missing.
    Interrupted (KeyboardInterrupt), the client made so far is closed."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            client = Client(
                endpoint,
                timeout=timeout,
                client_name=client_name,
                heartbeat=False,
                server_key=server_key,
                client_key=client_key,
                insecure=insecure,
            )
            break
        except ConfigError as exc:
            if not _default_keys(endpoint, server_key, client_key, insecure):
                raise
            if time.monotonic() >= deadline:
                raise
            log.debug("waiting for the server's first start to make its keys: %s", exc)
            time.sleep(0.05)
    try:
        left = max(0.0, deadline - time.monotonic())
        if not client.wait_for_server(left, while_away=True, hello=False) and (
            client.handshake_error is None
        ):
            what = (
                "it accepted the connection but its handshake did not finish"
                if client.state == "connected"
                else "nothing listens there (is the server running?)"
            )
            waited = f"waited {timeout:g} s for a kvtrio server at {endpoint}"
            raise ServerUnavailable(f"{waited}: {what}")
    except BaseException:
        client.close()
        raise
    return client


def _default_keys(
    endpoint: str, server_key: str | None, client_key: str | None, insecure: bool | None
) -> bool:
    """The client uses this user's default CURVE keys, which a server makes at its first start:
    tcp, and no key given by argument or environment variable, nor ``insecure``."""
    given = server_key or client_key or insecure
    return (
        endpoint.startswith("tcp://")
        and not given
        and not any(os.environ.get(name) for name in _KEY_VARIABLES)
    )
