"""Where the time of a kvtrio L1 hit goes in a new vLLM CPU engine, next to vLLM's own best.

    .tox/vllm-cpu/bin/python bench/hit_profile.py [--length 2048] [--prompts 3]
        [--model-shape smollm2-135m] [--max-tokens 4] [--cache-dir DIR]

The setting of ``bench/ttft.py``'s ``l1`` case (same model, engine options, OpenMP cores and
server options): a ``kvtrio serve`` and a storing engine (``bench/_ttft_engine.py``) that runs
``--prompts`` random prompts, so that the server holds their chunks in L1; it exits, and a new
engine with kvtrio runs ``bench/ttft.py``'s two warm-up prompts and then every prompt once and
the first again (the **hits**). Then, as the floor that no connector can beat, **vLLM alone with
its own prefix cache on** runs each prompt twice: the second run computes only the tokens after
the last whole block, as a hit does, with no load at all.

The hit engine's processes load ``bench/_hit_trace/sitecustomize.py``, which times vLLM's and
kvtrio's parts of a step in each process (frontend, engine core, worker; one clock). Per hit
the bench prints the TTFT that ``bench/_ttft_engine.py`` measured and its parts, in ms:

* ``to the scheduler``: ``add_request`` to the engine core's first ``schedule`` of it;
* ``lookup``: the connector's ``get_num_new_matched_tokens`` (the server's answer);
* ``to the load``: the end of the lookup to the start of the worker's retrieve (vLLM's step
  hop: the load starts in the next ``execute_model``);
* ``retrieve``: kvtrio's retrieve in the worker's transfer thread (request, reply, and
  ``scatter``: the copies into vLLM's paged KV, shown on their own);
* ``to the forward``: the retrieve's end to the forward's start (vLLM polls ``get_finished``
  each step, then schedules the request);
* ``forward``: the model's forward of the tokens left (``_model_forward``);
* ``logits + sample``: the forward's end to the end of ``sample_tokens``;
* ``to the client``: from there to the first token reaching the frontend.

The header names the CPU. Timing only, nothing is judged: compare the hits with the floor of
the same run (``--prompts`` of each).
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _ttft_engine import engine_env
from _ttft_model import SHAPES, kv_bytes_per_token, write_model
from ttft import BLOCK, CHUNK, Engine, environment, ready_chunks, wait_stored

from kvtrio.launch import ServerProcess

TRACE = Path(__file__).resolve().parent / "_hit_trace"
PARTS = ("to the scheduler", "lookup", "to the load", "retrieve", "  scatter", "to the forward",
         "forward", "logits + sample", "to the client")  # fmt: skip


def events(folder: Path) -> list[tuple[float, float, str, str]]:
    """Every traced call: (start, seconds, label, request id or '-'), by start."""
    found = []
    for path in folder.glob("events-*.txt"):
        for line in path.read_text().splitlines():
            _, label, start, took, _, request = line.split()
            found.append((float(start), float(took), label, request))
    return sorted(found)


def breakdown(trace: list[tuple[float, float, str, str]], request: str) -> dict[str, float]:
    """The parts (ms) of one hit, from the calls traced between its ``add_request`` and its
    first ``sample_tokens`` after a forward."""
    (t0,) = [s for s, _, label, r in trace if label == "add_request" and r == request]
    first: dict[str, tuple[float, float]] = {}
    scatter = 0.0
    for start, took, label, _ in trace:
        if start < t0 or ("sample_tokens" in first and start > first["sample_tokens"][0]):
            continue
        if label == "scatter":
            scatter += took
        if label == "sample_tokens" and "forward" not in first:
            continue  # the steps that ran while the load was in flight
        first.setdefault(label, (start, start + took))
    at = {label: ((s - t0) * 1e3, (e - t0) * 1e3) for label, (s, e) in first.items()}
    none = (at["lookup"][1], at["lookup"][1])
    retrieve = at.get("retrieve", none)
    return {
        "to the scheduler": at["schedule"][0],
        "lookup": at["lookup"][1] - at["lookup"][0],
        "to the load": retrieve[0] - at["lookup"][1],
        "retrieve": retrieve[1] - retrieve[0],
        "  scatter": scatter * 1e3,
        "to the forward": at["forward"][0] - retrieve[1],
        "forward": at["forward"][1] - at["forward"][0],
        "logits + sample": at["sample_tokens"][1] - at["forward"][1],
        "end": at["sample_tokens"][1],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--model-shape", choices=sorted(SHAPES), default="smollm2-135m")
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument(
        "--cache-dir", type=Path,
        default=Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
        / "kvtrio" / "ttft-models",
    )  # fmt: skip
    args = parser.parse_args()
    config = SHAPES[args.model_shape]
    model = write_model(args.model_shape, args.cache_dir)
    max_model_len = -(-(args.length + args.max_tokens) // BLOCK) * BLOCK + BLOCK
    kv_space = max(1, -(-(2 * max_model_len * kv_bytes_per_token(config)) // 2**30))
    env = engine_env(VLLM_CPU_KVCACHE_SPACE=str(kv_space))  # as bench/ttft.py: engines alike
    cpu, cpus, omp = environment()["cpu_model"], os.cpu_count(), env["VLLM_CPU_OMP_THREADS_BIND"]
    print(f"hit profile: CPU {cpu} ({cpus} CPUs), python {platform.python_version()}, "
          f"{args.model_shape}, {args.length} tokens, OpenMP on CPUs {omp}, load average "
          f"{os.getloadavg()[0]:.2f} at start")  # fmt: skip
    rng = random.Random(0)
    prompts = [
        [rng.randrange(3, config["vocab_size"]) for _ in range(args.length)]
        for _ in range(args.prompts)
    ]
    with tempfile.TemporaryDirectory(prefix="kvtrio-hitprof-") as tmp:
        work = Path(tmp)
        url = f"ipc://{work}/kvtrio.sock"
        l1 = max(256 << 20, args.prompts * args.length * kv_bytes_per_token(config) * 2)
        server = ServerProcess(
            url, ["--chunk-size", str(CHUNK), "--l1-size", f"{l1 >> 20}MiB"], env,
            log_path=work / "kvtrio.log",
        )  # fmt: skip
        server.start(timeout=120)
        hits: list[tuple[str, dict[str, Any]]] = []
        try:
            storer = Engine("store", model, url, max_model_len, work, env)
            try:
                storer.wait_ready()
                for i, tokens in enumerate(prompts):
                    before = ready_chunks(url)
                    storer.run(f"store-{i}", tokens, 1)
                    wait_stored(url, before + args.length // CHUNK)
            finally:
                storer.close()
            path = os.pathsep.join([str(TRACE), env.get("PYTHONPATH", "")])
            traced = {**env, "KVTRIO_HIT_TRACE": str(work), "PYTHONPATH": path}
            hit = Engine("hit", model, url, max_model_len, work, traced)
            try:
                hit.wait_ready()
                for i in range(2):  # bench/ttft.py's warm-up
                    tokens = [rng.randrange(3, config["vocab_size"]) for _ in range(CHUNK // 2)]
                    hit.run(f"warmup-{i}", tokens, 4)
                for i, tokens in enumerate([*prompts, prompts[0]]):
                    time.sleep(1.5)  # idle, as bench/ttft.py's settle()
                    hits.append((f"hit-{i}", hit.run(f"hit-{i}", tokens, args.max_tokens)))
            finally:
                hit.close()
        finally:
            server.stop(timeout=60)
        trace = events(work)
        floor = []
        engine = Engine("vllm-pc", model, None, max_model_len, work, env, {"prefix_caching": True})
        try:
            engine.wait_ready()
            for i, tokens in enumerate(prompts):
                time.sleep(1.5)
                engine.run(f"pc-{i}-a", tokens, args.max_tokens)
                time.sleep(1.5)
                again = engine.run(f"pc-{i}-b", tokens, args.max_tokens)
                floor.append((again["ttft_s"] * 1e3, again["num_cached_tokens"]))
        finally:
            engine.close()
    report(hits, trace, floor)


def report(
    hits: list[tuple[str, dict[str, Any]]],
    trace: list[tuple[float, float, str, str]],
    floor: list[tuple[float, int]],
) -> None:
    columns: dict[str, list[float]] = defaultdict(list)
    print(f"\n{'part (ms)':18}" + "".join(f"{name:>9}" for name, _ in hits) + "   median")
    for name, result in hits:
        parts = breakdown(trace, name)
        parts["to the client"] = result["ttft_s"] * 1e3 - parts.pop("end")
        parts["TTFT"] = result["ttft_s"] * 1e3
        for label, value in parts.items():
            columns[label].append(value)
    for label in (*PARTS, "TTFT"):
        values = columns[label]
        print(f"{label:18}" + "".join(f"{v:9.1f}" for v in values)
              + f"{statistics.median(values):9.1f}")  # fmt: skip
    loaded = {result["num_cached_tokens"] for _, result in hits}
    print(f"tokens loaded per hit: {sorted(loaded)}")
    times = [t for t, _ in floor]
    print(f"floor, vLLM alone with its prefix cache (tokens cached {sorted({c for _, c in floor})}"
          f"): TTFT {', '.join(f'{t:.1f}' for t in times)} ms, median "
          f"{statistics.median(times):.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
