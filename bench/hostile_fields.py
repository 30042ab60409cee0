"""What oversized fields cost a real ``kvtrio serve``: this tree against a baseline tree.

    python bench/hostile_fields.py --baseline-src DIR [--lookups 1200] [--registrations 800]
                                   [--size 1MiB]

Issue 32's attacks, each against a fresh ``kvtrio serve`` of each tree (``PYTHONPATH=DIR``),
the client being this tree's (the wire is the same):

* ``--lookups`` lookups that hit, each of a new request whose id is ``--size`` long (a pin is
  held per request, so the server keeps each id until its pins expire): the server's resident
  memory (VmRSS) before and after, its peak (VmHWM), and how many lookups were answered;
* ``--registrations`` registrations of one worker, each with a new model name ``--size`` long,
  on a server with a disk L2 (every L2 kept the names in its fleet record table): the bytes the
  server logged, its resident memory growth, and how many registrations succeeded.

Printed: one row per tree and attack, and the ratio. The baseline's figures need the memory
(the issue saw 1.3 GB for 1,200 lookups); use smaller counts on a small machine.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent

CLIENT = r"""
import json, sys, time
from kvtrio.client import Client
from kvtrio.errors import ServerError
from kvtrio.protocol import Commit, LayoutSpec, Lookup, Register, Store
from kvtrio.storage.keys import token_chunk_hashes

endpoint, attack, count, size = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
layout = LayoutSpec("flash_attn", 2, 64, 16, 2, 16, "float16")
ok = refused = 0
first = ""
with Client(endpoint, timeout=60) as client:
    client.request(Register("e", "m", 1, 0, layout, HASH_SCHEME_TOKENS))
    hashes = tuple(token_chunk_hashes(tuple(range(256)), 256))
    client.request(Store("s", 0, 256, chunk_hashes=hashes))
    client.request(Commit("s", written=hashes))
    print("ready", flush=True)
    sys.stdin.readline()
    for i in range(count):
        name = f"{i}-".ljust(size, "x")
        try:
            if attack == "lookups":
                client.request(Lookup(name, "m", 1, hashes, engine="e"))
            else:
                client.request(Register("e", name, 1, 0, layout, HASH_SCHEME_TOKENS))
            ok += 1
        except ServerError as exc:
            refused += 1
            first = first or str(exc)[:200]
print(json.dumps({"ok": ok, "refused": refused, "error": first}), flush=True)
sys.stdin.readline()
"""


def _rss(pid: int, field: str = "VmRSS") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    return 0


def _settled_rss(pid: int) -> int:
    """VmRSS once it stops changing (at most 5 s)."""
    last, deadline = _rss(pid), time.monotonic() + 5
    while time.monotonic() < deadline:
        time.sleep(0.25)
        now = _rss(pid)
        if abs(now - last) < 1 << 20:
            return now
        last = now
    return last


def run(src: Path, attack: str, count: int, size: int) -> dict[str, float]:
    """One attack against a fresh server of the tree ``src``."""
    from kvtrio.launch import launch_server

    env = {**os.environ, "PYTHONPATH": str(src)}
    with tempfile.TemporaryDirectory(prefix="kvtrio-l2-") as l2:
        l2_args = ["--l2", "none"] if attack == "lookups" else ["--l2", f"disk:path={l2}"]
        args = ["--l1-size", "64MiB", "--log-level", "info", *l2_args]
        with launch_server(*args, env=env) as server:
            assert server.pid is not None
            assert server.log_path is not None
            client_env = {**os.environ, "PYTHONPATH": str(HERE)}
            client = subprocess.Popen(
                [sys.executable, "-c", CLIENT, server.endpoint, attack, str(count), str(size)],
                env=client_env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            )  # fmt: skip
            assert client.stdin is not None
            assert client.stdout is not None
            assert client.stdout.readline().strip() == "ready"
            rss0, log0 = _settled_rss(server.pid), server.log_path.stat().st_size
            t0 = time.perf_counter()
            client.stdin.write("\n")
            client.stdin.flush()
            outcome = client.stdout.readline()
            elapsed = time.perf_counter() - t0
            rss1, log1 = _settled_rss(server.pid), server.log_path.stat().st_size
            peak = _rss(server.pid, "VmHWM")
            client.stdin.write("\n")
            client.stdin.flush()
            client.wait(timeout=60)
    import json

    result = json.loads(outcome)
    return {
        "rss_before": rss0,
        "rss_after": rss1,
        "rss_peak": peak,
        "log_bytes": log1 - log0,
        "ok": result["ok"],
        "refused": result["refused"],
        "seconds": elapsed,
        "error": result["error"],
    }


def main() -> None:
    from kvtrio.options import parse_size

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline-src", type=Path, required=True)
    parser.add_argument("--lookups", type=int, default=1200)
    parser.add_argument("--registrations", type=int, default=800)
    parser.add_argument("--size", default="1MiB")
    args = parser.parse_args()
    size = parse_size(args.size)
    # ``python -m kvtrio serve`` puts its working directory first on sys.path: run the servers
    # from a directory without a kvtrio package, or each would be this tree's.
    os.chdir(tempfile.gettempdir())
    trees = {"baseline": args.baseline_src.resolve(), "this tree": HERE}
    attacks = {"lookups": args.lookups, "registrations": args.registrations}
    print(f"fields of {size:,} characters")
    print(
        f"{'attack':>14} {'tree':>10} {'count':>6} {'answered':>9} {'refused':>8} "
        f"{'RSS before':>11} {'RSS after':>10} {'peak':>8} {'log bytes':>14} {'seconds':>8}"
    )
    for attack, count in attacks.items():
        for name, src in trees.items():
            row = run(src, attack, count, size)
            print(
                f"{attack:>14} {name:>10} {count:>6} {row['ok']:>9.0f} {row['refused']:>8.0f} "
                f"{row['rss_before'] / 2**20:>9.0f}MB {row['rss_after'] / 2**20:>8.0f}MB "
                f"{row['rss_peak'] / 2**20:>6.0f}MB {row['log_bytes']:>14,.0f} "
                f"{row['seconds']:>8.1f}",
                flush=True,
            )
            if row["error"]:
                print(f"{'':>14} {'':>10} first refusal: {row['error']}")


if __name__ == "__main__":
    main()
