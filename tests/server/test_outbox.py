"""The outbox's replies to a client whose queue is full (``kvtrio.server._outbox``).

A full client queue is a fault these tests cannot cause on demand through a real socket (the
kernel's buffers and both high-water marks must fill first), so the socket is a stand-in that
refuses a number of sends; time is trio's autojump clock.
"""

from __future__ import annotations

import pytest
import trio
import trio.testing

from kvtrio.config import ServerConfig
from kvtrio.server._outbox import Outbox
from kvtrio.server._state import ServerState


class FullQueue:
    """``try_send_multipart`` refuses (the client's queue is full) ``refusals`` times."""

    def __init__(self, refusals: float) -> None:
        self.refusals = refusals
        self.tries = 0
        self.sent: list[list[bytes]] = []

    def try_send_multipart(self, frames: list[bytes]) -> bool:
        self.tries += 1
        if self.tries <= self.refusals:
            return False
        self.sent.append(frames)
        return True


def outbox(refusals: float) -> tuple[Outbox, FullQueue, ServerState]:
    state = ServerState(ServerConfig(l2=(), heartbeat_timeout=10.0), "ipc:///nowhere")
    socket = FullQueue(refusals)
    return Outbox(state, socket), socket, state  # type: ignore[arg-type]


async def test_a_reply_waits_for_room_in_the_clients_queue(
    autojump_clock: trio.testing.MockClock,
) -> None:
    box, socket, state = outbox(refusals=5)
    await box.reply(b"client", [b"header", b"body"])
    assert socket.sent == [[b"client", b"header", b"body"]]
    assert state.counters.replies_undeliverable == 0


async def test_a_reply_the_client_never_takes_is_counted_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    box, _, state = outbox(refusals=float("inf"))
    await box.reply(b"client", [b"header", b"body"])
    assert trio.current_time() >= state.config.heartbeat_timeout
    assert state.counters.replies_undeliverable == 1


@pytest.mark.parametrize("room_at_the_end", [False, True])
async def test_a_reply_cancelled_while_it_waits_is_tried_once_more_and_else_counted(
    autojump_clock: trio.testing.MockClock, room_at_the_end: bool
) -> None:
    """The session (or the server) ends while a reply waits for room: was neither sent nor
    counted, a request with no reply and no trace of it."""
    box, socket, state = outbox(refusals=float("inf"))
    with trio.move_on_after(1.0):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(box.reply, b"client", [b"header", b"body"])
            await trio.sleep(0.5)
            if room_at_the_end:
                socket.refusals = socket.tries  # the next try goes out
    assert len(socket.sent) == int(room_at_the_end)
    assert state.counters.replies_undeliverable == int(not room_at_the_end)
