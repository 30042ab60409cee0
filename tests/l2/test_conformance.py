"""kvtrio's own backends run the conformance suite, exactly as a third party's would."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from kvtrio.l2 import Backend
from kvtrio.l2.disk import DiskBackend, DiskOptions
from kvtrio.l2.fault import FaultBackend
from kvtrio.l2.memory import MemoryBackend
from kvtrio.testing import BackendConformance


class TestMemory(BackendConformance):
    @pytest.fixture
    async def backend(self) -> AsyncIterator[Backend]:
        backend = MemoryBackend()
        yield backend
        await backend.aclose()


class TestDisk(BackendConformance):
    @pytest.fixture
    async def backend(self, tmp_path: Path) -> AsyncIterator[Backend]:
        backend = DiskBackend(DiskOptions(path=str(tmp_path / "l2")))
        yield backend
        await backend.aclose()


class TestFaultWithoutFaults(BackendConformance):
    """The wrapper itself, faults off, must not change the semantics."""

    @pytest.fixture
    async def backend(self) -> AsyncIterator[Backend]:
        backend = FaultBackend(inner=MemoryBackend())
        yield backend
        await backend.aclose()
