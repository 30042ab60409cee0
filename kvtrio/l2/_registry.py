"""Backends found through the ``kvtrio.backends`` entry-point group, imported only when used.

Like fsspec and keyring: the registry knows names from entry-point metadata without importing
anything; a backend's module is imported when a server uses it, or when ``kvtrio backends``
describes it. A backend that fails to import is reported with the reason and an install hint.

:func:`register` adds a backend for this process only, as an installed entry point would: for
a test backend (``kvtrio.testing.FaultBackend``) or a script that brings its own. A server
process started from the command line reads only the installed metadata.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Mapping
from typing import Any

import attrs

from ..errors import ConfigError
from ..options import structure_options
from ._interface import Backend

__all__ = [
    "GROUP",
    "BackendInfo",
    "create_backend",
    "describe_backends",
    "load_backend_class",
    "register",
    "unregister",
]

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


_REGISTERED: dict[str, importlib.metadata.EntryPoint] = {}
"""Backends registered in this process by :func:`register`, by name."""


def register(name: str, target: str | type) -> None:
    """Make backend ``name`` known to this process, as an entry point of the ``kvtrio.backends``
    group would: ``target`` is ``"module:Class"`` (imported when first used) or the class.

    Registering the same target again is allowed; a name that is installed or registered with
    another target raises :class:`ConfigError`. :func:`unregister` removes it again.
    """
    value = target if isinstance(target, str) else f"{target.__module__}:{target.__qualname__}"
    module, colon, attribute = value.partition(":")
    if not (name and module and colon and attribute):
        raise ConfigError(f"register({name!r}, {value!r}): expected a name and 'module:Class'")
    known = _entry_points().get(name)
    if known is not None and known.value != value:
        raise ConfigError(f"the L2 backend {name!r} is already {known.value}, not {value}")
    _REGISTERED[name] = importlib.metadata.EntryPoint(name, value, GROUP)


def unregister(name: str) -> None:
    """Forget a backend :func:`register` added (installed entry points stay); no error if it
    was not registered."""
    _REGISTERED.pop(name, None)


def _entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    found = {ep.name: ep for ep in importlib.metadata.entry_points(group=GROUP)}
    return {**found, **_REGISTERED}


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
