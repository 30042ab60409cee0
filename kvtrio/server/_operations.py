"""Handlers of the operations every server has: ping, hello, get_chunk_size, stats.

None of them waits: they are plain functions, answered inline by the router."""

from __future__ import annotations

import logging

from .._logging import event
from .._version import __version__
from ..errors import ErrorCode, RequestError
from ..protocol import (
    PROTOCOL_VERSION,
    ChunkSize,
    GetChunkSize,
    GetStats,
    Goodbye,
    Hello,
    HelloReply,
    Ping,
    Pong,
    Probe,
    ProbeReply,
    StatsReply,
    as_int_array,
)
from ._session import Session
from ._state import ServerState

__all__ = ["register_core_operations"]

log = logging.getLogger("kvtrio.server")

_MAX_NAME = 128


def ping(session: Session, request: Ping) -> Pong:
    return Pong(session.state.instance_id)


def hello(session: Session, request: Hello) -> HelloReply:
    if request.protocol_version != PROTOCOL_VERSION:
        raise RequestError(
            ErrorCode.UNSUPPORTED_VERSION,
            f"{request.client_name or 'the client'} speaks protocol version "
            f"{request.protocol_version}, this server (kvtrio {__version__}) speaks version "
            f"{PROTOCOL_VERSION}",
        )
    session.client_name = request.client_name[:_MAX_NAME]
    session.client_version = request.client_version[:_MAX_NAME]
    log.info(
        "session %s: client %s %s",
        session.id,
        session.client_name,
        session.client_version,
        extra=event(
            "session_start",
            session=session.id,
            client=session.client_name,
            client_version=session.client_version,
        ),
    )
    config = session.state.config
    return HelloReply(
        server_version=__version__,
        protocol_version=PROTOCOL_VERSION,
        instance_id=session.state.instance_id,
        chunk_size=config.chunk_size,
        heartbeat_timeout=config.heartbeat_timeout,
        max_message_size=config.max_message_size,
    )


def get_chunk_size(session: Session, request: GetChunkSize) -> ChunkSize:
    return ChunkSize(session.state.config.chunk_size)


def probe(session: Session, request: Probe) -> ProbeReply:
    tokens = as_int_array(request.tokens, "q", "tokens")
    block_ids = as_int_array(request.block_ids, "q", "block_ids")
    return ProbeReply(len(tokens), len(block_ids))


def stats(session: Session, request: GetStats) -> StatsReply:
    return session.state.stats(session)


def goodbye(session: Session, request: Goodbye) -> Pong:
    """The session ends right after this reply (see ``Session.handle_now``)."""
    return Pong(session.state.instance_id)


def register_core_operations(state: ServerState) -> None:
    """Register the core operations: none of them waits, so all are answered inline."""
    state.register_inline(Ping, ping)
    state.register_inline(Goodbye, goodbye)
    state.register_inline(Hello, hello)
    state.register_inline(GetChunkSize, get_chunk_size)
    state.register_inline(GetStats, stats)
    state.register_inline(Probe, probe)
