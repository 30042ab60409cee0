"""Public names of a package loaded from their modules on first use (PEP 562).

``kvtrio.server`` and ``kvtrio.server.cache`` export their names this way, so that importing
one of the server's I/O-free parts (the cache core) loads neither trio nor ZeroMQ.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_getattr"]


def lazy_getattr(package: str, where: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package`` that loads each name of ``where`` (name →
    relative module) the first time it is asked for and keeps it in the package's namespace;
    any other name raises ``AttributeError``."""
    namespace = vars(importlib.import_module(package))

    def __getattr__(name: str) -> Any:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module, package), name)
        namespace[name] = value
        return value

    return __getattr__
