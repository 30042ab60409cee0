"""Lookup message size and server CPU per lookup: this tree against a baseline tree.

    python bench/lookup.py --baseline-src DIR [--tokens 4096,32768] [--lookups 200]
                           [--repeats 5]

Protocol 1 (e.g. ``git worktree add DIR 420fcce``) sends a lookup's token ids and the server
hashes them into chunk keys; protocol 2 sends the 16-byte chunk hashes, computed by the client.
For each tree, in the same rounds: ``kvtrio serve`` from that tree with one registered worker,
and a client of the same tree sending ``--lookups`` lookups of a new request each (the server
has never seen their prompt, as for a request's first lookup) one at a time, of a prompt of
random token ids below 150 000 (a realistic vocabulary). Reported, medians over the rounds:
bytes of the lookup body, server CPU (user + system of its process) per lookup, round-trip
time per lookup, and for protocol 2 the client's hashing time per lookup.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
from pathlib import Path

from kvtrio.launch import launch_server

HERE = Path(__file__).resolve().parent.parent

CLIENT = r"""
import json, os, random, sys, time
import attrs
from kvtrio.client import Client
from kvtrio.protocol import (
    HASH_SCHEME_TOKENS, LayoutSpec, Lookup, LookupReply, Register, encode_request,
)

endpoint, sizes = sys.argv[1], json.loads(sys.argv[2])
lookups, pid = int(sys.argv[3]), int(sys.argv[4])
v2 = "chunk_hashes" in attrs.fields_dict(Lookup)
if v2:
    from kvtrio.storage import token_chunk_hashes

def cpu():
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

layout = LayoutSpec("flash_attn", 4, 64, 16, 2, 32, "float16")
out = {}
with Client(endpoint, timeout=30) as client:
    client.request(Register("", "m", 1, 0, layout, HASH_SCHEME_TOKENS))
    rng = random.Random(1)
    for size in sizes:
        prompts = [[rng.randrange(150_000) for _ in range(size)] for _ in range(8)]
        hashing = 0.0
        nbytes = 0
        client.call(Lookup("warm", "m", 1), LookupReply)
        cpu0, t0 = cpu(), time.perf_counter()
        for i in range(lookups):
            tokens = prompts[i % len(prompts)]
            if v2:
                h0 = time.perf_counter()
                request = Lookup(f"r{i}", "m", 1, tuple(token_chunk_hashes(tokens, 256)))
                hashing += time.perf_counter() - h0
            else:
                request = Lookup(f"r{i}", "m", 1, tokens=tuple(tokens))
            nbytes = len(encode_request(i, request)[1])
            client.call(request, LookupReply)
        elapsed = time.perf_counter() - t0
        time.sleep(0.2)  # let the server's ends of the requests settle into its CPU time
        out[size] = {
            "bytes": nbytes,
            "server_cpu_us": (cpu() - cpu0) / lookups * 1e6,
            "round_trip_us": (elapsed - hashing) / lookups * 1e6,
            "client_hash_us": hashing / lookups * 1e6,
        }
print(json.dumps(out))
"""


def run_tree(src: Path, sizes: list[int], lookups: int) -> dict[str, dict[str, float]]:
    env = {**os.environ, "PYTHONPATH": str(src)}
    with launch_server("--l1-size", "64MiB", "--log-level", "warning", env=env) as server:
        result = subprocess.run(
            [sys.executable, "-c", CLIENT, server.endpoint, json.dumps(sizes), str(lookups),
             str(server.pid)],
            env=env, cwd=src, check=True, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
    return dict(json.loads(result.stdout))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline-src", type=Path, required=True)
    parser.add_argument("--tokens", default="4096,32768")
    parser.add_argument("--lookups", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    sizes = [int(s) for s in args.tokens.split(",")]
    trees = {"baseline": args.baseline_src.resolve(), "this tree": HERE}
    rounds: dict[str, list[dict[str, dict[str, float]]]] = {name: [] for name in trees}
    for _ in range(args.repeats):
        order = list(trees.items())
        random.shuffle(order)
        for name, src in order:
            rounds[name].append(run_tree(src, sizes, args.lookups))
    print(f"{args.lookups} lookups per size, {args.repeats} rounds, medians")
    print(f"{'tokens':>7} {'tree':>10} {'bytes':>9} {'server µs':>10} {'rtt µs':>9} {'hash µs':>8}")
    for size in sizes:
        rows = {}
        for name in trees:
            metrics = [r[str(size)] for r in rounds[name]]
            rows[name] = {k: statistics.median(m[k] for m in metrics) for k in metrics[0]}
            row = rows[name]
            print(
                f"{size:>7} {name:>10} {row['bytes']:>9.0f} {row['server_cpu_us']:>10.1f} "
                f"{row['round_trip_us']:>9.1f} {row['client_hash_us']:>8.1f}"
            )
        base, new = rows["baseline"], rows["this tree"]
        print(
            f"{size:>7} {'ratio':>10} {base['bytes'] / new['bytes']:>8.1f}x "
            f"{base['server_cpu_us'] / max(new['server_cpu_us'], 1e-9):>9.1f}x "
            f"{base['round_trip_us'] / new['round_trip_us']:>8.1f}x"
        )


if __name__ == "__main__":
    main()
