"""The disk L2 never serves one tenant's bytes as another's (issue 22, item 1).

A tenant chooses the bytes of its chunks. Before, the restart scan stepped over a damaged record
block by block and took any well-formed header it met for a record, so a chunk carrying a
complete record for another tenant's key became that key's object after a torn write, a flipped
bit, or an eviction on a filesystem without holes (its header zeroed). Record headers are now
authenticated with the L2's secret: no client can write one the scan accepts."""

from __future__ import annotations

import errno
import logging
import os
import stat
from pathlib import Path

import pytest

import kvtrio.l2._diskio
from kvtrio.l2._diskio import ALIGN, RECORD_HEADER, record_header, record_size, segment_name
from kvtrio.l2._framing import HEADER_SIZE, header
from kvtrio.l2.disk import DiskBackend, DiskOptions
from kvtrio.options import ByteSize

A_KEY, B_KEY, C_KEY = b"A" * 32, b"B" * 32, b"C" * 32
FINGERPRINT = b"F" * 16
CHUNK = 64 << 10
FORGED = b"not B's KV" * 400


def _forged_record(secret: bytes) -> bytes:
    """A whole record of B's key (header, frame, payload) as a client could build it, with
    ``secret`` standing for its best guess of the server's."""
    frame = header(B_KEY, FINGERPRINT, FORGED)
    return record_header(B_KEY, len(frame) + len(FORGED), b"", secret) + frame + FORGED


def _planted_chunk(forged: bytes) -> bytes:
    """Tenant A's chunk, with ``forged`` where it lands on a block boundary of the segment."""
    chunk = bytearray(os.urandom(CHUNK))
    at = ALIGN - RECORD_HEADER - HEADER_SIZE  # record header + frame come before the chunk
    chunk[at : at + len(forged)] = forged
    return bytes(chunk)


def _damage(root: Path, how: str) -> None:
    path = root / "segments" / segment_name(0)
    if how == "torn":  # a kill -9 during the write: A's record does not fit in the file
        os.truncate(path, RECORD_HEADER + HEADER_SIZE + CHUNK - 100)
    elif how == "flipped":  # one flipped bit in A's record header
        with path.open("r+b") as segment:
            segment.seek(5)
            bit = segment.read(1)[0] ^ 1
            segment.seek(5)
            segment.write(bytes([bit]))
    elif how == "zeroed":  # the earlier no-punch fallback: A's header zeroed, its bytes kept
        with path.open("r+b") as segment:
            segment.write(bytes(RECORD_HEADER))


async def _b_reads(restarted: DiskBackend) -> bytes | None:
    if not await restarted.lookup_and_lock([B_KEY]):
        return None
    head, body = bytearray(HEADER_SIZE), bytearray(len(FORGED))
    (ok,) = await restarted.load([B_KEY], [[memoryview(head), memoryview(body)]])
    return bytes(body) if ok else None


@pytest.mark.parametrize("guess", ["random", "empty"])
@pytest.mark.parametrize("how", ["torn", "flipped", "zeroed"])
async def test_a_record_planted_in_a_chunk_is_never_an_object(
    tmp_path: Path, how: str, guess: str, caplog: pytest.LogCaptureFixture
) -> None:
    secret = os.urandom(32) if guess == "random" else b""
    backend = DiskBackend(DiskOptions(path=str(tmp_path)))
    chunk = _planted_chunk(_forged_record(secret))
    assert await backend.store([A_KEY], [[header(A_KEY, FINGERPRINT, chunk), chunk]]) == [True]
    _damage(tmp_path, how)
    caplog.set_level(logging.WARNING, logger="kvtrio.l2.disk")
    await backend.aclose()  # (it stops: the directory lock goes, as at kill -9)
    restarted = DiskBackend(DiskOptions(path=str(tmp_path)))
    assert await _b_reads(restarted) is None
    assert await restarted.lookup_and_lock([A_KEY]) == 0
    # The damage is not silent: counted and logged by the scan.
    assert restarted.statistics()["scan_damaged"] >= 1
    assert any("damaged" in r.getMessage() for r in caplog.records)


async def test_the_no_punch_fallback_leaves_a_tombstone_the_scan_steps_over(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def unsupported(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))

    monkeypatch.setattr(kvtrio.l2._diskio, "_fallocate", unsupported)
    backend = DiskBackend(DiskOptions(path=str(tmp_path)))
    chunk = _planted_chunk(_forged_record(os.urandom(32)))
    parts = [[header(A_KEY, FINGERPRINT, chunk), chunk], [b"c" * 100]]
    assert await backend.store([A_KEY, C_KEY], parts) == [True, True]
    await backend.delete([A_KEY])  # no hole: a tombstone over A's header, its bytes stay
    await backend.aclose()  # (it stops: the directory lock goes, as at kill -9)
    restarted = DiskBackend(DiskOptions(path=str(tmp_path)))
    assert await restarted.lookup_and_lock([A_KEY]) == 0
    assert await restarted.lookup_and_lock([B_KEY]) == 0
    assert await restarted.lookup_and_lock([C_KEY]) == 1  # found after the dead record
    assert restarted.statistics().get("scan_damaged", 0) == 0  # a tombstone is not damage


async def test_the_secret_is_private_and_stable_across_restarts(tmp_path: Path) -> None:
    backend = DiskBackend(DiskOptions(path=str(tmp_path)))
    assert await backend.store([C_KEY], [[b"c" * 100]]) == [True]
    secret = tmp_path / "secret"
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    first = secret.read_bytes()
    await backend.aclose()  # (it stops: the directory lock goes, as at kill -9)
    restarted = DiskBackend(DiskOptions(path=str(tmp_path)))
    assert await restarted.lookup_and_lock([C_KEY]) == 1
    assert secret.read_bytes() == first


async def test_records_of_a_lost_secret_are_dropped_counted_and_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    backend = DiskBackend(DiskOptions(path=str(tmp_path)))
    assert await backend.store([C_KEY], [[b"c" * 100]]) == [True]
    (tmp_path / "secret").write_bytes(b"short")  # damaged: replaced by a new secret
    caplog.set_level(logging.WARNING, logger="kvtrio.l2.disk")
    await backend.aclose()  # (it stops: the directory lock goes, as at kill -9)
    restarted = DiskBackend(DiskOptions(path=str(tmp_path)))
    assert await restarted.lookup_and_lock([C_KEY]) == 0
    assert restarted.statistics()["scan_damaged"] == 1
    assert any("secret is new" in r.getMessage() for r in caplog.records)
    assert not (tmp_path / "segments" / segment_name(0)).exists()  # nothing left in it


async def test_capacity_counts_the_bytes_on_disk(tmp_path: Path) -> None:
    """Was: payload only (129 MiB on disk for a 128 MiB capacity)."""
    size = 10_000
    backend = DiskBackend(DiskOptions(path=str(tmp_path), capacity=ByteSize(4 * record_size(size))))
    keys = [bytes([i]) * 32 for i in range(6)]
    for key in keys:
        assert await backend.store([key], [[b"x" * size]]) == [True]
    stats = backend.statistics()
    assert stats["bytes"] == 4 * record_size(size) == stats["capacity_bytes"]
    on_disk = sum(
        p.stat().st_blocks * 512 for p in (tmp_path / "segments").iterdir() if p.is_file()
    )
    assert on_disk <= stats["capacity_bytes"]
