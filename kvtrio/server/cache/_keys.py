"""The two kinds of key in the cache, kept apart by their types.

- A **request key** (:data:`RequestKey`, a ``str``) names one request of one engine: its
  engine, model, tenant and the engine's request id (engines reuse request ids freely). Leases,
  loads and limits are kept per request key.
- An **object key** (``bytes``) names one cached chunk: the 16-byte namespace of its model and
  rank followed by its 16-byte chunk hash. L1, L2 and the lease table's ``key`` are object keys.

The wire's ``request`` field of a message holds the engine's request id, from which the request
key is made (:func:`request_key`). Also here, as the other name every cache module shares: how a
write reservation ends (:data:`WriteEnd`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, NewType

from ...errors import ErrorCode, RequestError
from ...protocol import MAX_HASHES

__all__ = ["CHUNK_HASH_SIZE", "RequestKey", "WriteEnd", "checked_hashes", "request_key"]

CHUNK_HASH_SIZE = 16

RequestKey = NewType("RequestKey", str)
"""A request as the cache's tables know it (see the module doc)."""


def request_key(engine: str, model: str, tenant: str, request_id: str) -> RequestKey:
    """The key of request ``request_id`` of ``engine`` for ``model`` in ``tenant``: one key
    per four strings, whatever they hold (the lengths first: was joined by NUL alone, which
    any of them may hold, so that engine "a NUL b" of model "c" and engine "a" of model
    "b NUL c" shared their requests' pins and limits)."""
    lengths = f"{len(engine)}.{len(model)}.{len(tenant)}"
    return RequestKey("\x00".join((lengths, engine, model, tenant, request_id)))


def checked_hashes(hashes: Sequence[bytes], name: str = "chunk_hashes") -> Sequence[bytes]:
    """Chunk hashes as sent: an array of at most ``MAX_HASHES`` binary values of exactly 16
    bytes each, else ``bad_request`` saying what is wrong and where.

    The codec checks most arrays' types already; a ``lookup_batch``'s hash lists are checked
    here only, so that one bad list fails its own lookup, not the whole batch.
    """
    if type(hashes) not in (tuple, list):
        raise RequestError(
            ErrorCode.BAD_REQUEST,
            f"{name}: expected an array of binary values, got {type(hashes).__name__}",
        )
    if len(hashes) > MAX_HASHES:
        raise RequestError(
            ErrorCode.BAD_REQUEST,
            f"{name}: at most {MAX_HASHES} chunk hashes in one message (MAX_HASHES), got "
            f"{len(hashes)}: send the rest in another message",
        )
    for index, chunk_hash in enumerate(hashes):
        if type(chunk_hash) is not bytes or len(chunk_hash) != CHUNK_HASH_SIZE:
            got = (
                f"{len(chunk_hash)} bytes"
                if type(chunk_hash) is bytes
                else f"a {type(chunk_hash).__name__}"
            )
            raise RequestError(
                ErrorCode.BAD_REQUEST,
                f"{name}: every chunk hash is {CHUNK_HASH_SIZE} bytes of binary data; "
                f"the one at index {index} is {got}",
            )
    return hashes


WriteEnd = Literal["commit", "abort", "quarantine"]
"""How a write reservation ends: its chunk becomes visible (and goes to L2), its slot is freed,
or its slot is kept out of use for a while (a late writer may still be copying into it)."""
