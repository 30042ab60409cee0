"""Boundary values of every client-sent field, drawn from the protocol's declared bounds
(``kvtrio.protocol.FIELD_BOUNDS``): for each field, a valid request with that one field set to
each end of its range, one past each end, and a huge value. Used by the codec test and the
fuzz test against a live server."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import attrs
import msgpack

from kvtrio.protocol import (
    FIELD_BOUNDS,
    HASH_SCHEME_TOKENS,
    PROTOCOL_VERSION,
    REQUEST_TYPES,
    Bound,
    Commit,
    CudaCache,
    CudaLayer,
    EndSession,
    FreeLookupLocks,
    Hello,
    LayoutSpec,
    Lookup,
    LookupBatch,
    Probe,
    Register,
    Release,
    Request,
    Retrieve,
    Store,
    converter,
)

HASH = bytes(range(16))
LAYER = CudaLayer(b"h" * 64, 1024, 0, b"/torch_1", 0, b"", False, (2, 4, 16, 2, 16), (1,) * 5, 0,
                  "float16")  # fmt: skip
VALID: dict[type[Request], Request] = {
    Hello: Hello("fuzz", "1", PROTOCOL_VERSION),
    Probe: Probe((1, 2), (3,)),
    Register: Register(
        "e",
        "m",
        256,  # (so that every rank in 0…255 is in range)
        0,
        LayoutSpec("flash_attn", 2, 4, 16, 2, 16, "float16"),
        HASH_SCHEME_TOKENS,
        cuda=CudaCache("GPU-0", (LAYER,)),
    ),
    Lookup: Lookup("r", "m", 1, (HASH,)),
    LookupBatch: LookupBatch("m", 1, ("r",), ((HASH,),)),
    Store: Store("r", 0, 256, (HASH,)),
    Commit: Commit("r", (HASH,)),
    Retrieve: Retrieve("r", 0, 256, (HASH,)),
    Release: Release("r", (HASH,)),
    FreeLookupLocks: FreeLookupLocks("r", "m"),
    EndSession: EndSession("r", "m"),
}
"""A valid request of each class that has fields (the others have nothing to bound)."""

HUGE_LENGTH = 1 << 20
"""A huge string or binary value (1 MiB, the attack of issue 32)."""

_NESTED: dict[type, tuple[str, ...]] = {
    LayoutSpec: ("layout",),
    CudaCache: ("cuda",),
    CudaLayer: ("cuda", "layers", "0"),
}
_ELEMENT: dict[str, Any] = {"str": "x", "bytes": b"\0", "int": 0}


def _element(bound: Bound) -> Any:
    items = bound.items
    if items is None:
        return 1 if bound.of is None else converter.unstructure(LAYER)
    if items.kind == "bytes":
        return b"\0" * items.high
    if items.kind == "array":
        return []
    if items.kind == "str":
        return "x"
    return max(items.low, 0)


def _values(bound: Bound) -> Iterator[tuple[str, Any, bool]]:
    """``(label, value, in range)`` at and around the bound's ends."""
    if bound.kind == "int":
        low, high = bound.low, bound.high
        yield "min-1", low - 1, False
        yield "min", low, True
        yield "max", high, True
        yield "max+1", high + 1, False
        if high < (1 << 64) - 1:
            yield "huge", (1 << 64) - 1, False
        if low > -(1 << 63):
            yield "-huge", -(1 << 63), False
        return
    if bound.kind in ("bool", "map"):
        return
    if bound.kind == "array":
        element = _element(bound)
        if bound.low:
            yield "min-1", [element] * (bound.low - 1), False
        yield "max", [element] * bound.high, True
        yield "max+1", [element] * (bound.high + 1), False
        return
    unit = _ELEMENT[bound.kind]
    if bound.low:
        yield "min-1", unit * (bound.low - 1), False
    yield "min", unit * bound.low, True
    yield "max", unit * bound.high, True
    yield "max+1", unit * (bound.high + 1), False
    yield "huge", unit * HUGE_LENGTH, False


def _set(body: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    target: Any = body
    for step in path[:-1]:
        target = target[int(step)] if isinstance(target, list) else target[step]
    target[path[-1]] = value


def boundary_cases() -> Iterator[tuple[str, str, bytes, bool]]:
    """``(label, op, body frame, in range)`` for every field of every request class."""
    for cls, valid in VALID.items():
        classes = [cls] + ([LayoutSpec, CudaCache, CudaLayer] if cls is Register else [])
        for owner in classes:
            for name, bound in FIELD_BOUNDS[owner].items():
                path = (*_NESTED.get(owner, ()), name)
                for label, value, ok in _values(bound):
                    body = _as_lists(converter.unstructure(valid))
                    _set(body, path, value)
                    frame = msgpack.packb(body, use_bin_type=True)
                    yield f"{cls.op}.{'.'.join(path)}={label}", cls.op, frame, ok


def _as_lists(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _as_lists(item) for key, item in value.items()}
    if isinstance(value, (tuple, list)):
        return [_as_lists(item) for item in value]
    return value


def bounded_classes() -> dict[type, list[str]]:
    """Every request class with fields, and the classes nested in them: their fields."""
    found: dict[type, list[str]] = {}
    for cls in REQUEST_TYPES:
        for owner in [cls] + ([LayoutSpec, CudaCache, CudaLayer] if cls is Register else []):
            names = [field.name for field in attrs.fields(owner)]
            if names:
                found[owner] = names
    return found
