"""Backends found through the ``kvtrio.backends`` entry-point group, imported only when used.

Like fsspec and keyring: the registry knows names from entry-point metadata without importing
anything; a backend's module is imported when a server uses it, or when ``kvtrio backends``
describes it. A backend that fails to import is reported with the reason and an install hint.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Mapping
from typing import Any

import attrs

from ..errors import ConfigError
from ..options import structure_options
from ._interface import Backend

__all__ = ["GROUP", "BackendInfo", "create_backend", "describe_backends", "load_backend_class"]

GROUP = "kvtrio.backends"

_INSTALL_HINTS = {
    "redis": "pip install 'kvtrio[redis]' (in a checkout: pip install ./backends/redis)",
    "s3": "pip install 'kvtrio[s3]' (in a checkout: pip install ./backends/s3)",
}


@attrs.frozen
class BackendInfo:
    """What ``kvtrio backends`` prints about one backend."""

    name: str
    target: str
    """``module:Class`` from the entry point."""
    options: tuple[tuple[str, str, str], ...] = ()
    """(option, default, one-line help) per option."""
    error: str | None = None


def _entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=GROUP)}


def _hint(name: str) -> str:
    return _INSTALL_HINTS.get(name, f"install the package that provides the {name!r} backend")


def load_backend_class(name: str) -> Any:
    """Import the backend class registered as ``name`` (it is called with its parsed Options
    to make a :class:`Backend`); :class:`ConfigError` if unknown or broken."""
    entry = _entry_points().get(name)
    if entry is None:
        known = ", ".join(sorted(_entry_points())) or "none"
        raise ConfigError(f"no L2 backend named {name!r} (installed: {known}); {_hint(name)}")
    try:
        cls = entry.load()
    except Exception as exc:
        raise ConfigError(
            f"the L2 backend {name!r} ({entry.value}) cannot be imported: "
            f"{type(exc).__name__}: {exc}; {_hint(name)}"
        ) from None
    if not isinstance(cls, type) or not hasattr(cls, "Options"):
        raise ConfigError(f"the L2 backend {name!r} ({entry.value}) is not a backend class")
    return cls


def create_backend(name: str, options: Mapping[str, Any]) -> Backend:
    """Construct backend ``name`` from raw options (strings from flags, or TOML values).

    Raises :class:`ConfigError` with one line naming the backend and the bad option.
    """
    cls = load_backend_class(name)
    parsed = structure_options(cls.Options, dict(options), f"L2 backend {name!r}")
    try:
        backend: Backend = cls(parsed)
    except (ValueError, TypeError, OSError) as exc:
        raise ConfigError(f"L2 backend {name!r}: {exc}") from None
    return backend


def describe_backends() -> list[BackendInfo]:
    """Every installed backend with its options, or why it cannot be loaded."""
    infos = []
    for name, entry in sorted(_entry_points().items()):
        try:
            cls = load_backend_class(name)
        except ConfigError as exc:
            infos.append(BackendInfo(name, entry.value, error=str(exc)))
            continue
        options = tuple(
            (
                field.name,
                "" if field.default is attrs.NOTHING else str(field.default),
                str(field.metadata.get("help", "")),
            )
            for field in attrs.fields(cls.Options)
        )
        infos.append(BackendInfo(name, entry.value, options))
    return infos
