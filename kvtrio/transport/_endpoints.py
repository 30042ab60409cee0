"""Checks on ``ipc://`` endpoints: is a live listener behind the path?"""

from __future__ import annotations

import errno
import os
import socket

from ..errors import TransportError

__all__ = ["ensure_endpoint_free", "ipc_path", "is_listening"]


def ipc_path(endpoint: str) -> str | None:
    """The filesystem path of an ``ipc://`` endpoint, None for other transports."""
    return endpoint[len("ipc://") :] if endpoint.startswith("ipc://") else None


def is_listening(path: str) -> bool:
    """Whether something accepts connections on the Unix socket ``path`` right now.

    Never blocks: the connect is non-blocking (a full backlog counts as listening). Raises
    :class:`TransportError` for errors that say nothing either way (e.g. permission denied).
    """
    if not os.path.exists(path):
        return False
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.setblocking(False)
        probe.connect(path)
    except BlockingIOError:
        return True
    except OSError as exc:
        if exc.errno in (errno.ECONNREFUSED, errno.ENOENT, errno.ENOTSOCK):
            return False
        raise TransportError(f"cannot check ipc://{path}: {exc.strerror}") from None
    finally:
        probe.close()
    return True


def ensure_endpoint_free(endpoint: str) -> None:
    """Refuse to bind an ``ipc://`` path another live server is listening on.

    libzmq silently replaces an existing ipc socket file on bind, which would steal a running
    server's clients. A file nobody accepts connections on (left by a crashed server) is fine.
    Raises :class:`TransportError`. Never blocks.
    """
    path = ipc_path(endpoint)
    if path is not None and is_listening(path):
        raise TransportError(
            f"{endpoint} is in use by another process (is kvtrio already running?)"
        )
