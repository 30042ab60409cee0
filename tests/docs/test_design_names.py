"""Every path and dotted name ``docs/design.md`` mentions in backticks exists.

A path (``server/cache/_core.py``, ``tests/fleet``, ``bench/l1.py``) is looked for from the
repository's root, from ``kvtrio/`` and from each of its packages (the design names modules
relative to their package); a bare file name anywhere in the repository. A dotted name
(``kvtrio.l2.register``, ``transport.check_endpoint``, ``CacheCore.turn()``) must resolve, as
attributes and submodules, from ``kvtrio`` or from one of its modules. Names of other projects
(``zmq.auth``, ``torch.utils.cpp_extension``) and placeholders (``<path>/secret``) are not
checked; the connector's option keys (``kvtrio.insecure``) are not Python names.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

import kvtrio

REPO = Path(__file__).resolve().parents[2]
DESIGN = REPO / "docs" / "design.md"
PACKAGE = REPO / "kvtrio"

SPAN = re.compile(r"`([^`\n]+)`")
FILE = re.compile(r"^[\w./-]+\.(py|md|c|h|cu|sh|toml|ini|txt|jsonl)$")
FOLDER = re.compile(r"^[\w.-]+(/[\w.-]+)*/$")
DOTTED = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)+(\(\))?$")
NOT_PYTHON = {"kvtrio.insecure", "kvtrio.keys", "kvtrio.async_load", "kvtrio.backends"}
"""The vLLM connector's ``kvtrio.*`` options and the backends' entry-point group."""


def spans() -> list[str]:
    return sorted(set(SPAN.findall(DESIGN.read_text(encoding="utf-8"))))


def paths() -> list[str]:
    return [s for s in spans() if FILE.match(s) or FOLDER.match(s)]


def dotted_names() -> list[str]:
    names = [s.removesuffix("()") for s in spans() if DOTTED.match(s) and not FILE.match(s)]
    return [n for n in names if n not in NOT_PYTHON and n.split(".")[0] in first_names()]


@cache
def modules() -> dict[str, ModuleType]:
    """Every importable module of kvtrio (those that need vLLM or torch are left out here)."""
    found: dict[str, ModuleType] = {"kvtrio": kvtrio}
    for info in pkgutil.walk_packages(kvtrio.__path__, "kvtrio."):
        try:
            found[info.name] = importlib.import_module(info.name)
        except ImportError:
            continue
    return found


@cache
def first_names() -> frozenset[str]:
    """What a dotted name of kvtrio's may start with: ``kvtrio``, a module's last component,
    or a name defined at the top of one of its modules."""
    names = {"kvtrio"}
    for name, module in modules().items():
        names.add(name.rpartition(".")[2])
        names.update(
            n
            for n, value in vars(module).items()
            if not n.startswith("__")
            and not (isinstance(value, ModuleType) and not value.__name__.startswith("kvtrio"))
        )
    return frozenset(names)


def resolves(root: Any, parts: list[str], package: str | None) -> bool:
    value = root
    for index, part in enumerate(parts):
        if hasattr(value, part):
            value = getattr(value, part)
            continue
        if attrs_field(value, part):
            return index == len(parts) - 1
        if package is None:
            return False
        try:
            value = importlib.import_module(f"{package}.{'.'.join(parts[: index + 1])}")
        except ImportError:
            return False
    return True


def attrs_field(value: Any, name: str) -> bool:
    """``name`` is an instance attribute of class ``value``: an attrs field, an annotation or
    an assignment ``self.name = …`` in its source."""
    if not isinstance(value, type):
        return False
    fields = getattr(value, "__attrs_attrs__", ())
    if any(field.name == name for field in fields) or name in getattr(value, "__annotations__", {}):
        return True
    try:
        source = inspect.getsource(value)
    except (OSError, TypeError):
        return False
    return re.search(rf"\bself\.{name}\b\s*(:[^=]*)?=", source) is not None


def exists(name: str) -> bool:
    parts = name.split(".")
    if parts[0] == "kvtrio":
        return resolves(kvtrio, parts[1:], "kvtrio")
    for module_name, module in modules().items():
        package = module_name if hasattr(module, "__path__") else module_name.rpartition(".")[0]
        if module_name.rpartition(".")[2] == parts[0]:
            if resolves(module, parts[1:], module_name if hasattr(module, "__path__") else None):
                return True
        elif parts[0] in vars(module) and resolves(module, parts, package):
            return True
    return False


def path_exists(text: str) -> bool:
    relative = text.rstrip("/")
    roots = [REPO, PACKAGE, *(p for p in PACKAGE.iterdir() if p.is_dir())]
    if any((root / relative).exists() for root in roots):
        return True
    if "/" not in relative:  # a bare file name: anywhere in the repository
        return any(not {".tox", ".venv", ".git"} & set(p.parts) for p in REPO.rglob(relative))
    return False


def test_the_design_names_paths_and_names() -> None:
    """The check sees what it should: the design is not empty of either."""
    assert len(paths()) > 50
    assert len(dotted_names()) > 20


@pytest.mark.parametrize("path", paths())
def test_every_path_the_design_mentions_exists(path: str) -> None:
    assert path_exists(path), f"docs/design.md names {path!r}, which is not in the repository"


@pytest.mark.parametrize("name", dotted_names())
def test_every_dotted_name_the_design_mentions_exists(name: str) -> None:
    assert exists(name), f"docs/design.md names {name!r}, which kvtrio does not define"


MAX_DESIGN_LINES = 800
"""The design stays short (issue 36): run-by-run figures belong in ``docs/bench.md``."""


def test_the_design_is_short_and_starts_with_the_folder_map() -> None:
    text = DESIGN.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= MAX_DESIGN_LINES
    headings = [line for line in text.splitlines() if line.startswith("## ")]
    assert headings[0] == "## Folder map"


def test_the_bench_sections_the_design_links_to_exist() -> None:
    """The design names a section of ``docs/bench.md`` by the start of its title."""
    bench = (REPO / "docs" / "bench.md").read_text(encoding="utf-8")
    titles = [line[3:] for line in bench.splitlines() if line.startswith("## ")]
    text = " ".join(DESIGN.read_text(encoding="utf-8").split())
    linked = re.findall(r"\(\[`docs/bench\.md`\]\(bench\.md\), \"([^\"]+)\"\)", text)
    assert linked
    for name in linked:
        assert any(title.startswith(name) for title in titles), name


def test_the_checker_finds_what_does_not_exist() -> None:
    assert exists("kvtrio.l2.register")
    assert exists("CacheIO.settle_copies")
    assert not exists("kvtrio.l2.no_such_name")
    assert not exists("CacheCore.no_such_attribute")
    assert path_exists("server/cache/_core.py")
    assert not path_exists("server/cache/_no_such_module.py")
