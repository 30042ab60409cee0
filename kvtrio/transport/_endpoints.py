"""Checks on endpoints before binding them."""

from __future__ import annotations

import errno
import os
import socket

from ..errors import TransportError

__all__ = ["ensure_endpoint_free"]


def ensure_endpoint_free(endpoint: str) -> None:
    """Refuse to bind an ``ipc://`` path another live server is listening on.

    libzmq silently replaces an existing ipc socket file on bind, which would steal a running
    server's clients. A file nobody accepts connections on (left by a crashed server) is fine.
    Raises :class:`TransportError`. Blocking, but only for a local connect that answers at once.
    """
    if not endpoint.startswith("ipc://"):
        return
    path = endpoint[len("ipc://") :]
    if not os.path.exists(path):
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(path)
    except OSError as exc:
        if exc.errno in (errno.ECONNREFUSED, errno.ENOENT, errno.ENOTSOCK):
            return
        raise TransportError(f"cannot check {endpoint}: {exc.strerror}") from None
    finally:
        probe.close()
    raise TransportError(f"{endpoint} is in use by another process (is kvtrio already running?)")
