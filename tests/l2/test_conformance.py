"""kvtrio's own backends run the conformance suite, exactly as a third party's would."""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

import kvtrio.l2._diskio
from kvtrio.l2 import Backend
from kvtrio.l2.disk import DiskBackend, DiskOptions
from kvtrio.l2.memory import MemoryBackend
from kvtrio.options import ByteSize
from kvtrio.testing import BackendConformance, FaultBackend


class TestMemory(BackendConformance):
    @pytest.fixture
    async def backend(self) -> AsyncIterator[Backend]:
        backend = MemoryBackend()
        yield backend
        await backend.aclose()


class _FailingOS:
    """``os`` for the disk backend's worker threads, with reads and writes failing with EIO (a
    dying disk: the one fault here that cannot be caused for real)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)

    @staticmethod
    def preadv(fd: int, buffers: Any, offset: int) -> int:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    pwritev = preadv


class TestDisk(BackendConformance):
    fault_kinds = ("eio", "dir_replaced")

    @pytest.fixture
    async def backend(self, tmp_path: Path) -> AsyncIterator[Backend]:
        backend = DiskBackend(DiskOptions(path=str(tmp_path / "l2")))
        yield backend
        await backend.aclose()

    @asynccontextmanager
    async def fault(self, backend: Backend, kind: str) -> AsyncIterator[None]:
        assert isinstance(backend, DiskBackend)
        root = backend.root
        if kind == "eio":
            saved = kvtrio.l2._diskio.os
            kvtrio.l2._diskio.os = _FailingOS()  # type: ignore[assignment]
            try:
                yield
            finally:
                kvtrio.l2._diskio.os = saved
        elif kind == "dir_replaced":
            moved = root.with_name(root.name + ".moved")
            root.rename(moved)
            root.write_bytes(b"not a directory")
            try:
                yield
            finally:
                root.unlink()
                moved.rename(root)
        else:
            raise AssertionError(kind)


class TestDiskOneRecordPerSegment(BackendConformance):
    """Every object in a segment file of its own: segments start and go all the time."""

    @pytest.fixture
    async def backend(self, tmp_path: Path) -> AsyncIterator[Backend]:
        backend = DiskBackend(DiskOptions(path=str(tmp_path / "l2"), segment_size=ByteSize(1)))
        yield backend
        await backend.aclose()


def _fill(path: Path) -> None:
    """Write ``path`` until the filesystem is full (ENOSPC)."""
    with path.open("wb", buffering=0) as out:
        while True:
            try:
                out.write(b"f" * (64 << 10))
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                return


def _mount(*args: str) -> None:
    subprocess.run(["mount", *args], check=True, capture_output=True)


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A real 8 MiB tmpfs (mounting needs root; skipped where it is not allowed)."""
    mount = tmp_path / "mnt"
    mount.mkdir()
    try:
        _mount("-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mount))
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"cannot mount a tmpfs here: {exc.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


class TestDiskOnASmallFilesystem(BackendConformance):
    """Read-only and full for real: a remount and a filler file on a small tmpfs."""

    fault_kinds = ("read_only", "full")

    @pytest.fixture
    async def backend(self, small_tmpfs: Path) -> AsyncIterator[Backend]:
        backend = DiskBackend(DiskOptions(path=str(small_tmpfs / "l2")))
        yield backend
        await backend.aclose()

    @asynccontextmanager
    async def fault(self, backend: Backend, kind: str) -> AsyncIterator[None]:
        assert isinstance(backend, DiskBackend)
        mount = backend.root.parent
        if kind == "read_only":
            _mount("-o", "remount,ro", str(mount))
            try:
                yield
            finally:
                _mount("-o", "remount,rw", str(mount))
        elif kind == "full":
            filler = mount / "filler"
            _fill(filler)
            try:
                yield
            finally:
                filler.unlink()
        else:
            raise AssertionError(kind)


class TestFaultWithoutFaults(BackendConformance):
    """The wrapper itself, faults off, must not change the semantics; faults on, it is the
    ``unavailable`` service of the fault kit."""

    fault_kinds = ("unavailable",)

    @asynccontextmanager
    async def fault(self, backend: Backend, kind: str) -> AsyncIterator[None]:
        assert isinstance(backend, FaultBackend)
        assert kind == "unavailable"
        backend.configure(error_rate=1.0)
        try:
            yield
        finally:
            backend.configure(error_rate=0.0)

    @pytest.fixture
    async def backend(self) -> AsyncIterator[Backend]:
        backend = FaultBackend(inner=MemoryBackend())
        yield backend
        await backend.aclose()
