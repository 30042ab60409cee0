"""Where the time of one kvtrio L1 hit goes in a new vLLM CPU engine: a timeline per request.

    .tox/vllm-cpu/bin/python bench/hit_profile.py [--length 2048] [--prompts 3]
        [--model-shape smollm2-135m] [--cache-dir DIR]

The setting of ``bench/ttft.py``'s ``l1`` case (same model, engine options, OpenMP cores and
server options): a ``kvtrio serve`` and a storing engine (``bench/_ttft_engine.py``, a child)
that runs ``--prompts`` random prompts so that the server holds their chunks in L1; then the
storing engine exits and a new engine with kvtrio runs **in this process**
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the engine core is stepped here, so that its parts can be
timed), runs the two short warm-up prompts of ``bench/ttft.py``, and then every prompt once (the
first is the new engine's first hit), then the first one again.

Per hit it prints the TTFT (``add_request`` to the first output token, as ``bench/ttft.py``
measures it, less the multiprocess engine's hop) and the timeline of its steps: each wrapped
function's start and duration in ms from ``add_request`` (the scheduler's ``schedule`` and the
connector's lookup in it, the worker's load (``start_load_kv``) and in it kvtrio's retrieve and
scatter copies, the model runner's input preparation, forward and sampling, the scheduler's
output processing), and the sum per part. The header names the CPU. Timing only: nothing is
judged.
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
import random
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _ttft_model import SHAPES, kv_bytes_per_token, write_model
from ttft import BLOCK, CHUNK, Engine, environment, ready_chunks, wait_stored

from kvtrio.launch import ServerProcess

EVENTS: list[tuple[str, float, float, str]] = []  # (label, start, duration, thread)
_ORIGIN = [0.0]


def wrap(owner: Any, name: str, label: str) -> None:
    """Record every call of ``owner.name`` in :data:`EVENTS`."""
    inner = getattr(owner, name)

    @functools.wraps(inner)
    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            end = time.perf_counter()
            EVENTS.append((label, start, end - start, threading.current_thread().name))

    setattr(owner, name, timed)


def instrument() -> None:
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    import kvtrio.client._arena_worker as arena_worker
    import kvtrio.client._sync as sync
    import kvtrio.integration.vllm as connector
    from kvtrio.transfer import CpuTransfer

    wrap(EngineCore, "step", "step")
    wrap(Scheduler, "schedule", "schedule")
    wrap(Scheduler, "update_from_output", "update_from_output")
    wrap(GPUModelRunner, "execute_model", "execute_model")
    wrap(GPUModelRunner, "_update_states", "  update_states")
    wrap(GPUModelRunner, "_prepare_inputs", "  prepare_inputs")
    wrap(GPUModelRunner, "_model_forward", "  forward")
    wrap(GPUModelRunner, "sample_tokens", "sample_tokens")
    wrap(connector.KvtrioConnector, "get_num_new_matched_tokens", "  lookup (matched_tokens)")
    wrap(connector.KvtrioConnector, "update_state_after_alloc", "  update_state_after_alloc")
    wrap(connector.KvtrioConnector, "build_connector_meta", "  build_connector_meta")
    wrap(connector.KvtrioConnector, "start_load_kv", "  start_load_kv")
    wrap(connector.KvtrioConnector, "wait_for_save", "  wait_for_save")
    wrap(connector.KvtrioConnector, "get_finished", "  get_finished")
    wrap(arena_worker.ArenaCopies, "retrieve", "    retrieve (transfer thread)")
    wrap(arena_worker.ArenaCopies, "store", "    store (transfer thread)")
    wrap(sync.Client, "submit", "      client.submit")
    wrap(CpuTransfer, "scatter", "      scatter")
    wrap(CpuTransfer, "gather", "      gather")


def run(llm: Any, rid: str, tokens: list[int], max_tokens: int) -> tuple[float, int]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, seed=0)
    engine = llm.llm_engine
    EVENTS.clear()
    start = time.perf_counter()
    _ORIGIN[0] = start
    engine.add_request(rid, TokensPrompt(prompt_token_ids=tokens), params)
    ttft = None
    cached = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            if ttft is None and output.outputs and output.outputs[0].token_ids:
                ttft = time.perf_counter() - start
            if output.finished:
                cached = int(output.num_cached_tokens or 0)
        if ttft is not None:
            break
    while engine.has_unfinished_requests():
        engine.step()
    assert ttft is not None
    return ttft, cached


def report(name: str, ttft: float, cached: int) -> None:
    start = _ORIGIN[0]
    print(f"\n{name}: TTFT {ttft * 1e3:.1f} ms, {cached} tokens loaded")
    totals: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    for label, t0, dur, thread in sorted(EVENTS, key=lambda e: e[1]):
        at = (t0 - start) * 1e3
        if at > ttft * 1e3 + 1:
            continue
        totals[label] += dur * 1e3
        counts[label] += 1
        if dur * 1e3 >= 0.3 or label.strip() in ("retrieve (transfer thread)", "scatter"):
            print(f"  {at:8.2f} +{dur * 1e3:8.2f}  {label}  [{thread}]")
    print("  sums until the first token (ms, calls):")
    for label, total in sorted(totals.items(), key=lambda kv: -kv[1]):
        print(f"    {total:8.2f}  {counts[label]:4d}  {label.strip()}")


def baseline(
    args: argparse.Namespace, model: Path, max_model_len: int, work: Path, prompts: list[list[int]]
) -> None:
    """vLLM alone with its own prefix cache on: each prompt twice; the second run computes only
    what the cache lacks (the tokens after the last whole block): the floor of any hit."""
    engine = Engine(
        "vllm-pc", model, None, max_model_len, work, dict(os.environ), {"prefix_caching": True}
    )
    engine.wait_ready()
    try:
        for i, tokens in enumerate(prompts):
            time.sleep(1.5)
            first = engine.run(f"pc-{i}-a", tokens, args.max_tokens)
            time.sleep(1.5)
            again = engine.run(f"pc-{i}-b", tokens, args.max_tokens)
            print(f"vLLM alone, prefix cache: prompt {i}: TTFT {first['ttft_s'] * 1e3:.1f} ms "
                  f"computed, {again['ttft_s'] * 1e3:.1f} ms again "
                  f"({again['num_cached_tokens']} tokens cached)")  # fmt: skip
    finally:
        engine.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--model-shape", choices=sorted(SHAPES), default="smollm2-135m")
    parser.add_argument(
        "--cache-dir", type=Path,
        default=Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
        / "kvtrio" / "ttft-models",
    )  # fmt: skip
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument(
        "--mp", action="store_true", help="the measured engine as bench/ttft.py runs it: TTFT only"
    )
    parser.add_argument("--sync-load", action="store_true", help="kvtrio.async_load=false")
    parser.add_argument(
        "--pin-transfer", help="CPUs to move kvtrio's threads to (e.g. 1), after start-up"
    )
    args = parser.parse_args()
    config = SHAPES[args.model_shape]
    model = write_model(args.model_shape, args.cache_dir)
    max_model_len = -(-(args.length + 16) // BLOCK) * BLOCK + BLOCK
    kv_space = max(1, -(-(2 * max_model_len * kv_bytes_per_token(config)) // 2**30))
    cpus = os.cpu_count() or 1
    omp = "0" if cpus <= 2 else f"0-{cpus - 2}"
    env_vars = {
        "PYTHONUNBUFFERED": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_HOST_IP": "127.0.0.1",
        "VLLM_LOOPBACK_IP": "127.0.0.1",
        "VLLM_CPU_KVCACHE_SPACE": str(kv_space),
        "VLLM_CPU_OMP_THREADS_BIND": omp,
    }
    os.environ.update(env_vars)
    cpu = environment()["cpu_model"]
    print(f"hit profile: CPU {cpu} ({cpus} CPUs), python {platform.python_version()}, "
          f"{args.model_shape}, {args.length} tokens, OpenMP on CPUs {omp}")  # fmt: skip
    rng = random.Random(0)
    prompts = [
        [rng.randrange(3, config["vocab_size"]) for _ in range(args.length)]
        for _ in range(args.prompts)
    ]
    with tempfile.TemporaryDirectory(prefix="kvtrio-hitprof-") as tmp:
        work = Path(tmp)
        url = f"ipc://{work}/kvtrio.sock"
        l1 = max(256 << 20, (args.prompts * args.length * kv_bytes_per_token(config)) * 2)
        server = ServerProcess(
            url, ["--chunk-size", str(CHUNK), "--l1-size", f"{l1 >> 20}MiB"], dict(os.environ),
            log_path=work / "kvtrio.log",
        )  # fmt: skip
        server.start(timeout=120)
        try:
            storer = Engine("store", model, url, max_model_len, work, dict(os.environ))
            storer.wait_ready()
            for i, tokens in enumerate(prompts):
                before = ready_chunks(url)
                storer.run(f"store-{i}", tokens, 1)
                wait_stored(url, before + args.length // CHUNK)
            storer.close()
            if args.mp:
                hit = Engine("hit", model, url, max_model_len, work, dict(os.environ))
                hit.wait_ready()
                for i in range(2):  # bench/ttft.py's warm-up
                    tokens = [rng.randrange(3, config["vocab_size"]) for _ in range(CHUNK // 2)]
                    hit.run(f"warmup-{i}", tokens, 4)
                for i, tokens in enumerate([*prompts, prompts[0]]):
                    time.sleep(1.5)
                    result = hit.run(f"hit-{i}", tokens, args.max_tokens)
                    print(f"hit {i} (prompt {i % args.prompts}): TTFT {result['ttft_s'] * 1e3:.1f} "
                          f"ms, {result['num_cached_tokens']} tokens loaded")  # fmt: skip
                hit.close()
                baseline(args, model, max_model_len, work, prompts)
                return
            print(f"stored {args.prompts} prompts; starting the measured engine in-process")
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
            from vllm import LLM

            instrument()
            llm = LLM(
                model=str(model), skip_tokenizer_init=True, block_size=BLOCK, enforce_eager=True,
                enable_prefix_caching=False, seed=0, max_model_len=max_model_len,
                dtype="float32",
                kv_transfer_config={
                    "kv_connector": "KvtrioConnector",
                    "kv_connector_module_path": "kvtrio.integration.vllm",
                    "kv_role": "kv_both",
                    "kv_connector_extra_config": {
                        "kvtrio.url": url,
                        **({"kvtrio.async_load": False} if args.sync_load else {}),
                    },
                },
            )  # fmt: skip
            for i in range(2):  # bench/ttft.py's warm-up
                tokens = [rng.randrange(3, config["vocab_size"]) for _ in range(CHUNK // 2)]
                run(llm, f"warmup-{i}", tokens, 4)
            time.sleep(1.5)  # the idle engine as bench/ttft.py leaves it before a run
            for thread in threading.enumerate():
                if thread.name.startswith("kvtrio") and args.pin_transfer and thread.native_id:
                    cpus = {int(c) for c in args.pin_transfer.split(",")}
                    os.sched_setaffinity(thread.native_id, cpus)
                tid = thread.native_id or 0
                print(f"thread {thread.name}: CPUs {sorted(os.sched_getaffinity(tid))}")
            for i, tokens in enumerate([*prompts, prompts[0]]):
                ttft, cached = run(llm, f"hit-{i}", tokens, args.max_tokens)
                report(f"hit {i} (prompt {i % args.prompts})", ttft, cached)
                time.sleep(1.5)
            del llm
        finally:
            server.stop(timeout=60)


if __name__ == "__main__":
    main()
