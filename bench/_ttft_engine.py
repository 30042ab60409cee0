"""One vLLM CPU engine, driven by ``bench/ttft.py`` over a pipe: a long-lived child process.

    python bench/_ttft_engine.py CONFIG_JSON

``CONFIG_JSON``: ``{"model": DIR, "kvtrio": URL or null, "max_model_len": int}`` (and
optionally ``"prefix_caching": true``). Its stdout
is the protocol channel (vLLM's own output goes to stderr); one JSON object a line each way.
Once the engine is up it writes ``{"ready": INFO}`` (start-up seconds, attention kernels, PID);
then, for each command read on stdin:

* ``{"op": "run", "id": str, "tokens": [int], "max_tokens": int}`` → ``{"id": str, "ttft_s":
  float, "total_s": float, "token_times_s": [float], "token_ids": [int], "num_cached_tokens":
  int, "margins": [float]}``: the request is added to the engine (``LLMEngine.add_request``)
  and the engine stepped until the request finishes; ``token_times_s``: when each output token
  arrived, in seconds from just before ``add_request`` (``ttft_s`` is the first, ``total_s``
  the last). ``margins``: per output token, its logprob minus the runner-up's (how far greedy
  decoding was from a tie there);
* ``{"op": "report"}`` → ``{"report": INFO}`` with ``"requests"``, the requests run so far;
* ``{"op": "exit"}`` → ``{"bye": true}``, then the engine is shut down and the process exits.

Any failure is answered with ``{"error": str}`` (and the process exits on a broken pipe).
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from typing import Any, TextIO

ENV = {
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    # vLLM's processes talk to each other over the address get_ip() finds (the machine's own,
    # not loopback) unless told: keep every connection on 127.0.0.1.
    "VLLM_HOST_IP": "127.0.0.1",
    "VLLM_LOOPBACK_IP": "127.0.0.1",
}
"""Set (where not set already) for every engine: vLLM stays offline and on loopback."""


def engine_env(**settings: str) -> dict[str, str]:
    """The environment of every engine a bench compares: this process's, :data:`ENV`, OpenMP
    on all CPUs but the last (``VLLM_CPU_OMP_THREADS_BIND``: vLLM picks that for an engine
    without connector and one core fewer for one with, so left alone the engines would differ),
    ``PYTHONUNBUFFERED``, and ``settings``."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    last = (cpus or 1) - 1
    return {
        **os.environ,
        **ENV,
        "PYTHONUNBUFFERED": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "0" if last <= 1 else f"0-{last - 1}",
        **settings,
    }


def _send(channel: TextIO, message: dict[str, Any]) -> None:
    channel.write(json.dumps(message) + "\n")
    channel.flush()


def _attention_kernel(llm: Any) -> str:
    """vLLM CPU's attention kernels for this engine's dtype, block and head size (``vec``,
    ``amx``, …), as the kvtrio connector finds them; ``?`` where vLLM does not say."""
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        config = llm.llm_engine.vllm_config
        return str(
            _get_attn_isa(
                config.model_config.dtype,
                config.cache_config.block_size,
                config.model_config.get_head_size(),
                config.cache_config.cache_dtype,
            )
        )
    except Exception:  # only a label for the report
        return "?"


def _run(llm: Any, command: dict[str, Any]) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(
        temperature=0, max_tokens=command["max_tokens"], ignore_eos=True, seed=0, logprobs=2
    )
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests(), "one request at a time"
    start = time.perf_counter()
    engine.add_request(command["id"], TokensPrompt(prompt_token_ids=command["tokens"]), params)
    token_times: list[float] = []  # seconds from the start to each output token's arrival
    final = None
    # The only request in flight: every output is its (vLLM may suffix the request id).
    while engine.has_unfinished_requests():
        for output in engine.step():
            now = time.perf_counter() - start
            produced = len(output.outputs[0].token_ids) if output.outputs else 0
            token_times += [now] * (produced - len(token_times))
            if output.finished:
                final = output
    if final is None or not token_times:
        raise RuntimeError(f"request {command['id']} ended without a final output")
    completion = final.outputs[0]
    margins = []
    for token, logprobs in zip(completion.token_ids, completion.logprobs or [], strict=False):
        chosen = logprobs[token].logprob
        others = [lp.logprob for t, lp in logprobs.items() if t != token]
        margins.append(chosen - max(others) if others else float("inf"))
    return {
        "id": command["id"],
        "ttft_s": token_times[0],
        "total_s": token_times[-1],
        "token_times_s": token_times,
        "token_ids": list(completion.token_ids),
        "num_cached_tokens": int(final.num_cached_tokens or 0),
        "margins": margins,
    }


def main() -> None:
    config = json.loads(sys.argv[1])
    # The protocol keeps the real stdout; everything else printed to fd 1 (vLLM's logs, its
    # engine core process, which inherits the fd) goes to stderr.
    channel = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    started = time.perf_counter()
    options: dict[str, Any] = {}
    if config.get("in_process"):  # engine core and worker in this process (bench --in-process)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        options["distributed_executor_backend"] = "uni"
    from vllm import LLM

    if config["kvtrio"]:
        options["kv_transfer_config"] = {
            "kv_connector": "KvtrioConnector",
            "kv_connector_module_path": "kvtrio.integration.vllm",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"kvtrio.url": config["kvtrio"]},
        }
    llm = LLM(
        model=config["model"],
        skip_tokenizer_init=True,
        block_size=32,
        enforce_eager=True,
        # off, so that every cached token is kvtrio's (bench/hit_profile.py turns it on for
        # its baseline: vLLM's own prefix cache, no connector)
        enable_prefix_caching=bool(config.get("prefix_caching", False)),
        seed=0,
        max_model_len=config["max_model_len"],
        dtype="float32",
        **options,
    )
    info: dict[str, Any] = {
        "startup_s": time.perf_counter() - started,
        "attention_kernel": _attention_kernel(llm),
        "pid": os.getpid(),
        "requests": 0,
    }
    _send(channel, {"ready": info})
    for line in sys.stdin:
        command = json.loads(line)
        try:
            if command["op"] == "exit":
                _send(channel, {"bye": True})
                break
            if command["op"] == "report":
                _send(channel, {"report": info})
                continue
            info["requests"] += 1
            _send(channel, _run(llm, command))
        except Exception:
            _send(channel, {"error": traceback.format_exc()})
    del llm


if __name__ == "__main__":  # vLLM starts its engine core with spawn: guard the import side
    os.environ.update({k: v for k, v in ENV.items() if k not in os.environ})
    main()
