"""The server's folder rules (docs/design.md, "The server's folders"), read from the source.

(Module lengths are a report, not a rule: ``tests/test_layers.py``.)

- ``server/l2tier`` imports nothing else of the server; ``server/cache`` imports only the
  request path's seams (``_state``, ``_session``), the tenants' arenas, the L2 tier and the
  packages' lazy exports (``_lazy``);
- the rest of the server uses the cache through its package, never its private modules;
- the cache operations (lookups, writes, reads) do not know which copy path they serve: the
  host/CUDA choice is made once, at registration;
- the request path imports in one direction: router → sessions → the hand-off seam → state
  (the sessions reply through a ``Replies`` protocol, not the router or its outbox).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

import kvtrio.server

SERVER = Path(kvtrio.server.__file__).parent


def modules(folder: Path = SERVER) -> list[Path]:
    return sorted(folder.rglob("*.py"))


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SERVER.parent.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> Iterator[str]:
    """Every module ``path`` imports (absolute names; type-checking imports included)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                yield ".".join(base + ([node.module] if node.module else []))
            else:
                yield node.module or ""


def server_imports(path: Path) -> set[str]:
    """The ``kvtrio.server`` modules and packages ``path`` imports."""
    return {target for target in imports(path) if target.startswith("kvtrio.server")}


def test_the_l2_tier_imports_nothing_else_of_the_server() -> None:
    for path in modules(SERVER / "l2tier"):
        outside = {t for t in server_imports(path) if not t.startswith("kvtrio.server.l2tier")}
        assert not outside, (path.name, outside)


def test_the_cache_imports_only_the_seams_of_the_request_path() -> None:
    allowed = {
        "kvtrio.server._state",
        "kvtrio.server._session",
        "kvtrio.server._tenants",
        "kvtrio.server.l2tier",
        "kvtrio.server._lazy",
    }
    for path in modules(SERVER / "cache"):
        outside = {t for t in server_imports(path) if not t.startswith("kvtrio.server.cache")}
        assert outside <= allowed, (path.name, outside - allowed)


def test_the_rest_of_the_server_uses_the_cache_and_the_tier_through_their_packages() -> None:
    for path in modules():
        if path.parent.name in ("cache", "l2tier"):
            continue
        private = {
            t
            for t in server_imports(path)
            if t.startswith(("kvtrio.server.cache.", "kvtrio.server.l2tier."))
        }
        assert not private, (path.name, private)


@pytest.mark.parametrize("name", ["_lookups.py", "_writes.py", "_reads.py"])
def test_the_cache_operations_do_not_branch_on_the_copy_path(name: str) -> None:
    tree = ast.parse((SERVER / "cache" / name).read_text())
    names = {
        node.id if isinstance(node, ast.Name) else node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Name | ast.Attribute)
    }
    assert not {n for n in names if "cuda" in n.lower()}, name
    assert not [
        n for n in ast.walk(tree) if isinstance(n, ast.Constant) and n.value in ("cuda", "cpu")
    ], name


REQUEST_PATH_MAY_NOT_IMPORT = {
    "_state": {"_router", "_session", "_handoff", "_outbox", "_metrics"},
    "_handoff": {"_router", "_session", "_outbox"},
    "_session": {"_router", "_outbox"},
    "_outbox": {"_router", "_session", "_handoff"},
    "_metrics": {"_state", "_router", "_session"},
}


@pytest.mark.parametrize("name", sorted(REQUEST_PATH_MAY_NOT_IMPORT))
def test_the_request_path_imports_in_one_direction(name: str) -> None:
    imported = {t.rpartition(".")[2] for t in server_imports(SERVER / f"{name}.py")}
    assert not imported & REQUEST_PATH_MAY_NOT_IMPORT[name], (name, imported)
