"""Option values for the server's settings and for backend plugins: sizes, validators, parsing.

One home for what :mod:`kvtrio.config` (``ServerConfig``) and every L2 backend's ``Options``
class (in this package and in plugins such as ``kvtrio-redis``) need to declare and read
settings: the :data:`ByteSize` type, attrs validators that raise ``"NAME: problem"``, and
:func:`structure_options`, which turns raw strings from flags or TOML values into an attrs
options class and reports a bad one as a one-line :class:`~kvtrio.errors.ConfigError`.

Imports nothing of kvtrio but :mod:`kvtrio.errors`, so any layer (and any plugin) may use it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any, NewType, TypeVar, cast

import attrs
import cattrs
from cattrs.v import format_exception

from .errors import ConfigError

__all__ = [
    "ByteSize",
    "HttpAddress",
    "Validator",
    "at_least",
    "at_most",
    "describe_error",
    "format_size",
    "make_converter",
    "multiple_of",
    "not_negative",
    "one_of",
    "parse_byte_size",
    "parse_http_address",
    "parse_size",
    "positive",
    "share",
    "structure_options",
]

_T = TypeVar("_T")
ByteSize = NewType("ByteSize", int)
"""A size in bytes; accepts ``4GiB``, ``512MB``, ``100B`` or a plain integer of at least 1 MiB
(:func:`parse_byte_size`)."""
HttpAddress = NewType("HttpAddress", str)
"""``PORT`` or ``HOST:PORT``; a TOML file may give the port as an integer."""
Validator = Any
"""An attrs validator: ``(instance, attribute, value) -> None``, raising ``ValueError``."""

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}


def parse_size(text: str | int) -> int:
    """Parse a byte size: ``"4GiB"`` → 4294967296, ``"1.5MB"`` → 1500000, ``4096`` → 4096."""
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    match = _SIZE_RE.match(str(text).replace("_", ""))
    if match is None:
        raise ValueError(f"{text!r} is not a size (examples: 4096, 512MiB, 4GiB, 1.5GB)")
    number, unit = match.groups()
    unit = (unit or "").lower().rstrip("b")
    scale = 1024 ** "bkmgt".index(unit[0]) if unit.endswith("i") else _SIZE_UNITS[unit]
    return int(float(number) * scale)


BARE_SIZE_MIN = 1 << 20
"""A size written without a unit must be at least this many bytes (or 0)."""


def parse_byte_size(text: str | int) -> int:
    """:func:`parse_size` for a setting: a number without a unit is bytes, and below 1 MiB
    (other than 0) it is refused (``ValueError``) with a hint, since ``--l1-size 10`` surely
    meant 10GiB and not a 10-byte cache. A unit, ``B`` included (``512B``), is taken as
    written."""
    size = parse_size(text)
    match = _SIZE_RE.match(str(text).replace("_", ""))
    bare = isinstance(text, int) or (match is not None and match.group(2) is None)
    if bare and 0 < size < BARE_SIZE_MIN:
        number = str(text).strip()
        units = ("GiB", "MiB") if size < 1024 else ("MiB", "KiB")
        raise ValueError(
            f"a size without a unit is bytes; did you mean {number}{units[0]} or "
            f"{number}{units[1]}? ({number}B for {number} byte{'s' if size > 1 else ''})"
        )
    return size


def format_size(size: int) -> str:
    """A byte size for people, in the spelling :func:`parse_size` reads back: ``4294967296`` →
    ``4GiB``, ``1536`` → ``1.5KiB``, ``100`` → ``100B`` (at most one decimal; rounded)."""
    for power, unit in ((4, "TiB"), (3, "GiB"), (2, "MiB"), (1, "KiB")):
        scale = 1024**power
        if size >= scale:
            value = round(size / scale, 1)
            return f"{value:g}{unit}"
    return f"{size}B"


def parse_http_address(text: str) -> tuple[str, int]:
    """``PORT`` or ``HOST:PORT`` (``[v6]:PORT``) → ``(host, port)``; the host defaults to
    127.0.0.1. ``ValueError`` with a readable message otherwise."""
    host, sep, port = text.strip().rpartition(":")
    if not sep:
        host = "127.0.0.1"
    host = host.strip("[]") or "127.0.0.1"
    if not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"{text!r} is not PORT or HOST:PORT (e.g. 9464 or 0.0.0.0:9464)")
    return host, int(port)


# --------------------------------------------------------------------------- validators
# They raise "NAME: problem" so that the loaders can say where a bad value came from.


def positive(instance: object, attribute: attrs.Attribute[Any], value: float) -> None:
    """The value must be a finite number greater than 0 (``inf``: a wait of for ever)."""
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{attribute.name}: must be greater than 0 (and finite), got {value}")


def not_negative(instance: object, attribute: attrs.Attribute[Any], value: float) -> None:
    """The value must be a finite number, 0 or more (was: ``nan`` passed, and the server
    failed on it later: at its first SIGTERM, for ``drain_timeout``)."""
    if not (value >= 0 and math.isfinite(value)):
        raise ValueError(f"{attribute.name}: must not be negative (and finite), got {value}")


def share(instance: object, attribute: attrs.Attribute[Any], value: float) -> None:
    """The value must be a share: in (0, 1]."""
    if not 0 < value <= 1:
        raise ValueError(f"{attribute.name}: must be in (0, 1], got {value}")


def at_most(limit: float) -> Validator:
    """The value must be at most ``limit``."""

    def check(instance: object, attribute: attrs.Attribute[Any], value: float) -> None:
        if value > limit:
            raise ValueError(f"{attribute.name}: must be at most {limit}, got {value}")

    return check


def at_least(floor: float, why: str = "") -> Validator:
    """The value must be at least ``floor`` (``why`` is said in the message)."""
    reason = f" ({why})" if why else ""

    def check(instance: object, attribute: attrs.Attribute[Any], value: float) -> None:
        if value < floor:
            raise ValueError(f"{attribute.name}: must be at least {floor}{reason}, got {value}")

    return check


def multiple_of(factor: int, why: str = "") -> Validator:
    """The value must be a multiple of ``factor`` (``why`` is said in the message)."""
    reason = f" ({why})" if why else ""

    def check(instance: object, attribute: attrs.Attribute[Any], value: int) -> None:
        if value % factor:
            raise ValueError(
                f"{attribute.name}: must be a multiple of {factor}{reason}, got {value}"
            )

    return check


def one_of(*choices: str) -> Validator:
    """The value must be one of ``choices``."""

    def check(instance: object, attribute: attrs.Attribute[Any], value: str) -> None:
        if value not in choices:
            raise ValueError(
                f"{attribute.name}: must be one of {', '.join(choices)}, got {value!r}"
            )

    return check


# --------------------------------------------------------------------------- structuring

_BOOLEANS = {
    "true": True,
    "yes": True,
    "on": True,
    "1": True,
    "false": False,
    "no": False,
    "off": False,
    "0": False,
}


def make_converter() -> cattrs.Converter:
    """A cattrs converter that reads settings as people write them: numbers and booleans from
    strings (``"1_000"``, ``"yes"``), sizes (:data:`ByteSize`, also ``None``/``"auto"`` for an
    optional one; a bare number below 1 MiB is refused, :func:`parse_byte_size`), HTTP
    addresses (:data:`HttpAddress`); it refuses unknown keys and values of the wrong kind."""
    conv = cattrs.Converter(forbid_extra_keys=True)

    def number(kind: type) -> Any:
        expected = "an integer" if kind is int else "a number"

        def hook(value: Any, _: Any) -> Any:
            if isinstance(value, bool):
                raise TypeError(f"expected {expected}, got a boolean")
            if isinstance(value, (int, float)) and (kind is float or isinstance(value, int)):
                return kind(value)
            if isinstance(value, str):
                try:
                    return kind(value.strip().replace("_", ""))
                except ValueError:
                    raise ValueError(f"expected {expected}, got {value!r}") from None
            raise TypeError(f"expected {expected}, got {value!r}")

        return hook

    def string(value: Any, _: Any) -> str:
        if not isinstance(value, str):
            raise TypeError(f"expected a string, got {value!r}")
        return value

    def boolean(value: Any, _: Any) -> bool:
        if isinstance(value, bool):
            return value
        if type(value) is int and value in (0, 1):  # JSON's 0 and 1
            return bool(value)
        if isinstance(value, str) and value.strip().lower() in _BOOLEANS:
            return _BOOLEANS[value.strip().lower()]
        raise ValueError(f"expected true or false, got {value!r}")

    def optional_size(value: Any, _: Any) -> ByteSize | None:
        if value is None or (isinstance(value, str) and value.strip().lower() in ("", "auto")):
            return None  # the default: sized from the machine at start (server/_l1size.py)
        return ByteSize(parse_byte_size(value))

    conv.register_structure_hook(int, number(int))
    conv.register_structure_hook(float, number(float))
    conv.register_structure_hook(str, string)
    conv.register_structure_hook(bool, boolean)
    conv.register_structure_hook(ByteSize, lambda v, _: ByteSize(parse_byte_size(v)))
    conv.register_structure_hook_func(lambda t: t == ByteSize | None, optional_size)

    def http_address(value: Any, _: Any) -> HttpAddress:
        if isinstance(value, int) and not isinstance(value, bool):
            value = str(value)
        return HttpAddress(string(value, _))

    conv.register_structure_hook(HttpAddress, http_address)
    return conv


_converter = make_converter()


def structure_options(cls: type[_T], raw: dict[str, Any], what: str) -> _T:
    """Structure backend options (strings from flags, or TOML values) into the attrs class
    ``cls``; :class:`ConfigError` in one line naming ``what`` and the bad option."""
    known = [a.name for a in attrs.fields(cast(Any, cls))]
    unknown = sorted(set(raw) - set(known))
    if unknown:
        raise ConfigError(
            f"{what}: unknown option {unknown[0]!r} (options: {', '.join(known) or 'none'})"
        )
    try:
        return _converter.structure(raw, cls)
    except Exception as exc:
        merged = {name: (value, what) for name, value in raw.items()}
        raise ConfigError(describe_error(exc, merged).replace("invalid setting", what, 1)) from None


def describe_error(exc: Exception, merged: Mapping[str, tuple[Any, str]]) -> str:
    """One line for a structuring error: ``invalid setting: NAME = VALUE (from SOURCE):
    problem; …``, where ``merged`` maps each given name to ``(value, where it came from)``."""

    def source(name: str) -> str:
        return merged[name][1] if name in merged else "the default"

    problems: list[str] = []
    if isinstance(exc, cattrs.ClassValidationError):
        for line in cattrs.transform_error(exc, path="", format_exception=_format_error):
            message, _, where = line.rpartition(" @ ")
            name = where.lstrip(".$")
            if not name:  # raised by a validator in the class's __init__: "NAME: problem"
                name, _, message = message.partition(": ")
            problems.append(
                f"{name} = {merged[name][0]!r} (from {source(name)}): {message}"
                if name in merged
                else f"{name}: {message}"
            )
    else:
        problems.append(str(exc))
    return "invalid setting: " + "; ".join(problems)


def _format_error(exc: BaseException, type_: Any) -> str:
    if isinstance(exc, (ValueError, TypeError)):
        return str(exc)
    return format_exception(exc, type_)
