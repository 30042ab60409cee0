"""The frame around every L2 object: a fixed header, then the chunk.

Header (``HEADER_SIZE`` = 72 bytes, little-endian)::

    magic "KVT2" | version u16 | flags u16 | key 32 B | fingerprint 16 B | length u64 | xxh3-64 u64

``key`` is the object key, ``fingerprint`` the model profile digest of the chunk's KV format,
``length`` the chunk's size and the checksum xxh3-64 of the chunk. A loaded object whose header
or checksum does not match is a miss: the server deletes it and counts it.
"""

from __future__ import annotations

import struct

import xxhash

__all__ = ["FORMAT_VERSION", "HEADER_SIZE", "Corrupt", "check", "header"]

FORMAT_VERSION = 1
_MAGIC = b"KVT2"
_LAYOUT = struct.Struct("<4sHH32s16sQQ")
HEADER_SIZE = _LAYOUT.size


class Corrupt(ValueError):
    """A loaded object does not match its header (or the header the server expected)."""


def checksum(payload: memoryview | bytes | bytearray) -> int:
    return xxhash.xxh3_64_intdigest(payload)


def header(key: bytes, fingerprint: bytes, payload: memoryview | bytes | bytearray) -> bytes:
    """The header of an object holding ``payload`` (computes its checksum: ~7 GB/s)."""
    return _LAYOUT.pack(
        _MAGIC, FORMAT_VERSION, 0, key, fingerprint, len(payload), checksum(payload)
    )


def check(raw: bytes | memoryview, key: bytes, fingerprint: bytes, payload: memoryview) -> None:
    """Verify a loaded object; raise :class:`Corrupt` saying what does not match."""
    if len(raw) != HEADER_SIZE:
        raise Corrupt(f"header of {len(raw)} bytes")
    magic, version, _, stored_key, stored_fp, length, digest = _LAYOUT.unpack(raw)
    if magic != _MAGIC:
        raise Corrupt("not a kvtrio object")
    if version != FORMAT_VERSION:
        raise Corrupt(f"format version {version}, expected {FORMAT_VERSION}")
    if stored_key != key:
        raise Corrupt("the object is stored under another key")
    if stored_fp != fingerprint:
        raise Corrupt("the object has another KV layout fingerprint")
    if length != len(payload):
        raise Corrupt(f"{length} bytes, expected {len(payload)}")
    if digest != checksum(payload):
        raise Corrupt("checksum mismatch")
