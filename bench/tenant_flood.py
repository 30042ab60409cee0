"""One tenant floods held lookups; another tenant's pings and lookups (issue 32, item 6).

    python bench/tenant_flood.py [--tree main=/path/to/main] [--tree branch=.] [--lookups 16384]

For each ``--tree`` (a source tree, put first on ``PYTHONPATH`` of every process of its run;
default: this tree), starts ``kvtrio serve --l1-tenants 2`` (ipc, no L2) and two clients of
their own processes, both registered as rank 0 of model ``m`` with one stored chunk:

* the **victim** (tenant ``a``) sends, 2 ms apart for the whole run, a ping and a one-chunk
  lookup of a fresh request (ended at once with ``end_session``, as an engine does);
* the **flooder** (tenant ``b``) sends ``--lookups`` one-chunk lookups of distinct requests
  and never ends them (each holds a pin), holds them ``--hold`` seconds, then vanishes
  without a goodbye (``os._exit``); the victim goes on for ``--after`` seconds more.

Prints per tree the victim's worst and median ping and lookup (ms), how many of its lookups
were refused (and the first refusal), and how many of the flood's lookups were admitted.
The issue's figures on its main: the victim refused ``busy … (max_requests)`` until 11 s
after the flooder's socket vanished.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

KVTRIO = str(Path(sys.executable).with_name("kvtrio"))

COMMON = r"""
import json, os, sys, time
from kvtrio.client import Client
from kvtrio.protocol import (Commit, EndSession, LayoutSpec, Lookup, LookupReply, Ping,
                             Register, Store, StoreReply)
LAYOUT = LayoutSpec("flash_attn", 2, 64, 16, 1, 16, "float16")
CHUNK = 256
HASH = bytes(range(16))

def setup(client, tenant):
    client.request(Register("w", "m", 1, 0, LAYOUT, HASH_SCHEME_TOKENS, tenant=tenant))
    client.call(Store("s", 0, CHUNK, chunk_hashes=(HASH,)), StoreReply)
    client.request(Commit("s", written=(HASH,)))

def lookup(request, tenant):
    return Lookup(request, "m", 1, chunk_hashes=(HASH,), tenant=tenant, engine="w")
"""

VICTIM = (
    COMMON
    + r"""
endpoint, stop = sys.argv[1], sys.argv[2]
pings, lookups, refused = [], [], []
with Client(endpoint, timeout=60, client_name="victim") as client:
    setup(client, "a")
    print("ready", flush=True)
    n = 0
    while not os.path.exists(stop):
        start = time.monotonic()
        client.request(Ping())
        middle = time.monotonic()
        try:
            reply = client.call(lookup(f"v{n}", "a"), LookupReply)
            assert reply.hit_chunks == 1, reply
            client.request(EndSession(f"v{n}", "m", tenant="a", engine="w"))
        except Exception as exc:
            refused.append([middle, repr(exc)[:160]])
        end = time.monotonic()
        pings.append([start, middle - start])
        lookups.append([middle, end - middle])
        n += 1
        time.sleep(0.002)
print(json.dumps({"pings": pings, "lookups": lookups, "refused": refused}))
"""
)

FLOODER = (
    COMMON
    + r"""
endpoint, count, hold = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
client = Client(endpoint, timeout=60, client_name="flooder")
setup(client, "b")
admitted = refused = 0
began = time.monotonic()
for n in range(count):
    try:
        client.call(lookup(f"f{n}", "b"), LookupReply)
        admitted += 1
    except Exception:
        refused += 1
flooded = time.monotonic()
print(json.dumps({"admitted": admitted, "refused": refused, "began": began,
                  "flooded": flooded, "gone": flooded + hold}), flush=True)
time.sleep(hold)
os._exit(0)  # the socket vanishes: no goodbye, no end_session
"""
)


def run_tree(tree: str, args: argparse.Namespace) -> dict[str, Any]:
    """The scenario with ``tree`` first on every process's ``PYTHONPATH``."""
    env = {**os.environ, "PYTHONPATH": os.path.abspath(tree), "PYTHONUNBUFFERED": "1"}
    workdir = Path(tempfile.mkdtemp(prefix="kvt-flood-", dir="/tmp"))
    endpoint = f"ipc://{workdir}/s.sock"
    stop = workdir / "stop"
    serve = [KVTRIO, "serve", "--endpoint", endpoint, "--l1-tenants", "2", "--l1-size",
             "256MiB", "--l2", "none", "--log-level", "warning"]  # fmt: skip
    server = subprocess.Popen(serve, env=env)
    try:
        victim = subprocess.Popen(
            [sys.executable, "-c", VICTIM, endpoint, str(stop)],
            stdout=subprocess.PIPE, text=True, env=env,
        )  # fmt: skip
        assert victim.stdout is not None
        assert victim.stdout.readline().strip() == "ready"
        time.sleep(0.5)  # the victim's baseline
        flood = subprocess.run(
            [sys.executable, "-c", FLOODER, endpoint, str(args.lookups), str(args.hold)],
            capture_output=True, text=True, env=env, timeout=600, check=True,
        )  # fmt: skip
        flooder = json.loads(flood.stdout.strip().splitlines()[-1])
        time.sleep(args.after)
        stop.touch()
        out, _ = victim.communicate(timeout=120)
    finally:
        server.terminate()
        server.wait(timeout=60)
    report = json.loads(out.strip().splitlines()[-1])
    pings = [rtt for _, rtt in report["pings"]]
    lookups = [rtt for _, rtt in report["lookups"]]
    refused = report["refused"]
    last_refusal = max((t for t, _ in refused), default=None)
    return {
        "tree": tree,
        "flood_admitted": flooder["admitted"],
        "flood_refused": flooder["refused"],
        "flood_s": flooder["flooded"] - flooder["began"],
        "ping_worst_ms": max(pings) * 1e3,
        "ping_median_ms": statistics.median(pings) * 1e3,
        "lookup_worst_ms": max(lookups) * 1e3,
        "lookup_median_ms": statistics.median(lookups) * 1e3,
        "victim_lookups": len(lookups),
        "victim_refused": len(refused),
        "refused_until_s_after_vanish": (
            None if last_refusal is None else last_refusal - flooder["gone"]
        ),
        "first_refusal": refused[0][1] if refused else "",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tree", action="append", default=[], metavar="NAME=DIR")
    parser.add_argument("--lookups", type=int, default=16384)
    parser.add_argument("--hold", type=float, default=2.0)
    parser.add_argument("--after", type=float, default=3.0)
    parser.add_argument("--out", type=Path, help="also write the figures here (JSON)")
    args = parser.parse_args()
    trees = [t.split("=", 1) if "=" in t else (t, t) for t in args.tree] or [("this", ".")]
    results = {name: run_tree(tree, args) for name, tree in trees}
    print(f"{args.lookups} held one-chunk lookups of tenant b; victim tenant a every 2 ms")
    print(f"{'tree':<8} {'flood ok':>8} {'ping worst':>10} {'median':>7} {'lookup worst':>12} "
          f"{'median':>7} {'refused':>12}  first refusal")  # fmt: skip
    for name, row in results.items():
        refused = f"{row['victim_refused']}/{row['victim_lookups']}"
        print(
            f"{name:<8} {row['flood_admitted']:>8} {row['ping_worst_ms']:>10.1f} "
            f"{row['ping_median_ms']:>7.2f} {row['lookup_worst_ms']:>12.1f} "
            f"{row['lookup_median_ms']:>7.2f} {refused:>12}  {row['first_refusal'][:90]}"
        )
        if row["refused_until_s_after_vanish"] is not None:
            print(f"{'':<8} refused until {row['refused_until_s_after_vanish']:+.1f} s after "
                  "the flooder vanished")  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
