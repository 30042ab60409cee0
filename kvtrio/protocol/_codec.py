"""The one place where messages become bytes and bytes become messages.

A message travels as two ZeroMQ frames, ``[header, body]``, both msgpack: the header is the array
``[version, call_id, kind]`` and the body is a map of the message's fields (see
``docs/protocol.md``). One cattrs converter, built from cattrs' msgpack preconfiguration, turns
attrs classes into maps and back.

Validation is strict but cheap: scalars must already have the right msgpack type (no silent
``"12"`` → ``12`` coercion), and arrays of integers (token ids, block ids, hashes) are *trusted
containers*: their hook checks the container once instead of structuring every element, because a
per-int hook costs more than the whole rest of a lookup's decoding. The elements are type-checked
where they are used, by the C code that packs them (see :func:`as_int_array`). A decoded request
is then checked against its fields' declared ranges and lengths (:mod:`._bounds`).
"""

from __future__ import annotations

import threading
from array import array
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast

import cattrs
import msgpack
from cattrs.preconf.msgpack import make_converter
from cattrs.v import format_exception

from ..errors import ErrorCode, ProtocolError
from ._bounds import MAX_EVENT_HASHES, MAX_LAYERS, BoundError, check_request
from ._cache import MAX_HASHES, MAX_LOOKUP_BATCH, MAX_LOOKUP_KEYS
from ._events import MAX_BLOCK_HASH_BYTES, ExtraKeys, structure_extra_keys
from ._messages import PROTOCOL_VERSION, ErrorReply, Header, Reply, Request
from ._operations import OPERATIONS
from ._registration import CudaLayer

__all__ = [
    "ERROR_KIND",
    "HeaderError",
    "as_int_array",
    "converter",
    "decode_header",
    "decode_reply",
    "decode_reply_body",
    "decode_reply_header",
    "decode_request",
    "encode_error",
    "encode_reply",
    "encode_request",
    "prepare_hooks",
    "read_reply_header",
    "read_request_header",
]

ERROR_KIND = "error"
"""The header ``kind`` of an error reply."""

_MAX_CALL_ID = 2**64 - 1
_M = TypeVar("_M")
IntTuple = tuple[int, ...]
BytesTuple = tuple[bytes, ...]
StrTuple = tuple[str, ...]
EventHashTuple = tuple[int | bytes, ...]
LayerTuple = tuple[CudaLayer, ...]


class HeaderError(ProtocolError):
    """The header frame is invalid. ``call_id`` is set when it could still be read from it."""

    def __init__(
        self, message: str, call_id: int | None, code: ErrorCode = ErrorCode.BAD_REQUEST
    ) -> None:
        super().__init__(message, code)
        self.call_id = call_id


# --------------------------------------------------------------------------- the converter


def _strict(expected: type, name: str) -> Any:
    def hook(value: Any, _: Any) -> Any:
        if type(value) is not expected:
            raise TypeError(f"expected {name}, got {_msgpack_type(value)}")
        return value

    return hook


def _structure_float(value: Any, _: Any) -> float:
    if type(value) is float:
        return value
    if type(value) is int:
        return float(value)
    raise TypeError(f"expected a number, got {_msgpack_type(value)}")


def _structure_int_tuple(value: Any, _: Any) -> IntTuple:
    # Trusted container: msgpack arrays decode to tuples (use_list=False); elements are checked
    # where they are packed (as_int_array), in C.
    if type(value) is tuple:
        return cast(IntTuple, value)
    raise TypeError(f"expected an array of integers, got {_msgpack_type(value)}")


def _structure_bytes_tuple(value: Any, _: Any) -> BytesTuple:
    # Every array of binary values is an array of chunk hashes: its length is bounded before
    # any element is looked at (MAX_HASHES, issue 22).
    if type(value) is tuple and len(value) > MAX_HASHES:
        raise TypeError(
            f"expected at most {MAX_HASHES} chunk hashes in one array (MAX_HASHES), got "
            f"{len(value)}: send the rest in another message"
        )
    if type(value) is tuple and all(type(item) is bytes for item in value):
        return cast(BytesTuple, value)
    raise TypeError(f"expected an array of binary values, got {_msgpack_type(value)}")


def _structure_hash_lists(value: Any, _: Any) -> tuple[BytesTuple, ...]:
    """A ``lookup_batch``'s hash lists: the counts are checked before any element is looked at,
    so an oversized batch costs nothing to refuse (structuring 8M empty lists took 5 s).

    Each list's elements are left to the lookup that uses it (``checked_hashes`` on the
    server): a bad list fails its own lookup, not the batch (issue 22).
    """
    if type(value) is not tuple:
        raise TypeError(f"expected an array of arrays, got {_msgpack_type(value)}")
    if len(value) > MAX_LOOKUP_BATCH:
        raise TypeError(
            f"expected at most {MAX_LOOKUP_BATCH} lookups in one batch, got {len(value)}: "
            "send the rest in another batch"
        )
    total = sum(len(item) for item in value if type(item) is tuple)
    if total > MAX_LOOKUP_KEYS:
        raise TypeError(
            f"expected at most {MAX_LOOKUP_KEYS} chunk hashes in one batch (MAX_LOOKUP_KEYS), "
            f"got {total}: send the rest in another batch"
        )
    return cast("tuple[BytesTuple, ...]", value)


def _structure_event_hashes(value: Any, _: Any) -> EventHashTuple:
    """A store's engine block hashes: at most :data:`MAX_EVENT_HASHES`, each an unsigned
    64-bit int or at most ``MAX_BLOCK_HASH_BYTES`` bytes (the length first, then each)."""
    if type(value) is not tuple:
        raise TypeError(f"expected an array of block hashes, got {_msgpack_type(value)}")
    if len(value) > MAX_EVENT_HASHES:
        raise TypeError(f"expected at most {MAX_EVENT_HASHES} block hashes, got {len(value)}")
    for item in value:
        kind = type(item)
        if not (
            (kind is int and 0 <= item < 1 << 64)
            or (kind is bytes and len(item) <= MAX_BLOCK_HASH_BYTES)
        ):
            raise TypeError(
                "expected block hashes as unsigned 64-bit integers or binary values of at most "
                f"{MAX_BLOCK_HASH_BYTES} bytes, got {_msgpack_type(item)}"
            )
    return cast(EventHashTuple, value)


def _structure_str_tuple(value: Any, _: Any) -> StrTuple:
    # The one array of strings is a lookup_batch's request ids: counted before it is walked.
    if type(value) is tuple and len(value) > MAX_LOOKUP_BATCH:
        raise TypeError(
            f"expected at most {MAX_LOOKUP_BATCH} request ids (MAX_LOOKUP_BATCH), got "
            f"{len(value)}: send the rest in another batch"
        )
    if type(value) is tuple and all(type(item) is str for item in value):
        return cast(StrTuple, value)
    raise TypeError(f"expected an array of strings, got {_msgpack_type(value)}")


def _structure_layers(value: Any, _: Any) -> LayerTuple:
    """A CUDA registration's layers: counted (``MAX_LAYERS``) before any is structured."""
    if type(value) is not tuple:
        raise TypeError(f"expected an array of layer maps, got {_msgpack_type(value)}")
    if len(value) > MAX_LAYERS:
        raise TypeError(f"expected at most {MAX_LAYERS} layers (MAX_LAYERS), got {len(value)}")
    structure = converter.get_structure_hook(CudaLayer)
    return tuple(structure(item, CudaLayer) for item in value)


def _msgpack_type(value: object) -> str:
    names = {
        bool: "a boolean",
        int: "an integer",
        float: "a float",
        str: "a string",
        bytes: "binary data",
        tuple: "an array",
        dict: "a map",
        type(None): "nil",
    }
    return names.get(type(value), type(value).__name__)


def _make_converter() -> cattrs.Converter:
    conv = make_converter()
    conv.register_structure_hook(int, _strict(int, "an integer"))
    conv.register_structure_hook(str, _strict(str, "a string"))
    conv.register_structure_hook(bool, _strict(bool, "a boolean"))
    conv.register_structure_hook(bytes, _strict(bytes, "binary data"))
    conv.register_structure_hook(float, _structure_float)
    conv.register_structure_hook_func(lambda t: t == IntTuple, _structure_int_tuple)
    conv.register_unstructure_hook_func(lambda t: t == IntTuple, lambda v: v)
    conv.register_structure_hook_func(lambda t: t == BytesTuple, _structure_bytes_tuple)
    conv.register_unstructure_hook_func(lambda t: t == BytesTuple, lambda v: v)
    conv.register_structure_hook_func(lambda t: t == StrTuple, _structure_str_tuple)
    conv.register_structure_hook_func(lambda t: t == tuple[BytesTuple, ...], _structure_hash_lists)
    conv.register_unstructure_hook_func(lambda t: t == StrTuple, lambda v: v)
    conv.register_structure_hook_func(lambda t: t == EventHashTuple, _structure_event_hashes)
    conv.register_unstructure_hook_func(lambda t: t == EventHashTuple, lambda v: v)
    conv.register_structure_hook_func(lambda t: t == ExtraKeys, structure_extra_keys)
    conv.register_unstructure_hook_func(lambda t: t == ExtraKeys, lambda v: v)
    conv.register_structure_hook_func(lambda t: t == LayerTuple, _structure_layers)
    return cast(cattrs.Converter, conv)


converter = _make_converter()
"""The converter used for every message at the edge (and nowhere else)."""


def as_int_array(values: Sequence[int], typecode: str, what: str) -> array[int]:
    """Pack a trusted integer container into an ``array`` (C speed), validating every element.

    Raises :class:`ProtocolError` naming ``what`` if an element is not an integer or out of range.
    """
    try:
        return array(typecode, values)
    except (TypeError, OverflowError) as exc:
        raise ProtocolError(f"{what}: every element must be an integer in range ({exc})") from None


_STRUCTURE: dict[type, Callable[[Any, Any], Any]] = {}
_UNSTRUCTURE: dict[type, Callable[[Any], Any]] = {}
"""The converter's hooks, looked up once per message type (not per message)."""


def prepare_hooks() -> None:
    """Make the converter's hooks of every request and reply type now (21 ms here), so that
    the first message of each type does not pay cattrs' code generation on an engine's request
    path (up to 3.8 ms a type here; py-spy caught it in an engine's lookup hooks). Idempotent;
    clients and servers call it as they start."""
    types: list[type] = [ErrorReply]
    for request_type in OPERATIONS.values():
        types += (request_type, request_type.reply_type)
    for cls in types:
        if cls not in _UNSTRUCTURE:
            _UNSTRUCTURE[cls] = converter.get_unstructure_hook(cls)
        if cls not in _STRUCTURE:
            _STRUCTURE[cls] = converter.get_structure_hook(cls)


def _unstructure(message: object) -> Any:
    cls = type(message)
    hook = _UNSTRUCTURE.get(cls)
    if hook is None:
        hook = _UNSTRUCTURE[cls] = converter.get_unstructure_hook(cls)
    return hook(message)


def _structure(body: object, cls: type[_M], what: str) -> _M:
    if type(body) is not dict:
        raise ProtocolError(f"{what}: the body must be a msgpack map, got {_msgpack_type(body)}")
    try:
        hook = _STRUCTURE.get(cls)
        if hook is None:
            hook = _STRUCTURE[cls] = converter.get_structure_hook(cls)
        return hook(body, cls)  # type: ignore[no-any-return]  # (no cast call: hot path)
    except Exception as exc:
        details = cattrs.transform_error(exc, path="body", format_exception=_format_error)
        raise ProtocolError(f"{what}: {'; '.join(details) or exc}") from None


def _format_error(exc: BaseException, type_: Any) -> str:
    # Our hooks raise TypeErrors that already say what was expected and what came.
    if isinstance(exc, TypeError) and str(exc).startswith("expected "):
        return str(exc)
    # Field validators (the tenant alphabet) raise ValueErrors that name the field.
    if isinstance(exc, ValueError) and str(exc):
        return str(exc)
    return format_exception(exc, type_)


def _unpack(frame: bytes) -> Any:
    return msgpack.unpackb(frame, use_list=False, raw=False, strict_map_key=True)


_packers = threading.local()


def _pack(obj: object) -> bytes:
    # One Packer per thread, reused: msgpack.packb makes a new one per call (1.3 µs against
    # 0.4 µs for the packing itself on this machine); a Packer resets itself after an error.
    try:
        packer = _packers.packer
    except AttributeError:
        packer = _packers.packer = msgpack.Packer(use_bin_type=True)
    return packer.pack(obj)  # type: ignore[no-any-return]


# --------------------------------------------------------------------------- headers


def decode_header(frame: bytes) -> Header:
    """Decode and check a header frame.

    Raises :class:`HeaderError` (with ``call_id`` when it could be read) for a malformed
    header or a protocol version other than :data:`PROTOCOL_VERSION`.
    """
    return Header(PROTOCOL_VERSION, *read_request_header(frame))


def read_request_header(frame: bytes) -> tuple[int, str]:
    """:func:`decode_header` for the server's hot path: ``(call_id, kind)``, no object built.

    Raises :class:`HeaderError` as :func:`decode_header` does.
    """
    try:
        raw = _unpack(frame)
    except Exception:
        raise HeaderError("the header frame is not valid msgpack", None) from None
    if type(raw) is tuple and len(raw) == 3:
        version, call_id, kind = raw
        if (
            version == PROTOCOL_VERSION
            and type(version) is int
            and type(call_id) is int
            and type(kind) is str
            and 0 <= call_id <= _MAX_CALL_ID
        ):
            return call_id, kind
    return _header_error(raw)


def _header_error(raw: Any) -> tuple[int, str]:
    """Raise the :class:`HeaderError` that says what is wrong with a decoded header."""
    if type(raw) is not tuple or len(raw) < 2:
        raise HeaderError("the header must be the array [version, call_id, kind]", None)
    call_id = raw[1]
    if type(call_id) is not int or not 0 <= call_id <= _MAX_CALL_ID:
        raise HeaderError("the call id must be an unsigned 64-bit integer", None)
    if len(raw) != 3:
        raise HeaderError("the header must be the array [version, call_id, kind]", call_id)
    version = raw[0]
    if type(version) is not int:
        raise HeaderError("the protocol version must be an integer", call_id)
    if version != PROTOCOL_VERSION:
        raise HeaderError(
            f"the client speaks protocol version {version}, this server speaks version "
            f"{PROTOCOL_VERSION}: use a kvtrio client that matches the server",
            call_id,
            ErrorCode.UNSUPPORTED_VERSION,
        )
    raise HeaderError("the operation name must be a string", call_id)


# --------------------------------------------------------------------------- requests


def encode_request(call_id: int, request: Request) -> list[bytes]:
    """The frames of a request (without the routing id the ROUTER socket adds)."""
    return [
        _pack((PROTOCOL_VERSION, call_id, request.op)),
        _pack(_unstructure(request)),
    ]


def decode_request(op: str, body: bytes) -> Request:
    """Decode the body of a request of operation ``op`` (the header's ``kind``).

    Raises :class:`ProtocolError` with code ``unknown_operation`` or ``bad_request``.
    """
    cls = OPERATIONS.get(op)
    if cls is None:
        raise ProtocolError(f"unknown operation {op[:64]!r}", ErrorCode.UNKNOWN_OPERATION)
    try:
        raw = _unpack(body)
    except Exception:
        raise ProtocolError(f"invalid {cls.op!r} request: the body is not valid msgpack") from None
    request = _structure(raw, cls, f"invalid {cls.op!r} request")
    try:
        check_request(request)  # every field within its declared bound (_bounds.py)
    except BoundError as exc:
        raise ProtocolError(f"invalid {cls.op!r} request: {exc}") from None
    return request


# --------------------------------------------------------------------------- replies


def encode_reply(call_id: int, op: str, reply: Reply) -> list[bytes]:
    """The frames of a successful reply to request ``call_id`` of operation ``op``."""
    return [_pack((PROTOCOL_VERSION, call_id, op)), _pack(_unstructure(reply))]


def encode_error(call_id: int, code: ErrorCode, message: str) -> list[bytes]:
    """The frames of an error reply."""
    return [
        _pack((PROTOCOL_VERSION, call_id, ERROR_KIND)),
        _pack({"code": code.value, "message": message}),
    ]


def decode_reply_header(frame: bytes) -> Header:
    """Decode a reply header; unlike requests, any protocol version is accepted here.

    A server of another version answers with an ``unsupported_version`` error reply, and the
    client must be able to read it.
    """
    raw = _unpack_reply_header(frame)
    return Header(*raw)


def read_reply_header(frame: bytes) -> tuple[int, str]:
    """:func:`decode_reply_header` for the clients' hot path: ``(call_id, kind)``, no object
    built. Raises :class:`ProtocolError` as it does."""
    _, call_id, kind = _unpack_reply_header(frame)
    return call_id, kind


def _unpack_reply_header(frame: bytes) -> tuple[int, int, str]:
    try:
        raw = _unpack(frame)
    except Exception:
        raise ProtocolError("the reply header is not valid msgpack") from None
    if (
        type(raw) is not tuple
        or len(raw) != 3
        or type(raw[0]) is not int
        or type(raw[1]) is not int
        or type(raw[2]) is not str
    ):
        raise ProtocolError("the reply header must be the array [version, call_id, kind]")
    return cast("tuple[int, int, str]", raw)


def decode_reply(header: Header, body: bytes, request_type: type[Request]) -> Reply:
    """Decode a reply body to ``request_type.reply_type``, or to :class:`ErrorReply`."""
    return decode_reply_body(header.kind, body, request_type)


def decode_reply_body(kind: str, body: bytes, request_type: type[Request]) -> Reply:
    """:func:`decode_reply` from the header's ``kind`` alone."""
    try:
        raw = _unpack(body)
    except Exception:
        raise ProtocolError(f"the {request_type.op!r} reply body is not valid msgpack") from None
    if kind == ERROR_KIND:
        return _structure(raw, ErrorReply, "invalid error reply")
    if kind != request_type.op:
        raise ProtocolError(f"expected a {request_type.op!r} reply, got {kind[:64]!r}")
    return _structure(raw, request_type.reply_type, f"invalid {request_type.op!r} reply")
