"""docs/vllm.md run as a deployer runs it: §2's kvtrio commands, then §3's CPU command, twice.

The guide's own lines are read from the guide and run, with only what this machine must change:

- the ipc socket moves from ``/tmp/kvtrio.sock`` to a private temporary directory, the L1 from
  8GiB to 128MiB, the API server's port from 8000 to a free one, ``VLLM_CPU_KVCACHE_SPACE``
  from 8 to 1 (GiB), ``python`` is this environment's, and kvtrio's L2 is off
  (``KVTRIO_L2=none``: the default disk L2 would write to ``~/.cache``);
- ``MODEL`` is the tests' tiny model, which has no tokenizer and is float32, so vLLM is also
  given ``--skip-tokenizer-init --dtype float32``, and ``--enforce-eager`` (no time to compile
  on 2 cores); vLLM's telemetry is off and its processes stay on 127.0.0.1 (``engine.ENV``).

Two engines share one kvtrio, as §8 says several engines on one host do: engine 1 computes a
prompt (kvtrio stores its whole chunks), then a second prompt with the same prefix (vLLM's own
prefix cache, on as the guide recommends, answers it: its outputs are the reference); engine 2,
which never saw the prefix, gets the second prompt and loads the prefix from kvtrio. Checked as
§4 and §6 say a deployer checks it: ``cached_tokens`` of the OpenAI API, vLLM's
``vllm:external_prefix_cache_hits_total``, its log lines (the connector's creation, the
*External prefix cache hit rate*), kvtrio's sessions in its log, and ``kvtrio status``.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvtrio.client import Client
from kvtrio.protocol import GetStats, StatsReply

from ..._support.vllm_cpu import PREFIX, STARTUP
from ..._support.waiting import wait_for
from ..._support.web import free_port, http, prometheus
from ...docs.guide import blocks, script
from ..tiny_model import write_tiny_model
from .engine import ENV

CHUNK = 256  # the guide's --chunk-size
PROMPT_A = PREFIX  # 600 tokens: 2 whole chunks and a bit
PROMPT_B = [*PREFIX[:540], 11, 12, 13]  # shares 540 tokens with A: both of A's chunks
HIT = 2 * CHUNK
KVTRIO = Path(sys.executable).with_name("kvtrio")


def guide_lines(short_dir: Path) -> tuple[list[str], list[str]]:
    """§2's three kvtrio lines and §3's CPU command, with this machine's substitutions."""

    def local(line: str) -> str:
        return line.replace("ipc:///tmp/kvtrio.sock", f"ipc://{short_dir}/kvtrio.sock")

    (start,) = (block for block in blocks("sh") if "kvtrio ping" in block)
    kvtrio = [local(line) for line in script(start)]
    (cpu,) = (block for block in blocks("sh") if "vllm.entrypoints.openai.api_server" in block)
    (vllm,) = script(cpu)
    return kvtrio, shlex.split(local(vllm))


def vllm_command(words: list[str], model: Path, port: int) -> tuple[list[str], dict[str, str]]:
    """The guide's CPU command as argv and environment, for ``model`` on ``port``."""
    env = {}
    while "=" in words[0] and not words[0].startswith("-"):
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    assert env == {"VLLM_CPU_KVCACHE_SPACE": "8"}
    assert words[:3] == ["python", "-m", "vllm.entrypoints.openai.api_server"]
    replaced = {"--model": ("MODEL", str(model)), "--port": ("8000", str(port))}
    argv = [sys.executable, *words[1:]]
    for flag, (documented, value) in replaced.items():
        at = argv.index(flag) + 1
        assert argv[at] == documented
        argv[at] = value
    assert argv[argv.index("--host") + 1] == "127.0.0.1"
    argv += ["--skip-tokenizer-init", "--dtype", "float32", "--enforce-eager"]
    return argv, {
        **os.environ,
        **ENV,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_LOG_STATS_INTERVAL": "1",  # the stats line every second, not every 10
        "PYTHONUNBUFFERED": "1",
    }


class Engine:
    """One ``python -m vllm.entrypoints.openai.api_server`` process, stopped by PID."""

    def __init__(self, argv: list[str], env: dict[str, str], port: int, log: Path) -> None:
        self.base = f"http://127.0.0.1:{port}"
        self.model = argv[argv.index("--model") + 1]
        self.log_path = log
        with log.open("w") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)

    def log(self) -> str:
        return self.log_path.read_text()

    def wait_up(self) -> None:
        deadline = time.monotonic() + STARTUP
        while True:
            if self.proc.poll() is not None:
                pytest.fail(f"vLLM exited with {self.proc.returncode}:\n{self.log()[-6000:]}")
            try:
                if http(f"{self.base}/health")[0] == 200:
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"vLLM did not come up:\n{self.log()[-6000:]}")
            time.sleep(0.5)

    def complete(self, tokens: list[int]) -> dict[str, Any]:
        status, body = http(
            f"{self.base}/v1/completions",
            {"model": self.model, "prompt": tokens, "max_tokens": 8, "temperature": 0, "seed": 0,
             "return_token_ids": True},
        )  # fmt: skip
        assert status == 200, body
        return dict(json.loads(body))

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def cached(completion: dict[str, Any]) -> int:
    return int(completion["usage"]["prompt_tokens_details"]["cached_tokens"])


def status(endpoint: str) -> str:
    run = subprocess.run(
        [str(KVTRIO), "status", endpoint], capture_output=True, text=True, timeout=30
    )
    assert run.returncode == 0, run.stderr
    return run.stdout


@pytest.fixture
def kvtrio_as_the_guide_says(short_dir: Path) -> Iterator[tuple[str, Path]]:
    """§2: ``kvtrio serve … &``, then ``kvtrio ping`` (until it answers) and ``kvtrio status``."""
    (serve, ping, show), _ = guide_lines(short_dir)
    serve = serve.replace("--l1-size 8GiB", "--l1-size 128MiB")
    assert serve.endswith(" &")
    assert serve.startswith("kvtrio serve ")
    log_path = short_dir / "kvtrio.log"
    env = {**os.environ, "KVTRIO_L2": "none", "PYTHONUNBUFFERED": "1"}
    with log_path.open("w") as log:
        server = subprocess.Popen(
            [str(KVTRIO), *shlex.split(serve)[1:-1]], stdout=log, stderr=subprocess.STDOUT, env=env
        )
    try:
        endpoint = shlex.split(ping)[2]

        def answers() -> bool:
            argv = [str(KVTRIO), *shlex.split(ping)[1:]]
            return subprocess.run(argv, capture_output=True, timeout=30).returncode == 0

        wait_for(answers, what="kvtrio ping", timeout=60)
        assert shlex.split(show) == ["kvtrio", "status", endpoint]
        assert "size: 128MiB (configured) in " in status(endpoint)
        yield endpoint, log_path
    finally:
        server.terminate()
        server.wait(30)


def test_the_guide_gets_vllm_using_kvtrio(
    kvtrio_as_the_guide_says: tuple[str, Path], short_dir: Path
) -> None:
    endpoint, kvtrio_log = kvtrio_as_the_guide_says
    model = write_tiny_model(short_dir / "model", weights=True)
    _, words = guide_lines(short_dir)
    engines = []
    try:
        for name in ("engine-1", "engine-2"):  # started together: their start-ups overlap
            port = free_port()
            argv, env = vllm_command(list(words), model, port)
            engines.append(Engine(argv, env, port, short_dir / f"{name}.log"))
        first, second = engines
        first.wait_up()
        a = first.complete(PROMPT_A)
        assert cached(a) == 0
        wait_for(lambda: ready(endpoint) >= 2, what="kvtrio to hold A's 2 chunks", timeout=60)
        reference = first.complete(PROMPT_B)  # vLLM's own prefix cache: kvtrio is not asked
        second.wait_up()
        b = second.complete(PROMPT_B)
        print(f"\nengine 2, B: {cached(b)} tokens from kvtrio, {b['choices'][0]['token_ids']}")
        assert cached(b) == HIT
        assert b["choices"][0]["token_ids"] == reference["choices"][0]["token_ids"]
        metrics = http(f"{second.base}/metrics")[1].decode()
        assert prometheus(metrics, "vllm:external_prefix_cache_hits_total") == HIT
        assert prometheus(metrics, "vllm:external_prefix_cache_queries_total") == len(PROMPT_B)
        # §4: what the logs show.
        rate = re.compile(r"External prefix cache hit rate: (\d+\.\d)%")
        wait_for(lambda: rate.search(second.log()), what="vLLM's stats line", timeout=60)
        assert float(rate.findall(second.log())[-1]) > 0
        for engine in engines:
            assert (
                "Creating v1 connector with name: KvtrioConnector and engine_id: " in engine.log()
            )
    finally:
        for engine in engines:
            engine.stop()
    served = kvtrio_log.read_text()
    assert f"client kvtrio-scheduler/{model} " in served
    assert f"client kvtrio-worker/{model}/0 " in served
    hits = re.search(r"^lookups: .* \((\d+) chunks from L1, ", status(endpoint), re.MULTILINE)
    assert hits is not None
    assert int(hits[1]) >= 2


def ready(endpoint: str) -> int:
    """Chunks kvtrio holds, stored and committed."""
    with Client(endpoint, heartbeat=False, timeout=5.0) as client:
        cache = client.call(GetStats(), StatsReply).cache
    return 0 if cache is None else cache.l1_ready
