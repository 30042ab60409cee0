"""Import vLLM once, here, with its import-time warnings silenced; the fixtures the modules share.

The suite turns warnings into errors; importing vLLM 0.33.0 with torch 2.13.0 warns about
deprecations inside torch and vLLM themselves, which are not this project's to fix. Everything
the tests import from vLLM is imported here first, so later imports hit the module cache.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvtrio.launch import ServerProcess

from ..._support.server_cache import cache
from ..._support.waiting import wait_for
from ..tiny_model import write_tiny_model

for _name, _value in {
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
}.items():
    os.environ.setdefault(_name, _value)

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from . import harness  # noqa: F401  (imports vLLM's scheduler, runner mixin, config)
    from .harness import make_config
    from .hybrid import HybridEngine


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model's folder, written once a module."""
    return write_tiny_model(tmp_path_factory.mktemp("model"))


@pytest.fixture
def hybrid_engines(model_dir: Path) -> Iterator[Callable[..., HybridEngine]]:
    """``hybrid_engines(server, pattern, **options)``: a new vLLM scheduler with its hybrid
    manager on (:mod:`.hybrid`, layers by ``pattern``) and kvtrio at ``server`` as its connector
    (``options``: :func:`~.harness.make_config`'s), once its worker has registered. The previous
    one is shut down first; the last one after the test."""
    made: list[HybridEngine] = []

    def make(server: ServerProcess, pattern: str, **options: Any) -> HybridEngine:
        for engine in made:
            engine.close()
        engine = HybridEngine(make_config(model_dir, server.endpoint, **options), pattern)
        made.append(engine)
        wait_for(lambda: cache(server).registrations >= 1, what="the worker to register")
        return engine

    yield make
    for engine in made:
        engine.close()
