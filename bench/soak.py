"""Soak: ``kvtrio bench``'s chat workload for N minutes against a disk L2 forced to evict; RSS.

    python bench/soak.py [--minutes 10] [--l1-size 256MiB] [--l2-capacity 256MiB] [--every 5]

Starts ``kvtrio serve`` (L1 small, a disk L2 in a temporary directory with a capacity far below
what the workload stores, so both tiers evict all the time), then runs ``kvtrio bench --server``
with the built-in multi-turn chat workload again and again until the time is up, sampling the
server's resident memory (``VmRSS``) every ``--every`` seconds. Prints the RSS curve per minute
and compares the end with the end of the warm-up (the first fifth): memory must stay flat.
Also prints the server's L2 counters at the end (evictions, errors). Not part of the CI suite.
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
import urllib.request
from pathlib import Path

from kvtrio.launch import ServerProcess, ServerStartError


def rss_mib(pid: int, field: str = "RssAnon") -> float:
    """Resident MiB of ``field``: ``RssAnon`` is the process's own heap (the L1 arena is shared
    memory, ``RssShmem``, and fills up to --l1-size by design)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--l1-size", default="256MiB")
    parser.add_argument("--l2-capacity", default="256MiB")
    parser.add_argument("--every", type=float, default=5.0, help="seconds between RSS samples")
    parser.add_argument("--http-port", type=int, default=19641)
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="kvtrio-soak-"))
    endpoint = f"ipc://{work}/kvtrio.sock"
    python = sys.executable
    server = ServerProcess(
        endpoint,
        [
            "--l1-size", args.l1_size, "--http", str(args.http_port),
            "--l2", f"disk:path={work}/l2,capacity={args.l2_capacity}",
            "--log-level", "warning",
        ],
    )  # fmt: skip
    samples: list[tuple[float, float]] = []
    shared: list[float] = []
    rounds = 0
    log = (work / "bench.log").open("w")
    started = time.monotonic()
    deadline = started + args.minutes * 60
    try:
        try:
            server.start(timeout=30.0)
        except ServerStartError as exc:
            sys.exit(f"the server did not start: {exc}")
        pid = server.pid
        assert server.proc is not None
        assert pid is not None
        bench = None
        next_sample = time.monotonic()
        while time.monotonic() < deadline:
            if server.proc.poll() is not None:
                sys.exit(f"the server exited with {server.proc.returncode}")
            if bench is None or bench.poll() is not None:
                if bench is not None and bench.returncode != 0:
                    sys.exit(f"kvtrio bench failed ({bench.returncode}); see {work}/bench.log")
                bench = subprocess.Popen(
                    [
                        python, "-m", "kvtrio", "bench", "--server", endpoint, "--no-progress",
                        "--conversations", "64", "--turns", "4", "--seed", str(rounds),
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=log,
                )  # fmt: skip
                rounds += 1
            if time.monotonic() >= next_sample:
                samples.append((time.monotonic() - started, rss_mib(pid)))
                shared.append(rss_mib(pid, "RssShmem"))
                next_sample += args.every
            time.sleep(0.2)
        if bench is not None and bench.poll() is None:
            bench.terminate()
            bench.wait(30)
        with urllib.request.urlopen(f"http://127.0.0.1:{args.http_port}/status") as reply:
            status = json.load(reply)
    finally:
        server.stop(timeout=30.0)

    print(f"soak: {args.minutes:g} min, {rounds} bench runs, L1 {args.l1_size}, "
          f"disk L2 capacity {args.l2_capacity}")  # fmt: skip
    print(f"shared memory (the L1 arena) at the end: {shared[-1]:.1f} MiB" if shared else "")
    print("minute  private RSS MiB (RssAnon, median of the minute's samples)")
    for minute in range(int(args.minutes + 0.999)):
        values = [rss for t, rss in samples if minute * 60 <= t < (minute + 1) * 60]
        if values:
            print(f"{minute + 1:>6}  {statistics.median(values):8.1f}")
    warm = [rss for t, rss in samples if t >= args.minutes * 60 * 0.2]
    if warm:
        first, last = warm[0], statistics.median(rss for t, rss in samples[-6:])
        print(f"after warm-up: {first:.1f} MiB → end {last:.1f} MiB ({last / first:.2f}×)")
    for backend in status.get("l2", []):
        keys = ("objects", "bytes", "evictions", "errors", "stores", "loads", "foreign_files")
        print("L2", backend["name"], {k: backend.get(k) for k in keys if k in backend})
    print("leases:", status.get("leases"), "requests:", status.get("requests", {}).get("total"))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
