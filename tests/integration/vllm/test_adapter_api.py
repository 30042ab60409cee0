"""kvtrio's adapters promise the API of vLLM's LMCache multiprocess adapters: every public
method both have takes the same parameters (names, kinds, order) and is of the same kind
(method or property). Runs in the ``vllm`` tox env, against the pinned vLLM 0.33.0.

vLLM's adapter module imports ``lmcache`` (not installed here), so its classes are read from
the source with :mod:`ast` rather than imported. kvtrio's methods may add optional
keyword-only parameters of their own (e.g. ``wait`` of ``check_lookup_result``): code written
against vLLM never passes them.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
from pathlib import Path
from typing import Any

import pytest

from kvtrio.client import SchedulerAdapter, WorkerAdapter

_PACKAGE = "vllm.distributed.kv_transfer.kv_connector.v1"
_MODULE = "lmcache_integration/multi_process_adapter.py"

Signature = tuple[str, list[tuple[str, str]]]
"""``(kind, [(parameter name, parameter kind), ...])`` with kind ``method`` or ``property``."""


def _vllm_methods(class_name: str) -> dict[str, Signature]:
    spec = importlib.util.find_spec(_PACKAGE)
    assert spec is not None
    assert spec.submodule_search_locations
    path = Path(next(iter(spec.submodule_search_locations))) / _MODULE
    tree = ast.parse(path.read_text())
    (node,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == class_name]
    methods = {}
    for item in node.body:
        if not isinstance(item, ast.FunctionDef) or item.name.startswith("_"):
            continue
        decorators = {d.id for d in item.decorator_list if isinstance(d, ast.Name)}
        kind = "property" if "property" in decorators else "method"
        a = item.args
        params = [(p.arg, "POSITIONAL_ONLY") for p in a.posonlyargs]
        params += [(p.arg, "POSITIONAL_OR_KEYWORD") for p in a.args]
        if a.vararg:
            params.append((a.vararg.arg, "VAR_POSITIONAL"))
        params += [(p.arg, "KEYWORD_ONLY") for p in a.kwonlyargs]
        if a.kwarg:
            params.append((a.kwarg.arg, "VAR_KEYWORD"))
        methods[item.name] = (kind, [p for p in params if p[0] != "self"])
    return methods


def _ours(cls: type[Any], name: str) -> tuple[str, list[inspect.Parameter]] | None:
    found = inspect.getattr_static(cls, name, None)
    if found is None:
        return None
    if isinstance(found, property):
        return "property", []
    params = [p for p in inspect.signature(found).parameters.values() if p.name != "self"]
    return "method", params


@pytest.mark.parametrize(
    ("ours", "name"),
    [
        (SchedulerAdapter, "LMCacheMPSchedulerAdapter"),
        (WorkerAdapter, "LMCacheMPWorkerAdapter"),
    ],
)
def test_adapter_methods_match_vllms(ours: type[Any], name: str) -> None:
    shared, problems = [], []
    for method, (kind, expected) in _vllm_methods(name).items():
        mine = _ours(ours, method)
        if mine is None:
            continue
        shared.append(method)
        my_kind, params = mine
        if my_kind != kind:
            problems.append(f"{method}: a {my_kind} here, a {kind} in vLLM")
            continue
        if kind == "property":
            continue
        head = [(p.name, p.kind.name) for p in params[: len(expected)]]
        if head != expected:
            problems.append(f"{method}: {head} here, {expected} in vLLM")
        for extra in params[len(expected) :]:
            if extra.kind is not inspect.Parameter.KEYWORD_ONLY or extra.default is extra.empty:
                problems.append(f"{method}: extra parameter {extra.name} is not optional keyword")
    assert {"num_blocks_per_chunk"} <= set(shared) or name.endswith("WorkerAdapter")
    assert len(shared) >= 5, f"too few shared methods ({shared}): is this vLLM's adapter?"
    assert problems == []


def test_num_blocks_per_chunk_is_a_method_in_both() -> None:
    for cls, name in ((SchedulerAdapter, "LMCacheMPSchedulerAdapter"),
                      (WorkerAdapter, "LMCacheMPWorkerAdapter")):  # fmt: skip
        assert _vllm_methods(name)["num_blocks_per_chunk"] == ("method", [])
        assert inspect.isfunction(inspect.getattr_static(cls, "num_blocks_per_chunk"))
