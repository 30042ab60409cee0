"""Bounds on what clients can make the server hold: registration shapes, tracked requests, pins.

A registration whose shape could not be served (a chunk larger than the L1 arena, absurd
counts that would overflow a computation further on) is refused with one ``bad_request`` line.
Requests holding leases and the leases themselves (pins, reservations) are bounded by the
``max_requests`` and ``max_pins`` settings: beyond them a request gets ``busy``. A request that
holds nothing costs nothing (the server keeps no prompts). Synchronous, no I/O.
"""

from __future__ import annotations

from ...errors import ErrorCode, RequestError
from ...protocol import Register
from ...storage import LeaseTable
from ._registry import layout_of

__all__ = ["RequestLimits", "check_registration"]

_SHAPE_LIMITS = {
    "world_size": 1 << 12,
    "num_layers": 1 << 12,
    "num_blocks": 1 << 32,
    "block_size": 1 << 20,
    "num_heads": 1 << 16,
    "head_dim": 1 << 16,
}
"""Sane upper bounds of a registration's counts (far beyond any model, far below overflow)."""


def check_registration(request: Register, chunk_size: int, arena_size: int) -> None:
    """Refuse (``bad_request``, one line) a registration the server could not serve."""
    spec = request.layout
    counts = {
        "world_size": request.world_size,
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


class RequestLimits:
    """Admission of new tracked requests and of new pins (see the module docstring)."""

    def __init__(self, max_requests: int, max_pins: int) -> None:
        self.max_requests = max_requests
        self.max_pins = max_pins
        self.refused = 0
        """Requests answered ``busy`` because a limit was reached."""

    def admit_request(self, leases: LeaseTable, key: str) -> None:
        """Raise ``busy`` if ``key`` would be one request too many holding leases.

        A request that already holds leases passes; one that holds none costs the server nothing
        (protocol 2 keeps no prompts), so only requests holding pins or reservations count.
        """
        if leases.requests < self.max_requests or leases.holds(key):
            return
        self.refused += 1
        raise RequestError(
            ErrorCode.BUSY,
            f"{self.max_requests} requests hold pins or reservations (max_requests): end "
            "finished requests, or retry later",
        )

    def admit_pins(self, leases: LeaseTable, count: int) -> None:
        """Raise ``busy`` if ``count`` more pins would exceed ``max_pins``."""
        if count and leases.live + count > self.max_pins:
            self.refused += 1
            raise RequestError(
                ErrorCode.BUSY,
                f"the server holds {leases.live} pins (max_pins {self.max_pins}): release or end "
                "requests, or retry later",
            )
