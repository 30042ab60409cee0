"""The names the disk L2 keeps beside each object (issue 35: a restarted server announces the
chunks an earlier one left under their names before any lookup): written in the record's
padding, read back after a restart, authenticated like the header, and an L2 written by the
version before (records without names, format version 2) still read."""

from __future__ import annotations

import hashlib
import struct
from pathlib import Path

from kvtrio.l2._diskrecord import RECORD_HEADER, key_id, names_room, record_size
from kvtrio.l2._diskscan import load_secret
from kvtrio.l2._framing import HEADER_SIZE, header
from kvtrio.l2.disk import DiskBackend, DiskOptions

SPACE = b"S" * 16
FINGERPRINT = b"F" * 16
CHUNK = 64 << 10  # (a record's padding: 4096 - 128 - 72 bytes)


def _key(i: int) -> bytes:
    return SPACE + i.to_bytes(16, "big")


def _object(key: bytes, fill: int) -> tuple[bytes, bytes]:
    payload = bytes([fill]) * CHUNK
    return header(key, FINGERPRINT, payload), payload


async def _loads(backend: DiskBackend, key: bytes, payload: bytes) -> bool:
    head, body = bytearray(HEADER_SIZE), bytearray(len(payload))
    (ok,) = await backend.load([key], [[memoryview(head), memoryview(body)]])
    return ok and bytes(body) == payload


async def _store(backend: DiskBackend, keys: list[bytes], names: list[bytes | None]) -> None:
    objects = [_object(key, i) for i, key in enumerate(keys)]
    parts = [[memoryview(h), memoryview(p)] for h, p in objects]
    assert await backend.store(keys, parts, names=names) == [True] * len(keys)


def _segment(root: Path) -> Path:
    (path,) = (root / "segments").iterdir()
    return path


async def test_names_come_back_after_a_restart_newest_first(tmp_path: Path) -> None:
    backend = DiskBackend(DiskOptions(path=str(tmp_path)))
    keys = [_key(i) for i in range(4)]
    await _store(backend, keys, [b"zero", b"one", None, b"three"])
    await _store(backend, [b"T" * 32], [b"another space"])
    assert await backend.names(SPACE, 1 << 20) == [
        (keys[3], b"three"),
        (keys[1], b"one"),
        (keys[0], b"zero"),
    ]
    await backend.aclose()
    restarted = DiskBackend(DiskOptions(path=str(tmp_path)))
    found = await restarted.names(SPACE, 1 << 20)
    assert found == [(keys[3], b"three"), (keys[1], b"one"), (keys[0], b"zero")]
    assert await restarted.names(SPACE, 7) == [(keys[3], b"three")]  # (at most 7 bytes)
    assert await restarted.lookup_and_lock(keys) == 4
    assert await _loads(restarted, keys[3], _object(keys[3], 3)[1])
    await restarted.unlock(keys)
    await restarted.delete(keys[3:])
    assert [key for key, _ in await restarted.names(SPACE, 1 << 20)] == [keys[1], keys[0]]
    await restarted.aclose()


async def test_names_take_no_more_room_than_the_record(tmp_path: Path) -> None:
    backend = DiskBackend(DiskOptions(path=str(tmp_path)))
    room = names_room(HEADER_SIZE + CHUNK)
    keys = [_key(0), _key(1)]
    await _store(backend, keys, [b"n" * room, b"n" * (room + 1)])  # the second does not fit
    assert await backend.names(SPACE, 1 << 20) == [(keys[0], b"n" * room)]
    assert _segment(tmp_path).stat().st_size == 2 * record_size(HEADER_SIZE + CHUNK)
    assert await _loads(backend, keys[1], _object(keys[1], 1)[1])
    await backend.aclose()


def _previous_version_record(key: bytes, length: int, secret: bytes) -> bytes:
    """A record header exactly as the version before names wrote it (format version 2: the
    MAC over the first 64 bytes, then the key id and 40 zeros)."""
    fields = struct.pack("<4sHH32sQ16s", b"KVS2", 2, len(key), key, length, b"")
    mac = hashlib.blake2b(fields, digest_size=16, key=secret).digest()
    return struct.pack("<64s16s8s40x", fields, mac, key_id(secret))


async def test_an_l2_written_by_the_version_before_still_reads(tmp_path: Path) -> None:
    backend = DiskBackend(DiskOptions(path=str(tmp_path)))
    await _store(backend, [_key(9)], [None])  # (creates the secret and a segment)
    await backend.aclose()
    secret, _ = load_secret(tmp_path)
    old_key = _key(1)
    head, payload = _object(old_key, 7)
    record = _previous_version_record(old_key, len(head) + len(payload), secret) + head + payload
    record += bytes(record_size(len(head) + len(payload)) - len(record))
    with _segment(tmp_path).open("ab") as segment:
        segment.write(record)
    restarted = DiskBackend(DiskOptions(path=str(tmp_path)))
    assert await restarted.lookup_and_lock([old_key]) == 1
    assert await _loads(restarted, old_key, payload)
    await restarted.unlock([old_key])
    assert await restarted.names(SPACE, 1 << 20) == []
    # Written now without names: the version before reads it (the same format, version 2).
    with _segment(tmp_path).open("rb") as segment:
        assert segment.read(RECORD_HEADER)[4:6] == (2).to_bytes(2, "little")
    await restarted.aclose()


async def test_names_changed_on_disk_are_never_read_back(tmp_path: Path) -> None:
    backend = DiskBackend(DiskOptions(path=str(tmp_path)))
    keys = [_key(0), _key(1)]
    await _store(backend, keys, [b"names of zero", b"names of one"])
    await backend.aclose()
    size = record_size(HEADER_SIZE + CHUNK)
    with _segment(tmp_path).open("r+b") as segment:
        segment.seek(RECORD_HEADER + HEADER_SIZE + CHUNK)  # the first record's names
        segment.write(b"N")
        segment.seek(size + 88)  # the second record's names length (under the header's MAC)
        segment.write(b"\x05")
    restarted = DiskBackend(DiskOptions(path=str(tmp_path)))
    assert await restarted.names(SPACE, 1 << 20) == []
    assert await restarted.lookup_and_lock(keys) == 1  # (the second is no record any more)
    assert await _loads(restarted, keys[0], _object(keys[0], 0)[1])  # (its object is whole)
    await restarted.unlock(keys[:1])
    await restarted.aclose()
