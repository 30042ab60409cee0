"""The sync client's modules: one owner of the shared state, no cycles, no private reaches.

``_state`` (what the threads share) is imported by ``_connection``, ``_background`` and
``_sync``; ``_background`` drives a ``_connection``; ``_sync`` puts them together. Read with
:mod:`ast`, ``if TYPE_CHECKING:`` imports included (``tests/test_layers.py`` leaves those out).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import kvtrio.client

CLIENT = Path(kvtrio.client.__file__).parent
MODULES = ("_state", "_connection", "_background", "_sync")
ALLOWED = {
    "_state": set(),
    "_connection": {"_state"},
    "_background": {"_state", "_connection"},
    "_sync": {"_state", "_connection", "_background"},
}


def _tree(module: str) -> ast.Module:
    return ast.parse((CLIENT / f"{module}.py").read_text(encoding="utf-8"))


def _sibling_imports(tree: ast.Module) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            names = [node.module] if node.module else [a.name for a in node.names]
            found.update(name for name in names if name in MODULES)
        elif isinstance(node, ast.ImportFrom) and node.module:
            parts = node.module.split(".")
            if parts[:2] == ["kvtrio", "client"] and len(parts) > 2 and parts[2] in MODULES:
                found.add(parts[2])
    return found


@pytest.mark.parametrize("module", MODULES)
def test_imports_follow_the_order_type_checking_included(module: str) -> None:
    assert _sibling_imports(_tree(module)) <= ALLOWED[module]


@pytest.mark.parametrize("module", MODULES)
def test_no_private_name_of_another_object(module: str) -> None:
    # ``x._name`` only on ``self``: the state's fields and the connection's are public.
    reaches = [
        f"{module}.py:{node.lineno}: {ast.unparse(node)}"
        for node in ast.walk(_tree(module))
        if isinstance(node, ast.Attribute)
        and node.attr.startswith("_")
        and not node.attr.startswith("__")
        and not (isinstance(node.value, ast.Name) and node.value.id == "self")
    ]
    assert reaches == []
