"""kvtrio's import structure: no import cycles, no layer imports a layer above it, and no
package imports another package's private modules.

Imports are read from the source with :mod:`ast` (nothing is executed), function-level imports
included: they run too, only later. Imports under ``if TYPE_CHECKING:`` are never executed, so
they neither form a cycle at run time nor make a lower layer load an upper one; but a cycle
through them still ties two modules together for a reader and the type checker, so cycles are
checked with them too.

The layer order is :data:`LAYERS`, the folder map of ``docs/design.md`` ("Folder map"): a
package or module may import its own package and anything in a lower tier, nothing in its own
tier or above; :data:`FORBIDDEN` adds what the tiers alone would allow but must not happen. A
package uses another only through what that package's ``__init__`` exports.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

import kvtrio

from ._support.lengths import LONG_MODULES, MAX_LINES, long_modules

ROOT = Path(kvtrio.__file__).parent

LAYERS: tuple[tuple[str, ...], ...] = (
    ("_version", "errors"),
    ("_logging", "options", "_backend_spec", "shm", "protocol", "transport", "transfer"),
    ("storage",),
    ("l2", "config"),
    ("server", "client", "testing"),
    ("integration", "launch"),
    ("benchmark",),
    ("cli",),
    ("__main__",),
)
"""Tiers of kvtrio's top-level packages and modules, lowest first (see the module doc)."""

FORBIDDEN = {
    "client": {"server", "storage", "l2", "config"},
    "testing": {"server", "client"},
}
"""Imports the tiers would allow but the design does not: the client is what engines install
next to their own code and knows only the wire (protocol, transport), the shared arena and the
copies; the test helpers stand below both server and client."""


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _type_checking_only(tree: ast.Module) -> set[int]:
    """ids of the nodes under ``if TYPE_CHECKING:`` (or ``typing.TYPE_CHECKING``)."""
    hidden: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING"):
            for child in node.body:
                hidden.update(id(n) for n in ast.walk(child))
    return hidden


def imports(
    path: Path, modules: set[str], *, type_checking: bool = False
) -> Iterator[tuple[str, int]]:
    """The kvtrio modules ``path`` imports (``(module, line)``), resolved to modules (a
    ``from package import submodule`` names the submodule); with ``type_checking``, those
    under ``if TYPE_CHECKING:`` too."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(encoding="utf-8"))
    hidden = set() if type_checking else _type_checking_only(tree)
    for node in ast.walk(tree):
        if id(node) in hidden:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "kvtrio":
                    yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            if target.split(".")[0] != "kvtrio":
                continue
            for alias in node.names:
                submodule = f"{target}.{alias.name}"
                yield (submodule if submodule in modules else target), node.lineno


def graph(*, type_checking: bool = False) -> dict[str, dict[str, int]]:
    """module → {imported module: line of the first import}."""
    paths = sorted(ROOT.rglob("*.py"))
    modules = {module_name(p) for p in paths}
    edges: dict[str, dict[str, int]] = {}
    for path in paths:
        found = edges.setdefault(module_name(path), {})
        for target, line in imports(path, modules, type_checking=type_checking):
            if target != module_name(path):
                found.setdefault(target, line)
    return edges


def top(module: str) -> str:
    """The top-level package or module of ``kvtrio.x.y``: ``x``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def tier(name: str) -> int:
    for index, names in enumerate(LAYERS):
        if name in names:
            return index
    raise AssertionError(f"kvtrio.{name} is in no layer: add it to LAYERS and docs/design.md")


def test_every_top_level_package_has_a_layer() -> None:
    names = {top(m) for m in graph()} - {""}
    for name in sorted(names):
        tier(name)


def test_no_layer_imports_one_above_or_beside_it() -> None:
    wrong = []
    for module, targets in graph().items():
        mine = top(module)
        if not mine:  # kvtrio/__init__.py: the version only
            assert set(targets) <= {"kvtrio._version"}, targets
            continue
        for target, line in targets.items():
            theirs = top(target)
            if theirs == mine:
                continue
            if tier(theirs) >= tier(mine) or theirs in FORBIDDEN.get(mine, ()):
                wrong.append(f"{module} (line {line}) imports {target}")
    assert not wrong, "imports against the layer order:\n" + "\n".join(wrong)


def test_the_client_needs_neither_server_nor_storage() -> None:
    """Spelled out, since it is the rule engines rely on (FORBIDDEN checks it too)."""
    for module, targets in graph().items():
        if top(module) == "client":
            assert not {top(t) for t in targets} & {"server", "storage"}, module


def find_cycle(edges: dict[str, dict[str, int]]) -> list[str] | None:
    """One import cycle (its modules, the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        stack.append(module)
        for target in edges.get(module, {}):
            if state.get(target) == 1:
                return [*stack[stack.index(target) :], target]
            if target not in state and (cycle := visit(target)) is not None:
                return cycle
        stack.pop()
        state[module] = 2
        return None

    for module in sorted(edges):
        if module not in state and (cycle := visit(module)) is not None:
            return cycle
    return None


def test_no_import_cycles() -> None:
    cycle = find_cycle(graph())
    assert cycle is None, "import cycle: " + " → ".join(cycle or [])


def test_no_import_cycles_even_through_type_checking_imports() -> None:
    cycle = find_cycle(graph(type_checking=True))
    assert cycle is None, "import cycle (TYPE_CHECKING included): " + " → ".join(cycle or [])


def test_no_package_imports_another_packages_private_modules() -> None:
    """``kvtrio.a.x`` may import ``kvtrio.b`` (what its ``__init__`` exports) or ``kvtrio.b.y``,
    never ``kvtrio.b._y``; its own package's private modules are its own business."""
    wrong = []
    for module, targets in graph(type_checking=True).items():
        for target, line in targets.items():
            if top(target) == top(module) or not top(target):
                continue
            inside = target.split(".")[2:]  # below the other package
            if any(part.startswith("_") for part in inside):
                wrong.append(f"{module} (line {line}) imports {target}")
    assert not wrong, "private modules of other packages imported:\n" + "\n".join(wrong)


@pytest.mark.parametrize(
    ("edges", "cyclic"),
    [
        ({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}}, True),
        ({"a": {"b": 1}, "b": {"c": 1}, "c": {}}, False),
        ({"a": {"a.x": 1}, "a.x": {"a": 1}}, True),
    ],
)
def test_the_cycle_finder_finds_cycles(edges: dict[str, dict[str, int]], cyclic: bool) -> None:
    assert (find_cycle(edges) is not None) is cyclic


def test_type_checking_imports_do_not_count(tmp_path: Path) -> None:
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from .b import B\n"
        "from .c import C\n"
    )
    tree = ast.parse(source)
    hidden = _type_checking_only(tree)
    counted = [
        n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and id(n) not in hidden
    ]
    assert counted == ["typing", "c"]


def test_modules_over_the_line_limit_are_reported(request: pytest.FixtureRequest) -> None:
    """A report, not a failure: the long modules are listed in the run's terminal summary
    (``tests/_support/lengths.py``); a module is split by concern, not by length."""
    request.config.stash[LONG_MODULES] = long_modules(ROOT)


def test_the_length_report_lists_long_modules_only(tmp_path: Path) -> None:
    (tmp_path / "short.py").write_text("x = 1\n" * MAX_LINES)
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "long.py").write_text("x = 1\n" * (MAX_LINES + 1))
    (tmp_path / "notes.txt").write_text("x\n" * (MAX_LINES + 1))
    assert long_modules(tmp_path) == {"pkg/long.py": MAX_LINES + 1}
