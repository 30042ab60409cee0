"""kvtrio's adapters promise the API of vLLM's LMCache multiprocess adapters: every public
method both have takes the same parameters (names, kinds, order) and is of the same kind
(method, property, ...). Runs in the ``vllm`` tox env, against the pinned vLLM 0.33.0.

kvtrio's methods may add optional keyword-only parameters of their own (e.g. ``wait`` of
``check_lookup_result``): code written against vLLM never passes them.
"""

from __future__ import annotations

import importlib
import inspect
import warnings
from typing import Any

import pytest

from kvtrio.client import SchedulerAdapter, WorkerAdapter

_MODULES = (
    "vllm.distributed.kv_transfer.kv_connector.v1.lmcache_integration.multi_process_adapter",
    "vllm.distributed.kv_transfer.kv_connector.v1.lmcache_integration",
)


def _vllm_class(name: str) -> type[Any]:
    for module_name in _MODULES:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                module = importlib.import_module(module_name)
        except ImportError:
            continue
        found = getattr(module, name, None)
        if isinstance(found, type):
            return found
    pytest.skip(f"this vLLM has no {name}")


def _parameters(function: Any) -> list[inspect.Parameter]:
    return [p for p in inspect.signature(function).parameters.values() if p.name != "self"]


def _differences(ours: type[Any], theirs: type[Any]) -> tuple[list[str], list[str]]:
    shared, problems = [], []
    for name, their_attr in vars(theirs).items():
        if name.startswith("_"):
            continue
        our_attr = inspect.getattr_static(ours, name, None)
        if our_attr is None:
            continue
        shared.append(name)
        if type(our_attr) is not type(their_attr):
            problems.append(f"{name}: {type(our_attr).__name__} vs {type(their_attr).__name__}")
            continue
        if not callable(their_attr) and not isinstance(their_attr, (staticmethod, classmethod)):
            continue
        our_fn = getattr(ours, name)
        their_fn = getattr(theirs, name)
        mine, vllm = _parameters(our_fn), _parameters(their_fn)
        expected = [(p.name, p.kind) for p in vllm]
        if [(p.name, p.kind) for p in mine[: len(vllm)]] != expected:
            problems.append(f"{name}{inspect.signature(our_fn)} vs {inspect.signature(their_fn)}")
            continue
        for extra in mine[len(vllm) :]:
            if extra.kind is not inspect.Parameter.KEYWORD_ONLY or extra.default is extra.empty:
                problems.append(f"{name}: extra parameter {extra.name} must be optional keyword")
    return shared, problems


@pytest.mark.parametrize(
    ("ours", "name"),
    [
        (SchedulerAdapter, "LMCacheMPSchedulerAdapter"),
        (WorkerAdapter, "LMCacheMPWorkerAdapter"),
    ],
)
def test_adapter_methods_match_vllms(ours: type[Any], name: str) -> None:
    shared, problems = _differences(ours, _vllm_class(name))
    assert shared, f"no public method of {name} is in {ours.__name__}"
    assert problems == []


def test_num_blocks_per_chunk_is_a_method() -> None:
    theirs = _vllm_class("LMCacheMPSchedulerAdapter")
    assert inspect.isfunction(inspect.getattr_static(theirs, "num_blocks_per_chunk"))
    assert inspect.isfunction(inspect.getattr_static(SchedulerAdapter, "num_blocks_per_chunk"))
