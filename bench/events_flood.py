"""Floods of the KV events sockets against a victim's pings (issue 32, item 4).

    PYTHONPATH=TREE python bench/events_flood.py [--scale 1.0] [--out FILE.json]

Starts a real ``kvtrio serve --events`` on loopback tcp with CURVE (``--events-buffer 5016``,
as the issue's run) and two keys: tenant ``a``'s (the **victim**, a process of its own that
pings the server 2 ms apart for the whole run) and tenant ``b``'s (the **flooder**, this
process). The flooder first fills tenant b's replay buffer (one-chunk stores and commits with a
subscriber on its topic, each commit one batch), then sends, one flood at a time:

* 200,000 **refused** subscriptions (tenant a's topic, which b's key may not use);
* 200,000 **allowed** subscriptions (b's own topic);
* 20,000 and 200,000 **replay requests** for batches past the end (each answered with the end
  marker alone);
* 100 **replays of the full buffer** (from seq 0).

For each flood: the time to send it and until the server had handled it all (its window: read
from the server's ``/metrics`` counters, ``kvtrio_events_refused_subscriptions`` and
``kvtrio_events_replays``; the allowed subscriptions end with one refused as a marker), the
victim's worst and median ping among the pings overlapping the window, and the server's log
lines in the window. ``--scale`` multiplies the counts (the issue's
figures are at 1.0). Run it with ``PYTHONPATH`` naming the tree to measure (a checkout of main
for the before figures): the server process inherits it. The fill is not scaled (the last
flood replays a full buffer); the victim's pings outside every window are the baseline.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import zmq

from kvtrio import protocol
from kvtrio.client import Client, curve_options
from kvtrio.launch import ServerProcess
from kvtrio.protocol import Commit, LayoutSpec, Register, Store, events_topic
from kvtrio.transport import write_keypair

CHUNK = 256
LAYOUT = LayoutSpec("flash_attn", 2, 64, 16, 1, 16, "float16")  # 32 KiB chunks
SCHEME = "tokens/sha256-128/v1"
BUFFER = 5016

VICTIM = r"""
import json, os, sys, time
from kvtrio.client import Client
from kvtrio.protocol import Ping
endpoint, stop = sys.argv[1], sys.argv[2]
pings = []
with Client(endpoint, timeout=300, client_name="victim") as client:
    client.request(Ping())
    print("ready", flush=True)
    while not os.path.exists(stop):
        start = time.monotonic()
        client.request(Ping())
        pings.append([start, time.monotonic() - start])
        time.sleep(0.002)
print(json.dumps(pings))
"""


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _keys(directory: Path) -> dict[str, str]:
    clients = directory / "clients"
    write_keypair(directory, "server")
    for name, tenant in (("victim", "a"), ("flood", "b")):
        write_keypair(clients, name, tenant)
        (clients / f"{name}.key_secret").rename(directory / f"{name}.key_secret")
    return {
        "server": str(directory / "server.key"),
        "server_secret": str(directory / "server.key_secret"),
        "allowed": str(clients),
        "victim": str(directory / "victim.key_secret"),
        "flood": str(directory / "flood.key_secret"),
    }


def _socket(kind: int, endpoint: str, options: dict[int, Any]) -> zmq.Socket[bytes]:
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    for option, value in options.items():
        sock.setsockopt(option, value)
    sock.connect(endpoint)
    return sock


def _counter(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=600) as reply:
        for line in reply.read().decode().splitlines():
            if line.startswith((f"kvtrio_events_{name}_total ", f"kvtrio_events_{name} ")):
                return float(line.split()[1])
    return 0.0


def _until(port: int, name: str, target: float) -> None:
    """Wait until counter ``name`` reaches ``target`` and stays put for 0.3 s."""
    last, since = -1.0, time.monotonic()
    while True:
        value = _counter(port, name)
        if value != last:
            last, since = value, time.monotonic()
        elif value >= target and time.monotonic() - since >= 0.3:
            return
        time.sleep(0.02)


def _fill(client: Client, batches: int) -> None:
    """One-chunk stores and commits of tenant b (each commit one batch at a 0.5 ms interval)."""
    client.request(Register("e", "m", 1, 0, LAYOUT, SCHEME, tenant="b"))
    for n in range(batches):
        chunk = n.to_bytes(16, "big")
        client.request(Store(f"s{n}", 0, CHUNK, (chunk,)))
        client.request(Commit(f"s{n}", written=(chunk,)))


def run(args: argparse.Namespace) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix="kvtrio-evflood-", dir="/tmp"))
    keys = _keys(workdir / "keys")
    endpoint, events = f"tcp://127.0.0.1:{_port()}", f"tcp://127.0.0.1:{_port()}"
    replay = f"tcp://127.0.0.1:{int(events.rpartition(':')[2]) + 1}"
    env = {**os.environ, "KVTRIO_SERVER_KEY": keys["server"], "KVTRIO_CLIENT_KEY": keys["victim"]}
    log = workdir / "server.log"
    metrics = _port()
    server = ServerProcess(
        endpoint,
        ["--curve-secret-key", keys["server_secret"], "--curve-allowed-keys", keys["allowed"],
         "--events", events, "--events-buffer", str(BUFFER), "--events-interval", "0.0005",
         "--l1-size", "512MiB", "--l2", "none", "--log-level", "info",
         "--http", f"127.0.0.1:{metrics}"],
        env, log_path=log, server_key=keys["server"],
    )  # fmt: skip
    os.environ.update(KVTRIO_SERVER_KEY=keys["server"], KVTRIO_CLIENT_KEY=keys["victim"])
    stop = workdir / "stop"
    results: dict[str, Any] = {}
    n = lambda count: max(1, int(count * args.scale))  # noqa: E731
    try:
        server.start(60)
        victim = subprocess.Popen(
            [sys.executable, "-c", VICTIM, endpoint, str(stop)],
            stdout=subprocess.PIPE, text=True, env=env,
        )  # fmt: skip
        assert victim.stdout is not None
        assert victim.stdout.readline().strip() == "ready"
        flood_opts = curve_options(events, keys["server"], keys["flood"])
        windows: list[tuple[str, float, float, float, int]] = []
        with Client(endpoint, timeout=600, server_key=keys["server"],
                    client_key=keys["flood"]) as flooder:  # fmt: skip
            own = _socket(zmq.SUB, events, flood_opts)  # b's subscriber: b's events are sent
            own.setsockopt(zmq.RCVHWM, 0)
            own.setsockopt(zmq.SUBSCRIBE, events_topic("b"))
            time.sleep(0.5)
            start = time.monotonic()
            _fill(flooder, BUFFER + 200)
            results["fill"] = {"batches": BUFFER + 200, "s": time.monotonic() - start}

            def flood(name: str, send: Any, counter: str, more: int) -> None:
                time.sleep(0.3)  # the victim's pings in between are the baseline
                lines = log.read_text(errors="replace").count("\n")
                target = _counter(metrics, counter) + more
                start = time.monotonic()
                send()
                sent = time.monotonic()
                _until(metrics, counter, target)
                end = time.monotonic() - 0.3  # (less the time it stood still)
                logged = log.read_text(errors="replace").count("\n") - lines
                windows.append((name, start, end, sent - start, logged))

            xsub = _socket(zmq.XSUB, events, {**flood_opts, zmq.SNDHWM: 0})
            dealer = _socket(zmq.DEALER, replay, {**flood_opts, zmq.SNDHWM: 0, zmq.RCVHWM: 1})
            time.sleep(0.3)
            refused, allowed = b"\x01" + events_topic("a"), b"\x01" + events_topic("b")
            past = (1 << 40).to_bytes(8, "big")
            for name, count, frames in (
                ("refused subscriptions", n(200_000), [refused]),
                ("allowed subscriptions", n(200_000), [allowed]),
                ("replay requests (20k)", n(20_000), [b"", past, events_topic("b")]),
                ("replay requests (200k)", n(200_000), [b"", past, events_topic("b")]),
                ("full-buffer replays", 100, [b"", bytes(8), events_topic("b")]),
            ):
                sock = xsub if name.endswith("subscriptions") else dealer
                marker = name.startswith("allowed")

                def send(sock: zmq.Socket[bytes] = sock, count: int = count,
                         frames: list[bytes] = frames, marker: bool = marker) -> None:  # fmt: skip
                    for _ in range(count):
                        sock.send_multipart(frames)
                    if marker:  # the end of the allowed ones: a refused one after them
                        sock.send(refused)

                counter = "refused_subscriptions" if sock is xsub else "replays"
                flood(f"{name} ×{count:,}", send, counter, 1 if marker else count)
            for sock in (xsub, dealer, own):
                sock.close(linger=0)
        stop.touch()
        out, _ = victim.communicate(timeout=600)
    finally:
        server.stop()
    pings = json.loads(out.strip().splitlines()[-1])
    for name, start, end, sent, logged in windows:
        overlapping = [rtt for t, rtt in pings if t <= end and t + rtt >= start]
        results[name] = {
            "send_s": sent,
            "window_s": end - start,
            "victim_worst_ms": max(overlapping) * 1e3 if overlapping else None,
            "victim_median_ms": statistics.median(overlapping) * 1e3 if overlapping else None,
            "victim_pings": len(overlapping),
            "log_lines": logged,
        }
    quiet = [
        rtt for t, rtt in pings if not any(t <= e and t + rtt >= s for _, s, e, _, _ in windows)
    ]
    results["victim, between floods"] = {
        "victim_worst_ms": max(quiet) * 1e3,
        "victim_median_ms": statistics.median(quiet) * 1e3,
        "victim_pings": len(quiet),
    }
    rtts = [rtt for _, rtt in pings]
    results["victim, whole run"] = {
        "victim_worst_ms": max(rtts) * 1e3,
        "victim_median_ms": statistics.median(rtts) * 1e3,
        "victim_pings": len(rtts),
    }
    shutil.rmtree(workdir, ignore_errors=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scale", type=float, default=1.0, help="multiply the flood counts")
    parser.add_argument("--out", type=Path, help="also write the figures here (JSON)")
    args = parser.parse_args()
    results = run(args)
    print(f"kvtrio from {os.path.dirname(protocol.__file__)}; counts ×{args.scale}")
    print(f"{'flood':<38} {'send s':>7} {'window s':>8} {'worst ms':>9} {'median ms':>9} "
          f"{'log lines':>9}")  # fmt: skip
    for name, row in results.items():
        if "send_s" not in row:
            continue
        print(
            f"{name:<38} {row['send_s']:>7.2f} {row['window_s']:>8.2f} "
            f"{row['victim_worst_ms']:>9.1f} {row['victim_median_ms']:>9.2f} "
            f"{row['log_lines']:>9}"
        )
    print(f"fill: {results['fill']['batches']} commits in {results['fill']['s']:.1f} s")
    for name in ("victim, between floods", "victim, whole run"):
        row = results[name]
        print(f"{name}: worst {row['victim_worst_ms']:.1f} ms, median "
              f"{row['victim_median_ms']:.2f} ms ({row['victim_pings']} pings)")  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
