"""The worker registers once per server instance, not twice on its first connection."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import numpy as np

from kvtrio.client import WorkerAdapter
from kvtrio.launch import ServerProcess
from kvtrio.protocol import Register, Reply, Request

from .._support.waiting import wait_for

BLOCK = 16


def _counting(adapter: WorkerAdapter) -> list[Request]:
    """Record every Register the adapter's client submits."""
    sent: list[Request] = []
    submit = adapter.client.submit

    def recording(request: Request, **kwargs: Any) -> Future[Reply]:
        if isinstance(request, Register):
            sent.append(request)
        return submit(request, **kwargs)

    adapter.client.submit = recording  # type: ignore[method-assign]
    return sent


def test_first_connection_registers_once(server_process: Callable[..., ServerProcess]) -> None:
    # register_kv_caches right after construction (before the hello) and the first
    # on_server_change used to both register: register → unregister → register at the server.
    server = server_process()
    caches = {f"l{i}": np.zeros((2, 8, BLOCK, 2, 8), np.float32) for i in range(2)}
    for _ in range(3):  # the race depends on when the hello lands; try it a few times
        adapter = WorkerAdapter(server.endpoint, "m", 1, 0, BLOCK, timeout=5.0)
        sent = _counting(adapter)
        try:
            adapter.register_kv_caches(caches, layout="flash_attn")
            wait_for(lambda a=adapter: a.registered, what="registration")  # type: ignore[misc]
            assert adapter.registered
            assert len(sent) == 1
        finally:
            adapter.shutdown()


def test_a_new_server_instance_gets_a_new_registration(
    server_process: Callable[..., ServerProcess],
) -> None:
    server = server_process()
    caches = {"l0": np.zeros((2, 8, BLOCK, 2, 8), np.float32)}
    adapter = WorkerAdapter(server.endpoint, "m", 1, 0, BLOCK, timeout=5.0)
    sent = _counting(adapter)
    try:
        adapter.register_kv_caches(caches, layout="flash_attn")
        wait_for(lambda: adapter.registered, what="registration")
        first = adapter.client.server_info
        server.stop()
        server_process()
        wait_for(
            lambda: (
                adapter.client.server_info is not None
                and first is not None
                and adapter.client.server_info.instance_id != first.instance_id
                and adapter.registered
            ),
            what="registration at the new server",
            timeout=20,
        )
        assert len(sent) == 2
    finally:
        adapter.shutdown()
