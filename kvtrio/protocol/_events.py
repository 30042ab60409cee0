"""KV events: vLLM's wire format of ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``,
encoded and decoded with no I/O.

Routers that score engines by the prefixes they hold (llm-d, NVIDIA Dynamo, vLLM's router)
subscribe to an engine's ZeroMQ PUB socket (``vllm/distributed/kv_events.py``). A message is
three frames ``[topic, seq, payload]``: ``seq`` an 8-byte big-endian sequence number (one
counter per stream, from 0), ``payload`` a msgpack ``KVEventBatch``: the array ``[ts, events,
rank]`` (``data_parallel_rank`` nil: kvtrio is no data-parallel rank), each event a map tagged
``"type": "<class name>"`` holding the fields vLLM's ``msgspec`` classes define, in their order,
the ones with defaults left out when they are at their default (``omit_defaults``). A replay
socket (ROUTER) answers a request ``[b"", start_seq]`` with every buffered message from
``start_seq`` on, ``[b"", topic, seq, payload]``, then the end marker ``[b"", b"", END_SEQ,
b""]``. kvtrio's publisher also takes a third frame naming the topic to replay (a key may see
several tenants, each a topic of its own).

Block hashes are those the engine publishes (vLLM: the low 64 bits of its block hash as an
unsigned int by default, the hash's bytes with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``); a
chunk stored without them (token mode) is named by its kvtrio chunk hash (16 bytes) as one
block of ``chunk_size`` tokens. ``BlockStored`` carries what a router that keys blocks itself
needs (llm-d's indexer: ``token_ids``, ``parent_block_hash``, ``extra_keys``, ``lora_name``)
and vLLM 0.33's optional fields (``group_idx``, ``kv_cache_spec_*``, ``locality``,
``ownership``), each left out at its default as vLLM's ``omit_defaults`` does.

**Snapshot** (kvtrio's addition to the replay socket): a request ``[b"", SNAPSHOT_SEQ, topic]``
is answered with the topic's current blocks, ``BlockStored`` batches ``[b"", topic,
SNAPSHOT_SEQ, payload]``, then ``[b"", b"", END_SEQ, next_seq]``: the live stream from
``next_seq`` on, applied after the snapshot, brings the subscriber's state to the server's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast

import msgpack
import numpy as np
from attrs import frozen

__all__ = [
    "END_SEQ",
    "MAX_BLOCK_HASH_BYTES",
    "MAX_EXTRA_KEYS",
    "MAX_EXTRA_KEY_LENGTH",
    "SNAPSHOT_SEQ",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EventBatch",
    "ExtraKeys",
    "KVEvent",
    "PackedTokens",
    "decode_batch",
    "decode_seq",
    "encode_batch",
    "encode_seq",
    "event_block_hash",
    "events_topic",
    "pack_tokens",
    "replay_endpoint",
    "structure_extra_keys",
]

END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""The sequence frame of a replay's end marker."""

SNAPSHOT_SEQ = (-2).to_bytes(8, "big", signed=True)
"""The sequence frame of a snapshot request and of its batches."""

MAX_BLOCK_HASH_BYTES = 64
"""The longest block hash a store may carry (vLLM's are 32 bytes, or an 8-byte int)."""

MAX_EXTRA_KEYS = 16
"""The most extra keys of one block (vLLM: the LoRA name, an ``(mm_identifier, offset)`` pair
per multimodal item in the block, the cache salt, prompt-embedding digests)."""

MAX_EXTRA_KEY_LENGTH = 256
"""The longest string or binary value of an extra key (an identifier, a salt, a digest)."""

MAX_EXTRA_ENTRIES = 1 << 17
"""Entries of a store's extra keys (one per block: ``MAX_EVENT_HASHES``)."""

BlockHash = int | bytes
ExtraKey = str | int | bytes | tuple[str | int | bytes, ...]
ExtraKeys = tuple[tuple[ExtraKey, ...] | None, ...]
"""One entry per block: the block's extra keys as vLLM publishes them (untagged), or None."""


def pack_tokens(tokens: Sequence[int]) -> bytes:
    """Token ids as a store or retrieve carries them: unsigned 32-bit little-endian integers
    (``ValueError`` for ids outside ``[0, 2**32)``)."""
    if not len(tokens):
        return b""
    ids = np.asarray(tokens, dtype=np.int64)
    if ids.ndim != 1 or ids.min() < 0 or ids.max() >= 1 << 32:
        raise ValueError("token ids must be integers in [0, 2**32)")
    return ids.astype("<u4").tobytes()


def msgpack_uint32s(raw: bytes) -> bytes:
    """Unsigned 32-bit little-endian ids as the elements of a msgpack array, each a
    ``uint 32`` (``0xce`` and 4 big-endian bytes: what vLLM's decoder reads as an int), built
    with numpy (no Python int per id)."""
    ids = np.frombuffer(raw, dtype="<u4")
    out = np.empty((len(ids), 5), dtype=np.uint8)
    out[:, 0] = 0xCE
    out[:, 1:] = ids.astype(">u4").view(np.uint8).reshape(len(ids), 4)
    return out.tobytes()


class PackedTokens:
    """Token ids kept as the msgpack array a batch sends (:func:`msgpack_uint32s` after its
    header: 5 bytes a token, where a tuple of Python ints takes ~36), spliced into a batch as
    they are. Compares equal to the sequence of the same ids."""

    __slots__ = ("packed",)

    def __init__(self, packed: bytes) -> None:
        self.packed = packed

    @classmethod
    def of(cls, elements: bytes) -> PackedTokens:
        """The array of ``elements`` (:func:`msgpack_uint32s`'s)."""
        return cls(_array_header(len(elements) // 5) + elements)

    def ids(self) -> list[int]:
        first = self.packed[0] if self.packed else 0x90
        body = self.packed[{0xDC: 3, 0xDD: 5}.get(first, 1) :]  # (after the array's header)
        rows = np.frombuffer(body, dtype=np.uint8).reshape(-1, 5)[:, 1:]
        return np.ascontiguousarray(rows).view(">u4").ravel().tolist()  # type: ignore[no-any-return]

    def __len__(self) -> int:
        return len(self.packed) // 5

    def __iter__(self) -> Any:
        return iter(self.ids())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PackedTokens):
            return self.packed == other.packed
        if isinstance(other, tuple | list):
            return tuple(self.ids()) == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.packed)

    def __repr__(self) -> str:
        return f"PackedTokens({tuple(self.ids())!r})"


_TOKEN_KEY = msgpack.packb("token_ids")


_INT64 = 1 << 63
_PAIR = 4
"""The most values of one tuple-valued extra key (vLLM's ``(mm_identifier, offset)``: 2)."""


def _scalar_key(item: Any) -> bool:
    kind = type(item)
    if kind is int:
        return bool(-_INT64 <= item < _INT64)
    return (kind is str or kind is bytes) and len(item) <= MAX_EXTRA_KEY_LENGTH


def structure_extra_keys(value: Any, _: Any) -> ExtraKeys:
    """A store's extra keys: at most :data:`MAX_EXTRA_ENTRIES` entries (the count first), each
    nil or at most ``MAX_EXTRA_KEYS`` keys, each a string or binary value of at most
    ``MAX_EXTRA_KEY_LENGTH``, a signed 64-bit integer, or an array of at most 4 of those."""
    if type(value) is not tuple:
        raise TypeError(f"expected an array of extra keys, got {type(value).__name__}")
    if len(value) > MAX_EXTRA_ENTRIES:
        raise TypeError(f"expected at most {MAX_EXTRA_ENTRIES} extra keys, got {len(value)}")
    for keys in value:
        if keys is None:
            continue
        if type(keys) is not tuple or len(keys) > MAX_EXTRA_KEYS:
            raise TypeError(
                f"expected a block's extra keys as nil or an array of at most {MAX_EXTRA_KEYS}"
            )
        for key in keys:
            if type(key) is tuple:
                if len(key) <= _PAIR and all(map(_scalar_key, key)):
                    continue
            elif _scalar_key(key):
                continue
            raise TypeError(
                "expected an extra key as a string or binary value of at most "
                f"{MAX_EXTRA_KEY_LENGTH}, a 64-bit integer, or an array of at most {_PAIR} of "
                f"those, got {type(key).__name__}"
            )
    return cast(ExtraKeys, value)


def _plain(value: Any) -> Any:
    """An extra key as msgpack writes it (tuples as arrays)."""
    return list(value) if type(value) is tuple else value


def event_block_hash(block_hash: bytes, *, as_int: bool = True) -> BlockHash:
    """An engine block hash as vLLM publishes it: the unsigned int of its low 64 bits
    (``as_int``, vLLM's default) or its bytes (``maybe_convert_block_hash``)."""
    if not as_int:
        return block_hash
    return int.from_bytes(block_hash, "big") & ((1 << 64) - 1)


def events_topic(tenant: str) -> bytes:
    """The topic of ``tenant``'s events: ``kvtrio/<tenant>/`` (a ZeroMQ subscription matches
    a prefix; tenant names never hold ``/``, ``protocol._tenant``, so the closing ``/`` keeps
    one tenant's topic from matching another's)."""
    return b"kvtrio/" + tenant.encode() + b"/"


def replay_endpoint(endpoint: str) -> str:
    """The replay socket's endpoint beside an events endpoint: the next tcp port (0 stays 0),
    or the ipc path with ``.replay`` added."""
    if endpoint.startswith("ipc://"):
        return endpoint + ".replay"
    host, _, port = endpoint.rpartition(":")
    return f"{host}:{int(port) + 1}" if int(port) else f"{host}:0"


def encode_seq(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


def decode_seq(frame: bytes) -> int:
    """A sequence frame's number (-1 for the replay's end marker)."""
    return int.from_bytes(frame, "big", signed=True)


@frozen
class BlockStored:
    """Blocks became readable in ``medium`` (kvtrio: ``CPU`` for L1, ``STORAGE`` for L2, with
    ``locality`` and the backend's label as ``ownership``; ``docs/events.md``)."""

    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    token_ids: tuple[int, ...] | PackedTokens
    block_size: int
    medium: str | None
    lora_id: int | None = None
    lora_name: str | None = None
    extra_keys: ExtraKeys | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None

    def wire(self) -> dict[str, Any]:
        """The map vLLM's ``BlockStored`` encodes to (its field order; the fields that have a
        default left out at it)."""
        wire: dict[str, Any] = {
            "type": "BlockStored",
            "block_hashes": list(self.block_hashes),
            "parent_block_hash": self.parent_block_hash,
            "token_ids": [] if type(self.token_ids) is PackedTokens else list(self.token_ids),
            "block_size": self.block_size,
            "lora_id": self.lora_id,
            "medium": self.medium,
            "lora_name": self.lora_name,
        }
        if self.extra_keys is not None:
            wire["extra_keys"] = [
                None if keys is None else [_plain(k) for k in keys] for keys in self.extra_keys
            ]
        for name in _OPTIONAL_STORED:
            value = getattr(self, name)
            if value is not None:
                wire[name] = value
        return wire


_OPTIONAL_STORED = (
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
    "locality",
    "ownership",
)


@frozen
class BlockRemoved:
    """Blocks left ``medium``."""

    block_hashes: tuple[BlockHash, ...]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None

    def wire(self) -> dict[str, Any]:
        hashes = list(self.block_hashes)
        wire: dict[str, Any] = {"type": "BlockRemoved", "block_hashes": hashes}
        wire["medium"] = self.medium
        for name in ("group_idx", "locality", "ownership"):
            value = getattr(self, name)
            if value is not None:
                wire[name] = value
        return wire


@frozen
class AllBlocksCleared:
    """Everything the stream announced is gone (a publisher starting afresh)."""

    def wire(self) -> dict[str, Any]:
        return {"type": "AllBlocksCleared"}


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@frozen
class EventBatch:
    """One message's events."""

    ts: float
    events: tuple[KVEvent, ...]


def _packed_stored(event: BlockStored, tokens: PackedTokens, pack: Callable[[Any], bytes]) -> bytes:
    """A ``BlockStored`` whose tokens are packed: its map (as :meth:`BlockStored.wire`'s, in
    that order), the ids' array spliced in. Two calls of ``pack`` (the batch's one packer): the
    keys and values before the tokens, and those after, each packed as one array whose header
    is cut off (an array's elements are the map's entries, in order)."""
    before = pack(
        [
            "type", "BlockStored",
            "block_hashes", list(event.block_hashes),
            "parent_block_hash", event.parent_block_hash,
        ]
    )[1:]  # fmt: skip
    after: list[Any] = [
        "block_size", event.block_size,
        "lora_id", event.lora_id,
        "medium", event.medium,
        "lora_name", event.lora_name,
    ]  # fmt: skip
    if event.extra_keys is not None:
        after += (
            "extra_keys",
            [None if k is None else [_plain(x) for x in k] for k in event.extra_keys],
        )
    for name in _OPTIONAL_STORED:
        value = getattr(event, name)
        if value is not None:
            after += (name, value)
    entries = 4 + len(after) // 2
    tail = pack(after)[1 if len(after) < 16 else 3 :]
    return b"".join((bytes([0x80 | entries]), before, _TOKEN_KEY, tokens.packed, tail))


def encode_batch(ts: float, events: Sequence[KVEvent]) -> bytes:
    """The payload frame of a batch (vLLM's ``KVEventBatch``)."""
    if not any(type(e) is BlockStored and type(e.token_ids) is PackedTokens for e in events):
        payload: bytes = msgpack.packb([ts, [e.wire() for e in events], None], use_bin_type=True)
        return payload
    pack = msgpack.Packer(use_bin_type=True).pack  # (one a batch; a packer is not thread-safe)
    parts = [b"\x93", pack(ts), _array_header(len(events))]
    for e in events:
        tokens = e.token_ids if type(e) is BlockStored else None
        if type(tokens) is PackedTokens:
            parts.append(_packed_stored(e, tokens, pack))  # type: ignore[arg-type]
        else:
            parts.append(pack(e.wire()))
    parts.append(b"\xc0")
    return b"".join(parts)


def _array_header(n: int) -> bytes:
    if n < 16:
        return bytes([0x90 | n])
    return b"\xdc" + n.to_bytes(2, "big") if n < 1 << 16 else b"\xdd" + n.to_bytes(4, "big")


def _hashes(value: Any) -> tuple[BlockHash, ...]:
    if not isinstance(value, list | tuple) or not all(
        type(h) is int or type(h) is bytes for h in value
    ):
        raise ValueError("block_hashes: expected an array of ints or binary values")
    return tuple(value)


def _optional(raw: dict[str, Any], name: str, kind: type) -> Any:
    value = raw.get(name)
    return value if type(value) is kind else None


def _extra_keys(value: Any) -> ExtraKeys | None:
    if not isinstance(value, list):
        return None
    return tuple(
        None
        if not isinstance(keys, list)
        else tuple(tuple(k) if isinstance(k, list) else k for k in keys)
        for keys in value
    )


def _event(raw: Any) -> KVEvent:
    if not isinstance(raw, dict):
        raise ValueError(f"an event is a map, got {type(raw).__name__}")
    kind = raw.get("type")
    if kind == "BlockStored":
        parent = raw.get("parent_block_hash")
        return BlockStored(
            _hashes(raw.get("block_hashes")),
            parent if type(parent) in (int, bytes) else None,
            tuple(raw.get("token_ids") or ()),
            int(raw.get("block_size", 0)),
            raw.get("medium"),
            raw.get("lora_id"),
            raw.get("lora_name"),
            _extra_keys(raw.get("extra_keys")),
            _optional(raw, "group_idx", int),
            _optional(raw, "kv_cache_spec_kind", str),
            _optional(raw, "kv_cache_spec_sliding_window", int),
            _optional(raw, "locality", str),
            _optional(raw, "ownership", str),
        )
    if kind == "BlockRemoved":
        return BlockRemoved(
            _hashes(raw.get("block_hashes")),
            raw.get("medium"),
            _optional(raw, "group_idx", int),
            _optional(raw, "locality", str),
            _optional(raw, "ownership", str),
        )
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    raise ValueError(f"unknown event type {kind!r}")


def decode_batch(payload: bytes) -> EventBatch:
    """A payload frame's batch (fields kvtrio does not use are ignored); ``ValueError`` if it
    is not one."""
    try:
        raw = msgpack.unpackb(payload, raw=False)
    except Exception as exc:
        raise ValueError(f"not msgpack: {exc}") from None
    if not isinstance(raw, list) or len(raw) < 2 or not isinstance(raw[1], list):
        raise ValueError("a KVEventBatch is the array [ts, events, ...]")
    return EventBatch(float(raw[0]), tuple(_event(e) for e in raw[1]))
