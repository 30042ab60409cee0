"""Endpoint checks: is an endpoint well-formed, is a live listener behind an ``ipc://`` path,
and the wait until a closed socket's ipc listeners are gone.

kvtrio accepts exactly two spellings, ``tcp://HOST:PORT`` and ``ipc://PATH``, everywhere (flags,
TOML, environment, ``Client``). Anything else is refused at once with one line, and a line that
looks like an address in another spelling (``127.0.0.1:5577``, ``localhost:5577``, ``5577``,
``http://host:5577``) gets a "did you mean tcp://…?" hint: libzmq would otherwise fail in a
background thread (a hang) or, for a port above 65535, bind a different port without a word.
"""

from __future__ import annotations

import contextlib
import errno
import grp
import os
import re
import socket
from collections.abc import Sequence

import trio

from ..errors import TransportError

__all__ = [
    "check_endpoint",
    "ensure_endpoint_free",
    "group_id",
    "ipc_path",
    "is_listening",
    "remove_socket_file",
    "socket_file",
    "wait_released",
]

_IPC_PATH_MAX = 107  # sizeof(sockaddr_un.sun_path) - 1 on Linux
_HOST = r"(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+)"
_HOST_PORT_RE = re.compile(rf"^(?P<host>{_HOST}|\*)?:(?P<port>[^:\]]*)$")
_SCHEME_RE = re.compile(r"^(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*)://(?P<rest>.*)$")


def check_endpoint(endpoint: str, *, bind: bool = False) -> str:
    """Return ``endpoint`` if it is ``tcp://HOST:PORT`` or ``ipc://PATH``; raise otherwise.

    Ports are 1–65535 (``bind`` also takes 0, "any free port", and ``*`` as the host). Raises
    :class:`TransportError` with a one-line message, with a hint where the text looks like a
    host and port in another spelling. Pure: no I/O, no name resolution.
    """
    text = endpoint.strip()
    if not text:
        raise TransportError("no endpoint given (expected tcp://HOST:PORT or ipc://PATH)")
    match = _SCHEME_RE.match(text)
    if match is None:
        raise TransportError(_unknown_form(endpoint, text))
    scheme, rest = match.group("scheme").lower(), match.group("rest")
    if scheme == "ipc":
        if not rest:
            raise TransportError(f"{endpoint!r} names no path (expected ipc://PATH)")
        if len(os.fsencode(rest)) > _IPC_PATH_MAX:
            raise TransportError(
                f"{endpoint!r}: the path is longer than {_IPC_PATH_MAX} bytes, the limit of a "
                "Unix socket; use a shorter one"
            )
        return f"ipc://{rest}"
    if scheme != "tcp":
        hint = _tcp_hint(rest.split("/", 1)[0])
        raise TransportError(
            f"{endpoint!r}: kvtrio speaks ZeroMQ over tcp:// or ipc://, not {scheme}://"
            + (f"; did you mean {hint}?" if hint else "")
        )
    address = _HOST_PORT_RE.match(rest)
    if address is None or not address.group("host"):
        raise TransportError(f"{endpoint!r} is not tcp://HOST:PORT (e.g. tcp://127.0.0.1:5577)")
    host, port = address.group("host"), address.group("port")
    if host == "*" and not bind:
        raise TransportError(f"{endpoint!r}: '*' is for listening; connect to a host name or IP")
    lowest = 0 if bind else 1
    if not port.isdigit() or not lowest <= int(port) <= 65535:
        raise TransportError(f"{endpoint!r}: the port must be a number from {lowest} to 65535")
    return f"tcp://{rest}"


def _unknown_form(endpoint: str, text: str) -> str:
    hint = _tcp_hint(text)
    if hint:
        return f"{endpoint!r} has no transport; did you mean {hint}?"
    return f"{endpoint!r} is not an endpoint (expected tcp://HOST:PORT or ipc://PATH)"


def _tcp_hint(text: str) -> str | None:
    """``tcp://HOST:PORT`` for ``HOST:PORT``, ``:PORT`` or ``PORT``; None if it is neither."""
    if text.isdigit():
        return f"tcp://127.0.0.1:{text}"
    address = _HOST_PORT_RE.match(text)
    if address is None or not address.group("port").isdigit():
        return None
    return f"tcp://{address.group('host') or '127.0.0.1'}:{address.group('port')}"


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
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.setblocking(False)
        sock.connect(path)
    except BlockingIOError:
        return True
    except OSError as exc:
        if exc.errno in (errno.ECONNREFUSED, errno.ENOENT, errno.ENOTSOCK):
            return False
        raise TransportError(f"cannot check ipc://{path}: {exc.strerror}") from None
    finally:
        sock.close()
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


_GID_MAX = 2**32 - 2
"""The largest group id (``(gid_t) -1`` means "unchanged" to ``chown``)."""


def group_id(name: str) -> int:
    """The id of the group ``name`` (for ``ipc_group``): a group name, or a numeric id as is
    (a container's group need not have a name in its ``/etc/group``). :class:`TransportError`
    in one line if there is no such group or the number is out of range."""
    text = name.strip()
    if text.isdigit():
        gid = int(text)
        if gid > _GID_MAX:
            raise TransportError(f"ipc_group: {name!r} is not a group id (0 to {_GID_MAX})")
        return gid
    try:
        return grp.getgrnam(text).gr_gid
    except KeyError:
        raise TransportError(
            f"ipc_group: no group named {name!r} (give a group name or a numeric id)"
        ) from None


SocketFile = tuple[str, int, int, int]
"""An ipc socket file this process bound: (path, device, inode, change time in ns). The
change time tells a file bound there since apart even where its inode number is the freed one
of ours (filesystems reuse them at once)."""


def socket_file(path: str) -> SocketFile | None:
    """The identity of the socket file at ``path`` (just bound by this process), or None if
    there is none (an abstract socket, a file already gone)."""
    try:
        status = os.lstat(path)
    except OSError:
        return None
    return (path, status.st_dev, status.st_ino, status.st_ctime_ns)


def remove_socket_file(bound: SocketFile) -> None:
    """Remove an ipc socket file this process bound, once nothing listens on it (libzmq leaves
    them behind): only if the file at its path is still the one bound (same device and inode),
    so a file that another server bound there since is left alone. Never raises. (Record it
    after the file's last chmod: that changes its change time.)"""
    path, *identity = bound
    with contextlib.suppress(OSError):
        status = os.lstat(path)
        if [status.st_dev, status.st_ino, status.st_ctime_ns] == identity:
            os.unlink(path)


_RELEASE_TIMEOUT = 2.0
"""Seconds :func:`wait_released` waits at most for libzmq to stop listening on ipc paths."""


async def wait_released(paths: Sequence[str]) -> None:
    """Wait until nothing listens on ``paths`` any more (shielded, bounded).

    libzmq closes a socket's listeners asynchronously, in its I/O thread: without this wait, a
    server restarted in the same process could find its own predecessor's listener still there
    and refuse the endpoint as taken.
    """
    if not paths:
        return
    with (
        trio.CancelScope(shield=True),
        trio.move_on_after(_RELEASE_TIMEOUT),
        contextlib.suppress(TransportError),  # a path we may not check: nothing to wait for
    ):
        delay = 0.0005
        while any(is_listening(path) for path in paths):
            await trio.sleep(delay)
            delay = min(2 * delay, 0.05)
