"""The vLLM connector's scheduler-side CPU per lookup: token mode against hash mode, same run.

    python bench/scheduler_keys.py [--tokens 4096,32768] [--lookups 200] [--rounds 5]

One ``kvtrio serve`` with a worker registered for each mode (model ``m-tokens`` in token mode,
``m-blocks`` in hash mode), and the connector's scheduler side (``SchedulerSide``, the code
vLLM's scheduler calls) on a ``SchedulerAdapter``. Each lookup is a new request's first
(``get_num_new_matched_tokens`` until it has an answer, then ``request_finished``), of a prompt
of random token ids below 150 000 with block size 16 and chunk size 256; in hash mode the
request carries its 32-byte block hashes, as vLLM's requests do (vLLM computes them when the
request arrives, for its own prefix cache, whether kvtrio runs or not: not timed here).
Reported, medians over the rounds (the modes alternate, in random order, within each round):
CPU time of the scheduler's thread per lookup (``time.thread_time``; the client's I/O thread
is not in it), of which naming the chunks (``prompt_chunks``) alone, and wall time per lookup.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from typing import Any

from kvtrio.client import Client, SchedulerAdapter
from kvtrio.integration._engine_keys import KeyScheme
from kvtrio.integration._options import ConnectorOptions
from kvtrio.integration._scheduler_side import SchedulerSide
from kvtrio.launch import launch_server
from kvtrio.protocol import (
    HASH_SCHEME_TOKENS,
    LayoutSpec,
    Register,
    block_hash_scheme,
    prompt_chunks,
)

BLOCK = 16
CHUNK = 256
SCHEMES = {
    "tokens": KeyScheme(),
    "hashes": KeyScheme(block_hash_scheme("sha256"), "00" * 16, b"\0" * 32),
}


class Request:
    """What the scheduler side reads of a vLLM request."""

    def __init__(self, request_id: str, tokens: list[int], block_hashes: list[bytes]) -> None:
        self.request_id = request_id
        self.all_token_ids = tokens
        self.num_prompt_tokens = len(tokens)
        self.num_computed_tokens = 0
        self.block_hashes = block_hashes
        self.kv_transfer_params = None
        self.cache_salt = None
        self.lora_request = None
        self.mm_features: list[Any] = []
        self.prompt_embeds = None


def measure(side: SchedulerSide, prompts: list[Request], lookups: int) -> dict[str, float]:
    """Per lookup: the scheduler thread's CPU and wall time, and the CPU of naming chunks."""
    cpu = wall = naming = 0.0
    engine_hashes = side.keys.engine_hashes
    for i in range(lookups):
        prompt = prompts[i % len(prompts)]
        request = Request(f"r{i}-{time.monotonic_ns()}", prompt.all_token_ids, prompt.block_hashes)
        c0, w0 = time.thread_time(), time.perf_counter()
        while side.matched_tokens(request, 0, preempted=False)[0] is None:
            side.build_step({}, (), 0, None)  # the step ends: the next one asks again
        side.finished(request.request_id)
        cpu += time.thread_time() - c0
        wall += time.perf_counter() - w0
        n0 = time.thread_time()
        if engine_hashes:
            prompt_chunks(CHUNK, BLOCK, block_hashes=side.keys.block_hashes(request))
        else:
            prompt_chunks(CHUNK, BLOCK, token_ids=request.all_token_ids)
        naming += time.thread_time() - n0
    return {
        "cpu_us": cpu / lookups * 1e6,
        "naming_us": naming / lookups * 1e6,
        "wall_us": wall / lookups * 1e6,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", default="4096,32768")
    parser.add_argument("--lookups", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    sizes = [int(s) for s in args.tokens.split(",")]
    rng = random.Random(1)
    prompts = {
        size: [
            Request("", [rng.randrange(150_000) for _ in range(size)],
                    [os.urandom(32) for _ in range(size // BLOCK)])
            for _ in range(8)
        ]
        for size in sizes
    }  # fmt: skip
    layout = LayoutSpec("flash_attn", 4, 64, BLOCK, 2, 32, "float16")
    env = {**os.environ, "KVTRIO_L2": "none"}
    results: dict[tuple[int, str], list[dict[str, float]]] = {}
    with launch_server("--l1-size", "64MiB", "--log-level", "warning", env=env) as server:
        sides = {}
        for mode, keys in SCHEMES.items():
            scheme = keys.hash_scheme if keys.engine_hashes else HASH_SCHEME_TOKENS
            worker_client = Client(server.endpoint)
            worker_client.request(Register(mode, f"m-{mode}", 1, 0, layout, scheme))
            adapter = SchedulerAdapter(server.endpoint, f"m-{mode}", 1, 0, BLOCK, engine_id=mode)
            options = ConnectorOptions(url=server.endpoint, lookup_wait=1.0)
            sides[mode] = (SchedulerSide(options, BLOCK, adapter, keys), worker_client)
        for _ in range(args.rounds):
            for size in sizes:
                order = list(sides)
                random.shuffle(order)
                for mode in order:
                    side = sides[mode][0]
                    measured = measure(side, prompts[size], args.lookups)
                    results.setdefault((size, mode), []).append(measured)
        for side, worker_client in sides.values():
            side.close()
            worker_client.close()
    print(f"{args.lookups} lookups per size and mode, {args.rounds} rounds, medians")
    print(f"{'tokens':>7} {'mode':>7} {'sched CPU µs':>13} {'naming µs':>10} {'wall µs':>9}")
    for size in sizes:
        rows = {}
        for mode in SCHEMES:
            runs = results[(size, mode)]
            rows[mode] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            row = rows[mode]
            print(
                f"{size:>7} {mode:>7} {row['cpu_us']:>13.1f} {row['naming_us']:>10.1f} "
                f"{row['wall_us']:>9.1f}"
            )
        tokens, hashes = rows["tokens"], rows["hashes"]
        print(
            f"{size:>7} {'ratio':>7} {tokens['cpu_us'] / hashes['cpu_us']:>12.2f}x "
            f"{tokens['naming_us'] / hashes['naming_us']:>9.2f}x "
            f"{tokens['wall_us'] / hashes['wall_us']:>8.2f}x"
        )


if __name__ == "__main__":
    main()
