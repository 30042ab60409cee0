"""The disk backend's record format: headers, their MACs, sizes, and the names kept with an object.

A segment is a sequence of records, each aligned to :data:`ALIGN` bytes::

    record header (128 B): magic "KVS2" | version u16 | key length u16 | key (32 B, zero-padded)
                           | length u64 | owner (16 B) | MAC (16 B) | key id (8 B)
                           | names length u32 | names digest (16 B) | 20 zeros
    the object (length bytes), then its names (names length bytes), then zeros up to the next
    multiple of ALIGN

The MAC is BLAKE2b-128 keyed with the L2's **secret** (32 random bytes in ``<root>/secret``,
mode 0600, made by the first scan) over the first 64 bytes, and in a version 3 header the names'
length and digest too: only this server can write a header that checks out. A record's object
holds bytes a client chose (a chunk); without the key, no chunk can carry a header the scan
would accept, so stepping over damage never turns a client's bytes into an object (issue 22: a
planted record for another tenant's key). ``owner`` is the tenant tag the object was stored for
(its share of the capacity; zeros when unknown). The **key id** (zeros in older records) names
the secret that signed it, outside the MAC: never trusted, it only lets the scan say that records
were signed with another secret (a replaced secret file), not damaged.

**Names** (version 3, issue 35): what the server's KV events name the object by (opaque bytes
here, ``accepts_names``), written in the record's padding after the object, so a record with
names takes exactly the blocks it would take without (names that do not fit there are left
out: :func:`names_room`). Their BLAKE2b-128 digest is in the header, under its MAC: names read
back are this server's or nothing. A record without names is written as version 2, the format
of the versions before, which still reads it (and this one reads theirs).
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import struct

__all__ = [
    "ALIGN",
    "OWNER_SIZE",
    "RECORD_HEADER",
    "Parsed",
    "key_id",
    "key_id_of",
    "names_digest",
    "names_room",
    "parse_record_header",
    "record_header",
    "record_size",
    "tombstone",
]

ALIGN = 4096
"""Records start on multiples of this (a filesystem block): a punched record frees whole
blocks, and the scan can step from block to block over damage."""
_MAGIC = b"KVS2"
_VERSION, _NAMED = 2, 3
_FIELDS = struct.Struct("<4sHH32sQ16s")
_NAMES = struct.Struct("<I16s")
_HEAD = struct.Struct("<64s16s8s20s20x")
_KEY_ID = slice(80, 88)  # (in _HEAD)
RECORD_HEADER = _HEAD.size
OWNER_SIZE = 16
_NO_NAMES = bytes(_NAMES.size)

Parsed = tuple[bytes, int, bytes, int, bytes]
"""(key, object length, owner, names length, names digest) of a record header."""


def record_size(length: int) -> int:
    """Bytes a record of an object of ``length`` bytes takes in its segment (aligned)."""
    return -(-(RECORD_HEADER + length) // ALIGN) * ALIGN


def names_room(length: int) -> int:
    """The most bytes of names a record of an object of ``length`` bytes keeps (its padding)."""
    return record_size(length) - RECORD_HEADER - length


def names_digest(names: bytes | bytearray | memoryview) -> bytes:
    return hashlib.blake2b(names, digest_size=16).digest()


def _mac(secret: bytes, fields: bytes) -> bytes:
    return hashlib.blake2b(fields, digest_size=16, key=secret).digest()


@functools.lru_cache(maxsize=8)
def key_id(secret: bytes) -> bytes:
    """8 bytes that name ``secret`` without telling anything of it (keyed BLAKE2b)."""
    return hashlib.blake2b(b"kvtrio L2 key id", digest_size=8, key=secret).digest()


def key_id_of(raw: bytes | bytearray) -> bytes | None:
    """The key id in what looks like a header of this format, or None (unauthenticated)."""
    identity = bytes(raw[_KEY_ID])
    if len(raw) < RECORD_HEADER or bytes(raw[:4]) != _MAGIC:
        return None
    if int.from_bytes(raw[4:6], "little") not in (_VERSION, _NAMED):
        return None
    return identity if any(identity) else None


def record_header(
    key: bytes, length: int, owner: bytes, secret: bytes, names: bytes | None = None
) -> bytes:
    """The header of a record of ``key`` (at most 32 bytes: its length is in the header) for
    ``owner`` (at most 16 bytes), authenticated with the L2's ``secret`` (and naming it by its
    :func:`key_id`); with ``names`` (at most :func:`names_room` bytes, written after the object)
    their length and digest, under the MAC (version 3)."""
    version = _NAMED if names else _VERSION
    fields = _FIELDS.pack(_MAGIC, version, len(key), key, length, owner)
    extension = _NAMES.pack(len(names), names_digest(names)) if names else _NO_NAMES
    mac = _mac(secret, fields + extension if names else fields)
    return _HEAD.pack(fields, mac, key_id(secret), extension)


def parse_record_header(raw: bytes | bytearray, secret: bytes) -> Parsed | None:
    """(key, length, owner, names length, names digest) of a record header this L2 wrote, or
    None if it is not one (damage, zeros, another format, bytes that merely look like a header
    without the secret's MAC, or names that would not fit in the record's padding)."""
    if len(raw) < RECORD_HEADER:
        return None
    fields, mac, _, extension = _HEAD.unpack_from(raw)
    version = int.from_bytes(fields[4:6], "little")
    signed = fields + extension if version == _NAMED else fields
    if not hmac.compare_digest(mac, _mac(secret, signed)):
        return None
    magic, version, key_length, key, length, owner = _FIELDS.unpack(fields)
    if magic != _MAGIC or version not in (_VERSION, _NAMED) or key_length > len(key):
        return None
    names_length, digest = _NAMES.unpack(extension) if version == _NAMED else (0, b"")
    if names_length > names_room(length):
        return None
    return key[:key_length], length, owner.rstrip(b"\0"), names_length, digest


def tombstone(size: int, secret: bytes) -> bytes:
    """The header that unmakes a record of ``size`` bytes (its whole aligned range) where no
    hole can be punched: authenticated, with no key (so never an object), and the range's
    length, so the scan steps over the dead record's bytes instead of reading them as damage."""
    return record_header(b"", size - RECORD_HEADER, b"", secret)
