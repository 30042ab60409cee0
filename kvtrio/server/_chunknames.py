"""A chunk's names in the server's KV events (:class:`ChunkNames`), and their record: the bytes
kept beside the chunk in an L2 backend that keeps names (``accepts_names``: the disk L2), read
back after a restart so that the chunk is announced under its names before any lookup.

**The record** (:class:`NamesRecord`, :func:`decode_names`): a msgpack array ``[1, block_size,
parent_block_hash, store]``, ``store`` the body of a ``Store`` request (the protocol's encoding)
carrying the chunk's ``block_hashes``, ``token_ids`` (4 bytes a token), ``extra_keys``,
``lora_name`` and group fields. Decoding checks every field as a client's store is checked
(``decode_request``: the same bounds), and that the parts fit together (as many tokens and
extra keys as blocks, a ``block_size`` that divides ``chunk_size``): a backend authenticates
the record (a disk L2's MAC), and this checks it once more, so a record is this server's or
nothing. About 1.3 KiB for a chunk of 256 tokens in 16 blocks.
"""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np
from attrs import frozen

from ..errors import ProtocolError
from ..protocol import (
    MAX_BLOCK_HASH_BYTES,
    ExtraKeys,
    PackedTokens,
    Retrieve,
    Store,
    decode_request,
    msgpack_uint32s,
)

__all__ = ["ChunkNames", "NamesRecord", "StoreNames", "decode_names", "kept_names"]

_RECORD_VERSION = 1

_ENTRY_BYTES = 512
"""What a chunk's entry costs besides its hashes: its key, its ``ChunkNames``, tuple, set and
table slots (CPython 3.11, measured with ``sys.getsizeof``, rounded up)."""


@frozen
class StoreNames:
    """What a store said of all its blocks (``Store``'s fields; one for many chunks)."""

    lora_name: str = ""
    group_idx: int = -1
    spec_kind: str = ""
    sliding_window: int = 0


_NO_NAMES = StoreNames()


def kept_names(store: Store | Retrieve | None) -> tuple[bytes, ExtraKeys, StoreNames]:
    """A store's tokens, extra keys and the rest of what is kept of it."""
    if store is None:
        return b"", (), _NO_NAMES
    if isinstance(store, Retrieve):
        names = StoreNames(store.lora_name)
    else:
        names = StoreNames(
            store.lora_name,
            store.group_idx,
            store.kv_cache_spec_kind,
            store.kv_cache_spec_sliding_window,
        )
    return store.token_ids, store.extra_keys, _NO_NAMES if names == _NO_NAMES else names


class ChunkNames:
    """How one chunk is named in events, and the tiers that announced it."""

    __slots__ = (
        "block_size", "cost", "extra", "hashes", "named", "parent", "parent_hash", "store",
        "tenant", "tiers", "tokens",
    )  # fmt: skip

    def __init__(
        self,
        tenant: str,
        hashes: tuple[int | bytes, ...],
        block_size: int,
        parent: bytes | None,
        tokens: PackedTokens | None = None,
        extra: ExtraKeys | None = None,
        store: StoreNames = _NO_NAMES,
        *,
        named: bool = True,
    ) -> None:
        self.tenant = tenant
        self.named = named
        """Whether a store named it (else a tier found it by its chunk hash alone)."""
        self.hashes = hashes
        self.block_size = block_size
        self.parent = parent
        """The object key of the chunk before this one, if known."""
        self.parent_hash: int | bytes | None = None
        """The last block hash of the chunk before, once announced with one (kept: the chunk
        before may be forgotten first, and a router keys this chunk's blocks from it)."""
        self.tiers: set[str] = set()
        """The labels of the tiers that hold it (``CPU`` for L1, an L2 backend's)."""
        self.store = store
        """The store's LoRA and group fields (its tokens and extra keys are this chunk's)."""
        self.extra = extra
        self.tokens = tokens
        """Its tokens as a batch sends them (one ``PackedTokens`` for every event), or None."""
        self.cost = (
            _ENTRY_BYTES
            + len(hashes) * (48 + len(hashes[0]) if hashes and type(hashes[0]) is bytes else 44)
            + (0 if tokens is None else 56 + len(tokens.packed))
            + (0 if extra is None else 64 + 72 * len(extra))
        )
        """Bytes these names hold (an estimate)."""


@frozen
class NamesRecord:
    """A chunk's names as an L2 backend keeps them (taken on the loop, encoded in a thread)."""

    hashes: tuple[int | bytes, ...]
    block_size: int
    parent_hash: int | bytes | None
    tokens: PackedTokens | None
    extra: ExtraKeys | None
    store: StoreNames

    def encode(self) -> bytes:
        """The record's bytes (see the module docstring): the store's body built as the
        protocol's encoding has it (its fields by name; those at their defaults left out), with
        no ``Store`` made (~7 µs for 256 tokens, where ``encode_request`` took 18)."""
        body: dict[str, object] = {"request": "", "start": 0, "block_hashes": self.hashes}
        raw = b""
        if self.tokens is not None and self.tokens.packed:
            packed = self.tokens.packed
            elements = packed[{0xDC: 3, 0xDD: 5}.get(packed[0], 1) :]  # (after the header)
            raw = np.frombuffer(elements, dtype=np.uint8).reshape(-1, 5)[:, :0:-1].tobytes()
            body["token_ids"] = raw  # (each uint 32 big-endian, reversed: little-endian)
        body["end"] = len(raw) // 4
        store = self.store
        for name, value, default in (
            ("extra_keys", self.extra, None),
            ("lora_name", store.lora_name, ""),
            ("group_idx", store.group_idx, -1),
            ("kv_cache_spec_kind", store.spec_kind, ""),
            ("kv_cache_spec_sliding_window", store.sliding_window, 0),
        ):
            if value and value != default:
                body[name] = value
        packed_body = msgpack.packb(body, use_bin_type=True)
        return msgpack.packb(  # type: ignore[no-any-return]
            (_RECORD_VERSION, self.block_size, self.parent_hash, packed_body), use_bin_type=True
        )


def _block_hash(value: Any) -> bool:
    kind = type(value)
    return (kind is int and 0 <= value < 1 << 64) or (
        kind is bytes and len(value) <= MAX_BLOCK_HASH_BYTES
    )


def decode_names(record: bytes, tenant: str, chunk_size: int) -> ChunkNames | None:
    """The names of a chunk of ``tenant`` from its record, or None if it is not a whole, valid
    record for chunks of ``chunk_size`` tokens (see the module docstring)."""
    try:
        raw = msgpack.unpackb(record, use_list=False, raw=False, strict_map_key=True)
    except Exception:
        return None
    if type(raw) is not tuple or len(raw) != 4 or raw[0] != _RECORD_VERSION:
        return None
    _, size, parent, body = raw
    if type(size) is not int or not 0 < size <= chunk_size or chunk_size % size:
        return None
    if (parent is not None and not _block_hash(parent)) or type(body) is not bytes:
        return None
    try:
        store = decode_request("store", body)
    except ProtocolError:
        return None
    if not isinstance(store, Store):
        return None
    hashes, tokens, extra = store.block_hashes, store.token_ids, store.extra_keys
    if not 0 < len(hashes) <= chunk_size // size:
        return None
    if (tokens and len(tokens) != 4 * size * len(hashes)) or (extra and len(extra) != len(hashes)):
        return None
    _, _, kept = kept_names(store)
    names = ChunkNames(
        tenant,
        hashes,
        size,
        None,
        PackedTokens.of(msgpack_uint32s(tokens)) if tokens else None,
        extra or None,
        kept,
    )
    names.parent_hash = parent
    return names
