"""The ``l2`` setting's items: a backend's registered name and its raw options.

Parsed here, checked later: the options stay strings until the backend's registry entry
structures them (``kvtrio.l2``), so a setting names an installed plugin's options without this
module knowing them.
"""

from __future__ import annotations

from typing import Any

from attrs import field, frozen

__all__ = ["BackendSpec", "parse_backend_spec", "structure_backends"]


@frozen
class BackendSpec:
    """One L2 backend of the cascade: its registered name and its raw options."""

    name: str
    options: dict[str, Any] = field(factory=dict)


def parse_backend_spec(text: str) -> BackendSpec:
    """``NAME`` or ``NAME:key=value,key=value`` → :class:`BackendSpec` (values stay strings)."""
    name, _, rest = text.strip().partition(":")
    if not name:
        raise ValueError(f"{text!r} names no backend (expected NAME:key=value,...)")
    options: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in rest.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"{item!r} in {text!r} is not key=value")
        options[key.strip()] = value.strip()
    return BackendSpec(name.strip(), options)


def structure_backends(value: Any, _: Any) -> tuple[BackendSpec, ...]:
    """The ``l2`` setting, as given (``a:k=v;b``, a list of such strings, or TOML tables with
    a ``name``) → its backend specs; ``none`` or an empty item stands for no backend."""
    items = value.split(";") if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)):
        raise TypeError(f"expected a list of backends, got {value!r}")
    specs: list[BackendSpec] = []
    for item in items:
        if isinstance(item, BackendSpec):
            specs.append(item)
        elif isinstance(item, str):
            if item.strip().lower() in ("", "none"):
                continue
            specs.append(parse_backend_spec(item))
        elif isinstance(item, dict) and isinstance(item.get("name"), str):
            specs.append(BackendSpec(item["name"], {k: v for k, v in item.items() if k != "name"}))
        else:
            raise TypeError(f"expected NAME:key=value,... or a table with a name, got {item!r}")
    return tuple(specs)
