"""Fixtures of the end-to-end tests: a server process, engine worker processes, schedulers."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from kvtrio.client import SchedulerAdapter
from kvtrio.launch import ServerProcess

from .._support.e2e import BLOCK, SERVER_ARGS, Worker
from .._support.waiting import wait_for


@pytest.fixture
def server(server_process: Callable[..., ServerProcess]) -> ServerProcess:
    return server_process(*SERVER_ARGS)


@pytest.fixture
def workers(server: ServerProcess) -> Iterator[Callable[..., Worker]]:
    started: list[Worker] = []

    def start(
        model: str = "m", world: int = 1, rank: int = 0, layout: str = "flash_attn", *flags: str
    ) -> Worker:
        worker = Worker(server.endpoint, model, world, rank, layout, flags)
        started.append(worker)
        worker.wait_registered()
        return worker

    yield start
    for worker in started:
        worker.close()


@pytest.fixture
def scheduler(server: ServerProcess) -> Iterator[Callable[..., SchedulerAdapter]]:
    adapters: list[SchedulerAdapter] = []

    def make(model: str = "m", world: int = 1) -> SchedulerAdapter:
        adapter = SchedulerAdapter(server.endpoint, model, world, 0, BLOCK, timeout=3.0)
        adapters.append(adapter)
        wait_for(lambda: adapter.client.server_info is not None, what="the scheduler to connect")
        return adapter

    yield make
    for adapter in adapters:
        adapter.close()
