"""The server's memory under stores carrying the longest event names (issue 32, item 5).

    PYTHONPATH=TREE python bench/events_names.py [--chunks 20000] [--subscribe]

Starts a real ``kvtrio serve --events`` (ipc, no L2, L1 large enough to keep every chunk) and
one client that registers a layout of ``block_size`` 1 (256 blocks a chunk) and stores and
commits chunks whose stores carry a 64-byte engine block hash per block (the longest a store
may carry: 16 KiB of names a chunk), 64 chunks a message. Prints the server's anonymous memory
(``RssAnon``: the Python heap, not the L1 arena's shared memory) before and after, with no
subscriber (default) or with one subscribed to the tenant's topic (``--subscribe``). Run it
with ``PYTHONPATH`` naming the tree to measure, from a directory outside any tree (``python
-m`` puts the working directory first on the path).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import zmq

from kvtrio import protocol
from kvtrio.client import Client
from kvtrio.launch import launch_server
from kvtrio.protocol import Commit, LayoutSpec, Register, Store, events_topic

CHUNK = 256
LAYOUT = LayoutSpec("flash_attn", 1, 64, 1, 1, 2, "float16")  # 1 KiB chunks, 256 blocks each
SCHEME = "tokens/sha256-128/v1"
PER_MESSAGE = 64


def rss_anon(pid: int) -> int:
    """Bytes of ``pid``'s anonymous resident memory."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--chunks", type=int, default=20_000)
    parser.add_argument("--subscribe", action="store_true", help="one subscriber on the topic")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="kvtrio-names-", dir="/tmp"))
    events = f"ipc://{workdir}/ev"
    with (
        launch_server(
            "--l1-size", "256MiB", "--l2", "none", "--log-level", "warning", "--events", events
        ) as server,  # fmt: skip
        Client(server.endpoint, timeout=600) as client,
    ):
        assert server.proc is not None
        pid = server.proc.pid
        sub = zmq.Context.instance().socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 1000)
        sub.connect(events)
        if args.subscribe:
            sub.setsockopt(zmq.SUBSCRIBE, events_topic(""))
        client.request(Register("e", "m", 1, 0, LAYOUT, SCHEME))
        time.sleep(0.5)
        before = rss_anon(pid)
        start = time.monotonic()
        for first in range(0, args.chunks, PER_MESSAGE):
            count = min(PER_MESSAGE, args.chunks - first)
            chunks = tuple((first + i).to_bytes(16, "big") for i in range(count))
            names = tuple(
                (256 * (first + i) + b).to_bytes(64, "big")
                for i in range(count)
                for b in range(256)
            )
            client.request(Store(f"s{first}", 0, CHUNK * count, chunks, block_hashes=names))
            client.request(Commit(f"s{first}", written=chunks))
            while sub.poll(0):  # (a subscriber that keeps up)
                sub.recv_multipart()
        elapsed = time.monotonic() - start
        time.sleep(0.5)
        after = rss_anon(pid)
        sub.close(linger=0)
    print(
        f"kvtrio from {os.path.dirname(protocol.__file__)}; {args.chunks:,} chunks of 256 "
        f"64-byte block hashes in {elapsed:.1f} s, "
        f"{'one subscriber' if args.subscribe else 'no subscriber'}"
    )
    grown = after - before
    print(
        f"server RssAnon {before / 2**20:.0f} MiB -> {after / 2**20:.0f} MiB "
        f"(+{grown / 2**20:.0f} MiB, {grown / args.chunks / 1024:.1f} KiB a chunk)"
    )


if __name__ == "__main__":
    main()
