"""A trio adapter for pyzmq sockets, correct under ZeroMQ's edge-triggered file descriptor.

ZeroMQ exposes readiness through ``ZMQ_FD``, which is *edge*-triggered from the application's
point of view: it becomes readable when the socket's state may have changed, and *any* libzmq call
on the socket (send, recv, or reading ``ZMQ_EVENTS``) may consume that edge while processing
pending commands. A task that waits on the FD after another task's send consumed the edge waits
forever although a message is queued: the classic lost wakeup.

The rules this adapter follows, so that no wakeup is lost:

1. one *pump* task per socket owns ``trio.lowlevel.wait_readable(fd)`` (trio allows one waiter
   per FD) and, whenever the FD fires, reads ``ZMQ_EVENTS`` and wakes parked readers or writers;
2. every operation first tries the libzmq call with ``NOBLOCK``; only on ``EAGAIN`` does it read
   ``ZMQ_EVENTS`` and, if the socket is still not ready, park on a :class:`trio.lowlevel.ParkingLot`
   — with no checkpoint between the check and the park, so no edge can slip through;
3. after every libzmq call, if any task is parked, ``ZMQ_EVENTS`` is read again and the parked
   tasks whose condition now holds are woken (their edge may have been consumed by this call);
4. nothing outside this module touches the pyzmq socket.

A socket opened with ``pump=False`` has no pump: its one reader owns the FD itself
(:meth:`Socket.serve_edge`) and drains the socket with non-blocking receives after each wake-up,
so a burst of messages costs one scheduling round, not two (pump, then reader). Rule 3 then
wakes that reader by cancelling its wait when another task's call consumed the edge, and the
reader's own ``ZMQ_EVENTS`` reads wake the writers parked at the high-water mark (it plays the
pump's part for them).

Receives ask ``ZMQ_EVENTS`` before taking a message instead of receiving until ``EAGAIN``:
pyzmq raises ``zmq.Again`` for that, and making the exception costs about four times the
question. Asking also counts as the check of rule 2.

Cancellation: a task parked in :meth:`Socket.recv_multipart` or :meth:`Socket.send_multipart` can
be cancelled at any time; a message is either fully received/sent or not at all (ZeroMQ's multipart
messages are atomic).
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any, NoReturn, cast

import trio
import zmq

from ..errors import PeerUnreachable, TransportError
from ._endpoints import (
    SocketFile,
    group_id,
    ipc_path,
    remove_socket_file,
    socket_file,
    wait_released,
)

__all__ = ["Socket", "open_socket"]

# Plain ints: pyzmq's constants are enum flags, and flag arithmetic costs microseconds per call.
_POLLIN = int(zmq.POLLIN)
_POLLOUT = int(zmq.POLLOUT)
_NOBLOCK = int(zmq.NOBLOCK)
_EVENTS = zmq.EVENTS  # the enum member: pyzmq converts an int option to it first (+1 µs)
_SNDMORE_NOBLOCK = int(zmq.SNDMORE) | _NOBLOCK

Frames = Sequence[bytes]


class Socket:
    """A pyzmq socket usable from many trio tasks at once. Create it with :func:`open_socket`."""

    def __init__(self, zsock: zmq.Socket[bytes], linger: int = 0, *, pump: bool = True) -> None:
        self._zsock = zsock
        self._linger = linger
        self._fd = cast(int, zsock.get(zmq.FD))
        self._readers = trio.lowlevel.ParkingLot()
        self._writers = trio.lowlevel.ParkingLot()
        self._parked = 0
        """Tasks parked on ``_readers`` or ``_writers`` (a plain int: read after every call)."""
        self._pumped = pump
        """False: no pump task; the one reader waits on the FD itself (:meth:`serve_edge`)."""
        self._edge: trio.CancelScope | None = None
        """The edge reader's cancel scope (one for many waits; replaced after a cancel)."""
        self._edge_waiting = False
        """True while the edge reader waits on the FD (in :meth:`serve_edge`)."""
        self._closed = False
        self._ipc_paths: list[str] = []
        """Paths of the ``ipc://`` endpoints bound, waited for by :func:`open_socket`."""
        self._ipc_files: list[SocketFile] = []
        """The socket files bound, removed by :func:`open_socket` once nothing listens."""

    # ----------------------------------------------------------------- configuration

    def bind(self, endpoint: str, *, ipc_group: str = "") -> str:
        """Bind to ``endpoint`` and return the endpoint actually bound (port 0 resolved).

        An ``ipc://`` socket file is created 0600 (only this user may connect), or 0660 owned
        by ``ipc_group``: the umask is 077 while binding, so there is no moment where others
        could connect.
        """
        is_ipc = endpoint.startswith("ipc://")
        gid = group_id(ipc_group) if is_ipc and ipc_group else None
        previous = os.umask(0o077) if is_ipc else None
        try:
            self._zsock.bind(endpoint)
        except zmq.ZMQError as exc:
            raise TransportError(f"cannot bind {endpoint}: {exc.strerror}") from None
        finally:
            if previous is not None:
                os.umask(previous)
        last = self._zsock.get(zmq.LAST_ENDPOINT)
        bound = last.decode() if isinstance(last, bytes) else str(last)
        path = ipc_path(bound)
        if path is not None:
            self._ipc_paths.append(path)
            try:
                if gid is not None:
                    os.chown(path, -1, gid)
                os.chmod(path, 0o600 if gid is None else 0o660)
            except OSError as exc:
                raise TransportError(
                    f"cannot set the permissions of {bound}: {exc.strerror}"
                ) from None
            bound_file = socket_file(path)  # (after the chmod: its change time is final)
            if bound_file is not None:
                self._ipc_files.append(bound_file)
        return bound

    def connect(self, endpoint: str) -> None:
        """Connect to ``endpoint`` (ZeroMQ connects in the background and reconnects by itself)."""
        try:
            self._zsock.connect(endpoint)
        except zmq.ZMQError as exc:
            raise TransportError(f"cannot connect to {endpoint}: {exc.strerror}") from None

    @property
    def closed(self) -> bool:
        return self._closed

    # ----------------------------------------------------------------- readiness

    def _wake(self) -> int:
        """Read ``ZMQ_EVENTS`` and wake the parked tasks whose condition holds; return events."""
        try:
            events: int = self._zsock.get(_EVENTS)  # type: ignore[assignment]
        except zmq.ZMQError:
            events = _POLLIN | _POLLOUT  # let everyone find out about the failure
        self._after_events(events)
        return events

    def _after_call(self) -> None:
        # Rule 3: the call may have consumed the FD edge a waiting task was waiting for.
        if self._parked or self._edge_waiting:
            self._wake()

    def _after_events(self, events: int) -> None:
        """Rule 3 after a ``ZMQ_EVENTS`` read that returned ``events`` (no call since)."""
        if events & _POLLIN:
            if self._readers:
                self._readers.unpark_all()
            if self._edge_waiting:
                assert self._edge is not None
                self._edge.cancel()  # the edge reader's wait: it re-checks and takes the message
        if events & _POLLOUT and self._writers:
            self._writers.unpark_all()

    async def _park(self, lot: trio.lowlevel.ParkingLot) -> None:
        self._parked += 1
        try:
            await lot.park()
        finally:
            self._parked -= 1

    def _events(self) -> int:
        try:
            return self._zsock.get(_EVENTS)  # type: ignore[return-value]  # (no cast: hot)
        except zmq.ZMQError:
            return _POLLIN | _POLLOUT  # let the caller find out about the failure

    def _check_pumped(self) -> None:
        if not self._pumped:
            raise RuntimeError("this socket has no pump: use serve_edge() and the try_ methods")

    def _check_open(self) -> None:
        if self._closed:
            raise trio.ClosedResourceError("the socket was closed")

    async def _pump(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Wait on the FD forever and turn its edges into wakeups (rule 1).

        Returns when the socket is closed.
        """
        task_status.started()
        while not self._closed:
            try:
                await trio.lowlevel.wait_readable(self._fd)
            except trio.ClosedResourceError:
                return
            if not self._closed:
                self._wake()

    # ----------------------------------------------------------------- receiving

    def try_recv_multipart(self) -> list[bytes] | None:
        """Receive one message if one is queued, else return None. Never waits."""
        self._check_open()
        zsock = self._zsock
        try:
            events: int = zsock.getsockopt(_EVENTS)  # type: ignore[assignment]
            if not events & _POLLIN:
                self._after_events(events)
                return None
            # Frame by frame, ``more`` from the frame: pyzmq's recv_multipart reads RCVMORE
            # through enum conversions (twice the cost for a 3-frame request, measured).
            frame = zsock.recv(_NOBLOCK, copy=False)
            frames = [frame.bytes]
            while frame.more:  # the rest of a multipart message is always there already
                frame = zsock.recv(_NOBLOCK, copy=False)
                frames.append(frame.bytes)
        except zmq.Again:  # pragma: no cover - ZMQ_EVENTS said a message was queued
            frames = None
        except zmq.ZMQError as exc:
            raise TransportError(f"receive failed: {exc.strerror}") from None
        self._after_call()
        return frames

    def try_recv_authenticated(self) -> tuple[list[bytes], str] | None:
        """Like :meth:`try_recv_multipart`, with the ZAP user id of the connection the message
        came from ("" if the connection was not authenticated)."""
        self._check_open()
        zsock = self._zsock
        try:
            events: int = zsock.getsockopt(_EVENTS)  # type: ignore[assignment]
            if not events & _POLLIN:
                self._after_events(events)
                return None
            first = zsock.recv(_NOBLOCK, copy=False)
            frames = [first.bytes]
            try:
                user = first.get("User-Id")
            except zmq.ZMQError:
                user = ""
            more = first.more
            while more:  # the rest of a multipart message is always there already
                frame = zsock.recv(_NOBLOCK, copy=False)
                frames.append(frame.bytes)
                more = frame.more
        except zmq.Again:  # pragma: no cover - ZMQ_EVENTS said a message was queued
            return None
        except zmq.ZMQError as exc:
            raise TransportError(f"receive failed: {exc.strerror}") from None
        finally:
            self._after_call()
        return frames, str(user)

    async def recv_multipart(self) -> list[bytes]:
        """Receive one whole message, waiting until one arrives.

        Cancellation: if cancelled, no message has been taken from the socket.
        """
        self._check_pumped()
        await trio.lowlevel.checkpoint_if_cancelled()
        while True:
            frames = self.try_recv_multipart()
            if frames is not None:
                await trio.lowlevel.cancel_shielded_checkpoint()
                return frames
            # Rule 2: check the state ourselves before parking; no checkpoint in between.
            if not self._wake() & _POLLIN:
                await self._park(self._readers)

    async def serve_edge(self, drain: Callable[[], bool]) -> NoReturn:
        """Be the socket's one reader (``pump=False``): call ``drain`` whenever messages may be
        queued, forever.

        ``drain`` takes messages with :meth:`try_recv_multipart` (or
        :meth:`try_recv_authenticated`) and must not wait. It returns False once a receive
        returned None (the socket is empty and that was its last libzmq call), or True when it
        stopped early with messages possibly left: then other tasks get a turn (a checkpoint)
        before it is called again. Each wake-up on the FD costs one scheduling round, however
        many messages it brings. Rule 3 cancels the wait if another task's libzmq call consumed
        the edge of a queued message; one cancel scope serves every wait until that happens.

        Cancellation: between messages (``drain`` is never interrupted). Raises
        :class:`trio.ClosedResourceError` when the socket is closed.
        """
        if self._pumped:
            raise RuntimeError("serve_edge() is for sockets opened with pump=False")
        if self._edge is not None:
            raise trio.BusyResourceError("another task already serves this socket's edge")
        await trio.lowlevel.checkpoint_if_cancelled()
        fd = self._fd
        try:
            while True:
                with trio.CancelScope() as scope:
                    self._edge = scope
                    while True:
                        self._check_open()
                        if drain():  # more may be queued: let other tasks run first
                            await trio.lowlevel.checkpoint()
                            continue
                        # drain's last libzmq call found the socket empty: wait for the edge.
                        self._edge_waiting = True
                        try:
                            await trio.lowlevel.wait_readable(fd)
                        finally:
                            self._edge_waiting = False
        finally:
            self._edge = None

    async def wait_readable(self) -> None:
        """Wait until a message is queued, without taking it (then use
        :meth:`try_recv_multipart`). Returns at once, after a checkpoint, if one already is.

        For readers that must never hold a received message across a checkpoint.
        """
        self._check_pumped()
        await trio.lowlevel.checkpoint_if_cancelled()
        while True:
            self._check_open()
            if self._wake() & _POLLIN:
                await trio.lowlevel.cancel_shielded_checkpoint()
                return
            await self._park(self._readers)

    def set_option(self, option: int, value: int | bytes) -> None:
        """``setsockopt`` (e.g. an XPUB_MANUAL socket's ``SUBSCRIBE``, which applies to the
        subscriber whose subscription was received last). Never waits."""
        self._check_open()
        try:
            self._zsock.setsockopt(option, value)
        except zmq.ZMQError as exc:
            raise TransportError(f"setsockopt failed: {exc.strerror}") from None
        finally:
            self._after_call()

    # ----------------------------------------------------------------- sending

    def try_send_multipart(self, frames: Frames) -> bool:
        """Send one message if the socket can take it now; return False if it would block.

        On a ROUTER socket with ``ROUTER_MANDATORY`` set, raises :class:`PeerUnreachable` if the
        peer is gone, and returns False if that peer's queue is full.
        """
        self._check_open()
        send = self._zsock.send
        try:
            # Frame by frame with plain-int flags (pyzmq's send_multipart does enum arithmetic).
            # A multipart message is atomic: once the first frame is taken, the rest will be.
            for frame in frames[:-1]:
                send(frame, _SNDMORE_NOBLOCK)
            send(frames[-1], _NOBLOCK)
        except zmq.Again:
            return False
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH:
                raise PeerUnreachable("the peer is not connected") from None
            raise TransportError(f"send failed: {exc.strerror}") from None
        finally:
            self._after_call()
        return True

    async def send_multipart(self, frames: Frames) -> None:
        """Send one whole message, waiting while the socket is at its high-water mark.

        Do not use this on a ROUTER with ``ROUTER_MANDATORY`` (its writability is not per peer);
        use :meth:`try_send_multipart` with a retry policy instead. On a socket without pump,
        the task serving its edge (:meth:`serve_edge`) wakes the waiting writers.

        Cancellation: if cancelled, the message has not been sent.
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        while True:
            if self.try_send_multipart(frames):
                await trio.lowlevel.cancel_shielded_checkpoint()
                return
            if not self._wake() & _POLLOUT:
                await self._park(self._writers)

    # ----------------------------------------------------------------- closing

    def _stop_monitor(self) -> None:
        """Switch ZeroMQ's socket monitor off (idempotent)."""
        if not self._closed:
            self._zsock.disable_monitor()

    def close(self) -> None:
        """Close the socket now. Parked tasks raise :class:`trio.ClosedResourceError`.

        Messages already sent keep being delivered in the background for up to the socket's
        ``linger`` milliseconds. Idempotent.
        """
        if self._closed:
            return
        self._closed = True
        trio.lowlevel.notify_closing(self._fd)
        self._readers.unpark_all()
        self._writers.unpark_all()
        self._zsock.close(linger=self._linger)


@asynccontextmanager
async def open_socket(
    socket_type: int,
    *,
    options: Mapping[int, Any] | None = None,
    linger: int = 0,
    context: zmq.Context[Any] | None = None,
    pump: bool = True,
) -> AsyncIterator[Socket]:
    """Create a ZeroMQ socket of ``socket_type`` driven by trio, with its pump task (or, with
    ``pump=False``, for one reader that waits with :meth:`Socket.serve_edge`).

    ``options`` are set with ``setsockopt`` before use. The socket is closed and the pump stops
    when the block exits, also on cancellation; messages sent but not yet on the wire get
    ``linger`` more milliseconds (in libzmq's I/O thread; the close itself does not wait).
    The ``ipc://`` socket files it bound are removed once nothing listens on them (only the
    files it bound: one another process bound at that path since stays).
    """
    ctx = context if context is not None else zmq.Context.instance()
    zsock: zmq.Socket[bytes] = ctx.socket(socket_type)
    try:
        zsock.setsockopt(zmq.LINGER, 0)
        for option, value in (options or {}).items():
            zsock.setsockopt(option, value)
    except BaseException:
        zsock.close(linger=0)
        raise
    sock = Socket(zsock, linger, pump=pump)
    try:
        async with trio.open_nursery() as nursery:
            if pump:
                await nursery.start(sock._pump)
            try:
                yield sock
            finally:
                sock.close()
    finally:
        sock.close()
        await wait_released(sock._ipc_paths)
        for bound in sock._ipc_files:  # (libzmq leaves them: a clean stop removes them)
            remove_socket_file(bound)
