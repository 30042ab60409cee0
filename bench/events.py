"""KV events under the trace bench: what the server publishes, and what it costs the requests.

    python bench/events.py [--trace FILE.jsonl] [--limit 600] [--rounds 3] [--speed 0]

Each round runs ``kvtrio bench --trace`` (the Mooncake trace replay in hash mode, the engine's
block hashes carried by every store) twice against a fresh ``kvtrio serve`` (disk L2 in a
temporary directory, 1 GiB of L1, ipc) three times: without events (``off``, the baseline),
with ``--events`` and one subscriber in its own process that decodes every batch (``on``: a
router's minimum, here on the same cores), and with ``--events`` and no subscriber (``quiet``:
the server's own part). The order rotates between rounds. Reported: the medians over the rounds
of the bench's wall time, lookup / store / retrieve p50 and p99, the events the subscriber
received per second of the run, and the ratios to ``off`` (the target is ≤ 1.05).
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

from kvtrio.launch import ServerProcess

ROOT = Path(__file__).resolve().parent.parent
TRACE_RATE = 5_878
"""Events a second of the trace bench's faster run (``docs/events.md``)."""
DEFAULT_TRACE = Path("/work/shared/traces/mooncake_synthetic_trace.jsonl")

SUBSCRIBER = r"""
import signal, sys, zmq
from kvtrio.protocol import decode_batch
stopping = []
signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
sub = zmq.Context.instance().socket(zmq.SUB)
sub.setsockopt(zmq.SUBSCRIBE, b"")
sub.connect(sys.argv[1])
events = batches = 0
print("ready", flush=True)
while True:  # after SIGTERM: until nothing came for 0.3 s
    if not sub.poll(300 if stopping else 100):
        if stopping:
            break
        continue
    frames = sub.recv_multipart()
    events += len(decode_batch(frames[2]).events)
    batches += 1
print(events, batches, flush=True)
"""


def run_once(trace: Path, limit: int, speed: float, mode: str, work: Path) -> dict[str, Any]:
    """One bench run against a fresh server (``mode``: ``off``, ``on`` with a subscriber, or
    ``quiet``: events on, nobody subscribed); its summary, plus the events received."""
    events = mode != "off"
    l2 = tempfile.mkdtemp(dir=work)
    endpoint = f"ipc://{work}/s{os.getpid()}-{mode}.sock"
    args = ["--l1-size", "1GiB", "--l2", f"disk:path={l2},capacity=8GiB", "--log-level", "warning"]
    if events:
        args += ["--events", f"ipc://{work}/ev.sock"]
    server = ServerProcess(endpoint, args, log_path=work / "server.log").start()
    subscriber = None
    try:
        if mode == "on":
            subscriber = subprocess.Popen(
                [sys.executable, "-c", SUBSCRIBER, f"ipc://{work}/ev.sock"],
                stdout=subprocess.PIPE,
                text=True,
            )
            assert subscriber.stdout is not None
            subscriber.stdout.readline()  # (its subscription may still be on its way: the
            # first few events may be missed, which only lowers the count)
        out = work / "bench.json"
        command = [sys.executable, "-m", "kvtrio", "bench", "--server", endpoint]
        command += ["--trace", str(trace), "--limit", str(limit), "--no-progress"]
        command += ["--json", str(out)] + (["--speed", str(speed)] if speed else [])
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
        summary: dict[str, Any] = json.loads(out.read_text())
    finally:
        if subscriber is not None:
            subscriber.terminate()  # it prints its counts once the stream is quiet
            subscriber.wait(timeout=30)
        server.stop()
    if subscriber is not None:
        assert subscriber.stdout is not None
        received, batches = map(int, subscriber.stdout.read().split())
        summary["events_received"] = received
        summary["event_batches"] = batches
    return summary


def server_cost_per_event(chunks: int = 20_000, *, tokens: bool = True) -> float:
    """Seconds of the server's loop per event: what a commit, an L2 write and an L1 eviction
    cost it with events on (the announcer, the queue, the encoding of the batches), in this
    process, with 16 engine block hashes per chunk (the trace bench's 256-token chunks) and,
    with ``tokens`` (issue 35), the store's 256 token ids a chunk: decoding them from the
    store's message (and checking their range), keeping them, sending them in ``BlockStored``."""
    from kvtrio.protocol import (
        KVEvent,
        Store,
        decode_request,
        encode_batch,
        encode_request,
        pack_tokens,
    )
    from kvtrio.server._announce import Announcer

    queue: list[tuple[str, KVEvent]] = []
    announcer = Announcer(lambda tenant, event: queue.append((tenant, event)), chunk_size=256)
    space = bytes(16)
    announcer.announce_space(space, "")
    keys = [space + i.to_bytes(16, "big") for i in range(chunks)]
    bodies = []
    for first in range(0, chunks, 100):
        ids = range(first * 256, (first + 100) * 256)
        extra = {"token_ids": pack_tokens(ids)} if tokens else {}
        store = Store(
            "r",
            0,
            100 * 256,
            (),
            block_hashes=tuple(range(first * 16, (first + 100) * 16)),
            **extra,
        )
        bodies.append(encode_request(1, store)[1])
    started = time.process_time()  # (CPU time: other load on the machine does not count)
    for first in range(0, chunks, 100):  # 100 chunks a batch (5 ms at ~20k events/s)
        part = keys[first : first + 100]
        store = decode_request("store", bodies[first // 100])
        if tokens:
            announcer.names(part, store.block_hashes, 16, store)  # type: ignore[attr-defined]
        else:
            announcer.names(part, store.block_hashes, 16)  # type: ignore[attr-defined]
        for key in part:
            announcer.ready(key, None)
            announcer.stored(key, "disk")
            announcer.removed(key)
        batch, queue[:] = list(queue), []
        encode_batch(time.time(), [event for _, event in batch])
    return (time.process_time() - started) / (3 * chunks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--limit", type=int, default=600)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--speed", type=float, default=0.0)
    parser.add_argument(
        "--cost-only",
        action="store_true",
        help="only the server loop's cost per event, without and with the stores' tokens",
    )
    args = parser.parse_args()
    if args.cost_only:
        for tokens in (False, True, False, True, False, True):
            cost = server_cost_per_event(tokens=tokens)
            print(
                f"server loop per event, tokens {'on ' if tokens else 'off'}: {cost * 1e6:.1f} µs"
                f" ({cost * TRACE_RATE:.1%} of one core at the trace bench's {TRACE_RATE:,}/s)"
            )
        return
    modes = ("off", "on", "quiet")
    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in modes}
    with tempfile.TemporaryDirectory(prefix="kvt-ev-", dir="/tmp") as tmp:
        work = Path(tmp)
        for round_ in range(args.rounds):
            for mode in modes[round_ % 3 :] + modes[: round_ % 3]:  # the order rotates
                summary = run_once(args.trace, args.limit, args.speed, mode, work)
                runs[mode].append(summary)
                received = summary.get("events_received")
                print(
                    f"round {round_ + 1} events {mode:5}: {summary['wall_seconds']:.1f} s, "
                    f"lookup p50 {summary['latency_seconds']['lookup']['p50'] * 1e3:.2f} ms"
                    + (f", {received:,} events received" if received is not None else ""),
                    flush=True,
                )

    def median(mode: str, pick: Any) -> float:
        return statistics.median(pick(s) for s in runs[mode])

    rows = [("wall s", lambda s: s["wall_seconds"])]
    for op in ("lookup", "store", "retrieve"):
        for q in ("p50", "p99"):
            rows.append((f"{op} {q} ms", lambda s, op=op, q=q: s["latency_seconds"][op][q] * 1e3))
    print(f"\nmedians of {args.rounds} rounds, {args.limit} requests of {args.trace.name}")
    print(f"{'measure':16} {'off':>8} {'on':>8} {'quiet':>8} {'on/off':>7} {'quiet/off':>9}")
    for name, pick in rows:
        off, on, quiet = (median(m, pick) for m in modes)
        print(f"{name:16} {off:8.2f} {on:8.2f} {quiet:8.2f} {on / off:7.3f} {quiet / off:9.3f}")
    received = median("on", lambda s: s["events_received"])
    rate = median("on", lambda s: s["events_received"] / s["wall_seconds"])
    batches = median("on", lambda s: s["event_batches"])
    print(f"events received (median): {received:,.0f} in {batches:,.0f} batches; {rate:,.0f}/s")
    costs = [server_cost_per_event() for _ in range(5)]
    per_event = statistics.median(costs)
    print(
        f"server loop per event (median of 5): {per_event * 1e6:.1f} µs; at {rate:,.0f}/s "
        f"{per_event * rate:.1%} of one core"
    )


if __name__ == "__main__":
    main()
