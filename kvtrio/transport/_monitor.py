"""ZeroMQ's socket monitor under trio: a socket's connection events, read without ever blocking
libzmq's I/O thread."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import zmq
from zmq.utils.monitor import parse_monitor_message

from ._zmq import Socket, open_socket

__all__ = ["Monitor", "open_monitor"]


class Monitor:
    """Connection events of a socket, from ZeroMQ's socket monitor. See :func:`open_monitor`."""

    def __init__(self, pair: Socket) -> None:
        self._pair = pair

    async def receive(self) -> int:
        """Wait for the next event and return its code (``zmq.EVENT_*``)."""
        return (await self.receive_event())[0]

    async def receive_event(self) -> tuple[int, int]:
        """Wait for the next event: its code (``zmq.EVENT_*``) and its value (an errno, a
        ZeroMQ protocol error, a descriptor: it depends on the event). Cancellation: stops
        waiting; no event is lost."""
        frames = await self._pair.recv_multipart()
        message = parse_monitor_message(frames)
        return int(message["event"]), int(message["value"])


@asynccontextmanager
async def open_monitor(socket: Socket, events: int) -> AsyncIterator[Monitor]:
    """Follow ``socket``'s connection ``events`` for the duration of the block.

    Open it before connecting ``socket`` (events are not queued for a reader that is not there
    yet) and leave it before closing ``socket``. On exit, monitoring is switched off *before*
    the reading socket closes: libzmq sends events with blocking sends from its I/O thread, so
    an event for a reader that is gone would block every socket of the process (libzmq #3575).
    """
    socket._check_open()
    # Unique forever: libzmq closes sockets asynchronously, so a reused name could still be
    # bound by the monitor of a socket closed a moment ago and deliver its stale events.
    endpoint = f"inproc://kvtrio-monitor-{uuid.uuid4().hex}"
    socket._zsock.monitor(endpoint, events)
    try:
        async with open_socket(zmq.PAIR) as pair:
            pair.connect(endpoint)
            try:
                yield Monitor(pair)
            finally:
                socket._stop_monitor()
    finally:
        socket._stop_monitor()
