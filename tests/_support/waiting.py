"""Waiting on a condition with a deadline (never a fixed sleep), from threads and from trio."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import trio

__all__ = ["await_async", "await_condition", "wait_for"]


def wait_for(condition: Callable[[], Any], timeout: float = 10.0, what: str = "condition") -> Any:
    """Poll ``condition`` (a blocking check) until it returns a truthy value, or fail."""
    deadline = time.monotonic() + timeout
    delay = 0.005
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(delay)
        delay = min(delay * 2, 0.1)


async def await_condition(
    condition: Callable[[], Any], timeout: float = 10.0, what: str = "condition"
) -> Any:
    """Trio version of :func:`wait_for`: re-check ``condition`` until true, within a deadline."""
    delay = 0.002
    with trio.move_on_after(timeout):
        while True:
            value = condition()
            if value:
                return value
            await trio.sleep(delay)
            delay = min(delay * 2, 0.05)
    pytest.fail(f"timed out after {timeout}s waiting for {what}")


async def await_async(
    condition: Callable[[], Awaitable[Any]], timeout: float = 10.0, what: str = "condition"
) -> Any:
    """:func:`await_condition` for a condition that must itself await (e.g. a request)."""
    delay = 0.002
    with trio.move_on_after(timeout):
        while True:
            value = await condition()
            if value:
                return value
            await trio.sleep(delay)
            delay = min(delay * 2, 0.05)
    pytest.fail(f"timed out after {timeout}s waiting for {what}")
