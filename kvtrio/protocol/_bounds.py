"""The range or length of every field a client sends: one table, checked at decode.

:data:`FIELD_BOUNDS` declares, for every request class (and the maps nested in ``register``),
each field's bound: integers a closed range, strings and binary values a maximum length, arrays
a maximum count (and, where it is known without the server's state, each element's). The codec
checks a decoded request against it (:func:`check_request`) before any of the request's work,
and answers a value outside with ``bad_request`` naming the field and its range (issue 32: a
``num_readers`` of -3 unpinned other engines' chunks; 1 MiB request ids and model names grew the
server by a gigabyte). ``docs/protocol.md``'s table of bounds is this table
(``tests/protocol/test_bounds.py`` compares them) and the fuzz test draws its values from it.

Elements of integer arrays (token ids, block ids) are not walked here: a per-element check
costs more than the rest of a message's decoding. Their range is declared (``items``) and
checked where they are used: in C by the code that packs them (:func:`as_int_array`), and the
block ids of a CUDA worker against its registration's ``num_blocks``. The same holds for the
chunk hashes' 16 bytes each: the operation checks them before any of its work, so that one bad
hash list of a ``lookup_batch`` fails its own lookup, not the batch.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from typing import Any, Literal

from attrs import frozen

from ._cache import (
    MAX_HASHES,
    MAX_LOOKUP_BATCH,
    MAX_WORLD_SIZE,
    Commit,
    EndSession,
    FreeLookupLocks,
    Lookup,
    LookupBatch,
    Release,
    Retrieve,
    Store,
)
from ._events import MAX_BLOCK_HASH_BYTES, MAX_EXTRA_KEY_LENGTH, MAX_EXTRA_KEYS
from ._messages import Hello, Probe, Request
from ._registration import CudaCache, CudaLayer, LayoutSpec, Register
from ._tenant import TENANT_NAME_LENGTH

__all__ = [
    "FIELD_BOUNDS",
    "MAX_BLOCK_IDS",
    "MAX_EVENT_HASHES",
    "MAX_EVENT_TOKENS",
    "MAX_ID_LENGTH",
    "MAX_LAYERS",
    "MAX_MODEL_LENGTH",
    "MAX_TENANT_LENGTH",
    "MAX_TOKEN_POSITION",
    "Bound",
    "BoundError",
    "bound_rows",
    "check_request",
    "wire_request_id",
]

MAX_ID_LENGTH = 512
"""Characters of an engine request id or engine id (vLLM's are ``cmpl-<uuid>-…``, about 50;
an id taken from a client's ``X-Request-Id`` header may be longer). The server keeps every
request id that holds a pin, so the length bounds its memory (1,200 lookups with 1 MiB ids grew
it by 1.2 GB)."""
MAX_MODEL_LENGTH = 1024
"""Characters of a model name: a Hugging Face repository id (at most 96) or a local path."""
MAX_TENANT_LENGTH = TENANT_NAME_LENGTH
"""Characters of a tenant name (its alphabet: ``_tenant.py``, checked by ``Register``)."""
MAX_NAME_LENGTH = 256
"""Characters of the other free-text fields: client name and version, hash scheme and seed,
the GPU's UUID."""
MAX_HANDLE_BYTES = 256
"""Bytes of a CUDA IPC handle or torch's shared-memory name (64 and about 30 in practice)."""
MAX_TOKEN_POSITION = 1 << 40
"""The largest token position of a ``store`` or ``retrieve`` range (a trillion tokens)."""
MAX_BLOCK_IDS = 1 << 20
"""Engine block ids in one ``store`` or ``retrieve`` (``MAX_HASHES`` chunks of 128 blocks);
also token ids and block ids of a ``probe``."""
MAX_EVENT_HASHES = 1 << 17
"""Engine block hashes one store may carry (``MAX_HASHES`` chunks of 16 blocks)."""
MAX_EVENT_TOKENS = (1 << 18) - 1
"""Token ids one store or retrieve may carry for KV events (a client leaves them out of a
larger one); 4 bytes each on the wire, under the 1 MiB a binary field may take."""
MAX_KV_GROUPS = 1 << 10
"""KV cache groups of a model (vLLM's ``group_idx``; hybrid models have a few)."""
MAX_LAYERS = 1 << 12
"""Layers of a model (``num_layers``, and the layers of a CUDA registration)."""
MAX_DIMS = 8
"""Dimensions of a CUDA layer's shape and stride (a paged KV tensor has 3 to 5)."""
_INT64 = (1 << 63) - 1


def wire_request_id(request_id: str) -> str:
    """The id a client sends for the engine request ``request_id``: the id itself, or for one
    longer than ``MAX_ID_LENGTH`` characters (a long ``X-Request-Id``) ``sha256:`` and its
    digest, so that such a request is cached as any other instead of refused. Every message of
    one request maps its id the same way (the scheduler's pins are the worker's to consume)."""
    if len(request_id) <= MAX_ID_LENGTH:
        return request_id
    return "sha256:" + hashlib.sha256(request_id.encode("utf-8", "surrogatepass")).hexdigest()


Kind = Literal["int", "str", "bytes", "bool", "array", "map"]


@frozen
class Bound:
    """The bound of one field: ``low`` … ``high`` for an ``int``, the length for ``str``
    (characters), ``bytes`` and ``array`` (elements); ``items`` bounds an array's elements,
    ``of`` is the class of a nested ``map`` (or an array's maps); ``named`` is the protocol
    constant the limit comes from; ``note`` says what else is checked, and where."""

    kind: Kind
    low: int = 0
    high: int = 0
    items: Bound | None = None
    of: type | None = None
    optional: bool = False
    named: str = ""
    note: str = ""

    def describe(self) -> str:
        """The bound as ``docs/protocol.md``'s table writes it."""
        named = f" (`{self.named}`)" if self.named else ""
        if self.kind == "int":
            text = f"{_number(self.low)} … {_number(self.high)}{named}"
        elif self.kind == "bool":
            text = "true or false"
        elif self.kind == "map":
            text = "map" + (" or nil" if self.optional else "")
        else:
            unit = {"str": "characters", "bytes": "bytes", "array": "items"}[self.kind]
            size = _number(self.high)
            if self.low == self.high:
                text = f"{size} {unit}{named}"
            elif self.low:
                text = f"{_number(self.low)} … {size} {unit}{named}"
            else:
                text = f"≤ {size} {unit}{named}"
            if self.items is not None:
                text += f", each {self.items.describe()}"
        if self.note:
            text += f"; {self.note}"
        return text


def _number(value: int) -> str:
    if value < 0:
        return "−" + _number(-value)
    if value >= 1 << 16 and value & (value - 1) == 0:
        return f"2^{value.bit_length() - 1}"
    if value >= 1 << 16 and (value + 1) & value == 0:
        return f"2^{value.bit_length()} − 1"
    return f"{value:,}"


def integer(low: int, high: int, named: str = "", note: str = "") -> Bound:
    return Bound("int", low, high, named=named, note=note)


def text(high: int, named: str = "", note: str = "") -> Bound:
    return Bound("str", 0, high, named=named, note=note)


def binary(high: int, low: int = 0, note: str = "", named: str = "") -> Bound:
    return Bound("bytes", low, high, named=named, note=note)


def array(high: int, items: Bound | None = None, named: str = "", note: str = "") -> Bound:
    return Bound("array", 0, high, items=items, named=named, note=note)


FLAG = Bound("bool")
_ID = text(MAX_ID_LENGTH, "MAX_ID_LENGTH")
_MODEL = text(MAX_MODEL_LENGTH, "MAX_MODEL_LENGTH")
_TENANT = text(MAX_TENANT_LENGTH, "MAX_TENANT_LENGTH")
_NAME = text(MAX_NAME_LENGTH)
_WORLD = integer(1, MAX_WORLD_SIZE, "MAX_WORLD_SIZE")
_HASH = binary(16, 16)
_HASHES = array(
    MAX_HASHES,
    _HASH,
    "MAX_HASHES",
    "their 16 bytes checked by the operation, before any of its work",
)
_POSITION = integer(0, MAX_TOKEN_POSITION)
_BLOCK_IDS = array(
    MAX_BLOCK_IDS,
    integer(-1, (1 << 32) - 1),
    note="each checked where used: against the registration's `num_blocks`; -1 in a retrieve, "
    "or for a store's partial chunk's tail",
)
_EVENT = binary(MAX_HANDLE_BYTES, note="a CUDA IPC event handle (64 bytes), or empty")
_EVENT_HASHES = array(
    MAX_EVENT_HASHES,
    integer(0, (1 << 64) - 1),
    "MAX_EVENT_HASHES",
    f"or each at most {MAX_BLOCK_HASH_BYTES} bytes",
)
_TOKEN_IDS = binary(
    4 * MAX_EVENT_TOKENS,
    named="MAX_EVENT_TOKENS × 4",
    note="unsigned 32-bit little-endian token ids (a multiple of 4 bytes); KV events use "
    "them when they are the range's tokens",
)
_EXTRA_KEYS = array(
    MAX_EVENT_HASHES,
    array(MAX_EXTRA_KEYS, named="MAX_EXTRA_KEYS"),
    "MAX_EVENT_HASHES",
    f"or nil; a key is a string or binary value of ≤ {MAX_EXTRA_KEY_LENGTH}, an int64, "
    "or an array of ≤ 4 of those",
)
_SCOPE = {"request": _ID, "model": _MODEL, "tenant": _TENANT, "engine": _ID}

FIELD_BOUNDS: dict[type, dict[str, Bound]] = {
    Hello: {
        "client_name": _NAME,
        "client_version": _NAME,
        "protocol_version": integer(0, (1 << 32) - 1, note="else than 2: `unsupported_version`"),
    },
    Probe: {
        "tokens": array(MAX_BLOCK_IDS, integer(-_INT64 - 1, _INT64), note="each checked in C"),
        "block_ids": array(MAX_BLOCK_IDS, integer(-_INT64 - 1, _INT64), note="each checked in C"),
    },
    Register: {
        "engine": _ID,
        "model": _MODEL,
        "world_size": _WORLD,
        "rank": integer(0, MAX_WORLD_SIZE - 1, note="and below `world_size`"),
        "layout": Bound("map", of=LayoutSpec),
        "hash_scheme": _NAME,
        "device": text(16, note="`cpu` or `cuda`"),
        "tenant": _TENANT,
        "cuda": Bound("map", of=CudaCache, optional=True),
        "hash_seed": _NAME,
    },
    LayoutSpec: {
        "kind": text(32),
        "num_layers": integer(1, MAX_LAYERS),
        "num_blocks": integer(1, 1 << 32),
        "block_size": integer(1, 1 << 20, note="and dividing the chunk size"),
        "num_heads": integer(1, 1 << 16),
        "head_dim": integer(1, 1 << 16),
        "dtype": text(32),
    },
    CudaCache: {
        "device_uuid": _NAME,
        "layers": Bound(
            "array", 0, MAX_LAYERS, of=CudaLayer, note="as many as `num_layers`, checked at use"
        ),
    },
    CudaLayer: {
        "handle": binary(MAX_HANDLE_BYTES),
        "storage_size": integer(0, _INT64),
        "storage_offset": integer(0, _INT64),
        "ref_counter_handle": binary(MAX_HANDLE_BYTES),
        "ref_counter_offset": integer(0, _INT64),
        "event_handle": binary(MAX_HANDLE_BYTES),
        "event_sync_required": FLAG,
        "shape": array(MAX_DIMS, note="each checked against the layout"),
        "stride": array(MAX_DIMS, note="each checked against the layout"),
        "offset": integer(0, _INT64),
        "dtype": text(32),
    },
    Lookup: {
        **_SCOPE,
        "world_size": _WORLD,
        "chunk_hashes": _HASHES,
        "num_readers": integer(
            0, MAX_WORLD_SIZE, "MAX_WORLD_SIZE", "0: the default; at most `world_size`"
        ),
    },
    LookupBatch: {
        "model": _MODEL,
        "world_size": _WORLD,
        "requests": array(MAX_LOOKUP_BATCH, _ID, "MAX_LOOKUP_BATCH"),
        "chunk_hashes": array(
            MAX_LOOKUP_BATCH,
            _HASHES,
            "MAX_LOOKUP_BATCH",
            "`world_size` × all hashes ≤ 65,536 (`MAX_LOOKUP_KEYS`)",
        ),
        "num_readers": integer(
            0, MAX_WORLD_SIZE, "MAX_WORLD_SIZE", "0: the default; at most `world_size`"
        ),
        "tenant": _TENANT,
        "engine": _ID,
    },
    Store: {
        "request": _ID,
        "start": _POSITION,
        "end": _POSITION,
        "chunk_hashes": _HASHES,
        "block_ids": _BLOCK_IDS,
        "event": _EVENT,
        "parent_hash": binary(16, note="16 bytes or empty"),
        "block_hashes": _EVENT_HASHES,
        "token_ids": _TOKEN_IDS,
        "extra_keys": _EXTRA_KEYS,
        "lora_name": _NAME,
        "group_idx": integer(-1, MAX_KV_GROUPS, "MAX_KV_GROUPS", "-1: none"),
        "kv_cache_spec_kind": text(64),
        "kv_cache_spec_sliding_window": integer(0, MAX_TOKEN_POSITION),
    },
    Commit: {"request": _ID, "written": _HASHES, "failed": _HASHES},
    Retrieve: {
        "request": _ID,
        "start": _POSITION,
        "end": _POSITION,
        "chunk_hashes": _HASHES,
        "block_ids": _BLOCK_IDS,
        "event": _EVENT,
        "partial": FLAG,
        "block_hashes": _EVENT_HASHES,
        "token_ids": _TOKEN_IDS,
        "extra_keys": _EXTRA_KEYS,
        "lora_name": _NAME,
    },
    Release: {"request": _ID, "chunk_hashes": _HASHES},
    FreeLookupLocks: dict(_SCOPE),
    EndSession: dict(_SCOPE),
}
"""Request class (or nested map class) → field → its bound. Every field of every request
class is here (``tests/protocol/test_bounds.py`` checks it)."""


class BoundError(ValueError):
    """A field is outside its declared bound; the message names it and the bound."""


Checker = Callable[[Any], None]


def _checker(cls: type, path: str) -> Checker:
    """A function that checks an instance of ``cls`` against its bounds (raises
    :class:`BoundError`). Integers and lengths are compared in two loops over precomputed
    tuples: a lookup's seven fields cost 0.7 µs here."""
    bounds = FIELD_BOUNDS.get(cls, {})
    ints = tuple(
        (name, b.low, b.high, f" ({b.named})" if b.named else "")
        for name, b in bounds.items()
        if b.kind == "int"
    )
    sized = tuple(
        (name, b.low, b.high) for name, b in bounds.items() if b.kind in ("str", "bytes", "array")
    )
    items = tuple(
        (name, b.items.high)
        for name, b in bounds.items()
        if b.kind == "array" and b.items is not None and b.items.kind == "str"
    )
    nested = tuple(
        (name, _checker(b.of, f"{path}{name}."), b.kind == "array")
        for name, b in bounds.items()
        if b.of is not None
    )
    relation = _RELATIONS.get(cls)

    def check(message: Any) -> None:
        for name, low, high, named in ints:
            value = getattr(message, name)
            if not low <= value <= high:
                raise BoundError(
                    f"{path}{name} must be an integer in {low}…{high}{named}, got {value}"
                )
        for name, low, high in sized:
            size = len(getattr(message, name))
            if not low <= size <= high:
                raise BoundError(_size_error(path + name, bounds[name], size))
        for name, high in items:
            values = getattr(message, name)
            if values and max(map(len, values)) > high:
                index = next(i for i, v in enumerate(values) if len(v) > high)
                raise BoundError(
                    f"{path}{name}[{index}] is {len(values[index])} characters, at most {high}"
                )
        for name, inner, many in nested:
            value = getattr(message, name)
            if value is None:
                continue
            for item in value if many else (value,):
                inner(item)
        if relation is not None:
            relation(message)

    return check


def _size_error(name: str, bound: Bound, size: int) -> str:
    unit = {"str": "characters", "bytes": "bytes", "array": "items"}[bound.kind]
    limit = f"{bound.high}" if bound.low == bound.high else f"{bound.low}…{bound.high}"
    if not bound.low:
        limit = f"at most {bound.high}"
    named = f" ({bound.named})" if bound.named else ""
    return f"{name} must be {limit} {unit}{named}, got {size}"


def _store_tokens(message: Store | Retrieve) -> None:
    """A store's (or retrieve's) ``token_ids`` are whole 32-bit ids (each in range by its
    width); how many there are is checked where they are used (``server._announce``)."""
    if len(message.token_ids) % 4:
        raise BoundError(
            f"token_ids must be a multiple of 4 bytes (32-bit ids), got {len(message.token_ids)}"
        )


def _register_rank(message: Register) -> None:
    if message.rank >= message.world_size:
        raise BoundError(
            f"rank must be in 0…{message.world_size - 1} (below world_size), got {message.rank}"
        )


_RELATIONS: dict[type, Callable[[Any], None]] = {
    Register: _register_rank,
    Store: _store_tokens,
    Retrieve: _store_tokens,
}
"""Checks between fields of one message (cheap, and only where a field's own range is not
enough)."""

_CHECKERS: dict[type, Checker] = {}


def check_request(message: Request) -> None:
    """Raise :class:`BoundError` if a field of ``message`` is outside its declared bound."""
    cls = type(message)
    check = _CHECKERS.get(cls)
    if check is None:
        check = _CHECKERS[cls] = _checker(cls, "")
    check(message)


def bound_rows() -> Iterator[tuple[str, str, str]]:
    """``(message, field, bound)`` for every field, in the order of ``docs/protocol.md``'s
    table: the request classes by their operation name, nested maps under their field."""
    for cls, path in _documented():
        for name, bound in FIELD_BOUNDS[cls].items():
            yield path, name, bound.describe()


def _documented() -> Iterator[tuple[type, str]]:
    nested = {LayoutSpec: "register.layout", CudaCache: "register.cuda"}
    nested[CudaLayer] = "register.cuda.layers[]"
    for cls in FIELD_BOUNDS:
        op = getattr(cls, "op", None)
        yield cls, op if op is not None else nested[cls]
