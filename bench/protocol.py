"""Round trips of a lookup-sized request through kvtrio, next to raw pyzmq in the same run.

    python bench/protocol.py [--requests 20000] [--repeats 5] [--transport ipc|tcp]
                             [--server-args "--http 127.0.0.1:0"] [--baseline-src DIR]

Measured, each in fresh processes and interleaved over ``--repeats`` rounds (medians reported,
these machines are shared and noisy):

* codec: encode + decode of the request (256 token ids + 64 block ids) with kvtrio's tuned
  converter and with an untuned cattrs msgpack converter;
* raw pyzmq REQ/REP and DEALER/ROUTER ping-pong of the very same bytes (the server an echo loop
  in its own process);
* kvtrio: ``kvtrio serve`` and the synchronous client, ``probe`` operation (decoded, validated,
  answered; no cache work), sequentially and with 64 requests in flight;
* the same over tcp on loopback with CURVE (the default for tcp) and with ``--insecure``: what
  authentication and encryption cost (keys in a temporary directory);
* the request path of an engine's scheduler (``bench/_request_path.py``, the plain ``kvtrio``
  row only): ``ping``; lookup → result (1-chunk and 128-chunk prompts) with a blocking and with
  a spinning caller, and the client's hashing of those prompts; lookups/s with 64 in flight; a
  burst of 64 new requests the way the vLLM connector takes them (``--requests / 10`` round
  trips each, ratios to the raw rows);
* who costs what in a ping: raw DEALER → raw ROUTER (answering kvtrio's reply bytes), raw
  DEALER → ``kvtrio serve`` (the server's share), kvtrio client → raw ROUTER (the client's
  share), kvtrio → kvtrio; each with the CPU per ping of the client's and the server's process;
* every ``kvtrio serve`` gets ``--l1-size 256MiB`` unless ``--server-args`` says otherwise, and
  is measured only once its start-up is over (its CPU use stops: preallocating a 4 GiB L1 takes
  ~1.7 s of CPU, which shared the 2 cores with the first rounds' measurements before);
* run it with ``PYTHONPATH=<another tree>`` for the same rows of that tree's client and server
  (its burst row without lookup batches if that tree has none): before/after comparisons;
* with ``--baseline-src DIR`` (e.g. ``git archive main | tar -x -C DIR``), the same against the
  server of that source tree, in the same rounds: what a change costs on the request path.
"""

from __future__ import annotations

import argparse
import collections
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import timeit
from collections.abc import Callable
from pathlib import Path

import _request_path as path_bench
import msgpack
import zmq
from cattrs.preconf.msgpack import make_converter

from kvtrio.client import Client, SchedulerAdapter
from kvtrio.launch import ServerProcess
from kvtrio.protocol import (
    PROTOCOL_VERSION,
    HelloReply,
    Pong,
    Probe,
    ProbeReply,
    decode_header,
    decode_request,
    encode_reply,
    encode_request,
)
from kvtrio.transport import ensure_default_keys

REQUEST = Probe(tokens=tuple(range(1000, 1256)), block_ids=tuple(range(64)))
REQUEST_FRAMES = encode_request(1, REQUEST)
REPLY_FRAMES = encode_reply(1, "probe", ProbeReply(256, 64))
WINDOW = 64


# --------------------------------------------------------------------------- raw servers


def raw_server(kind: str, endpoint: str) -> None:
    """Echo loop of the raw baselines (run in a child process). ``kvecho``: a raw ROUTER that
    answers kvtrio's hello, ping and goodbye with kvtrio's reply bytes (the client's share)."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.REP if kind == "rep" else zmq.ROUTER)
    sock.setsockopt(zmq.SNDHWM, 100_000)
    sock.setsockopt(zmq.RCVHWM, 100_000)
    sock.bind(endpoint)
    print("ready", flush=True)
    if kind == "rep":
        while True:
            sock.recv_multipart()
            sock.send_multipart(REPLY_FRAMES)
    if kind == "kvecho":
        hello = HelloReply("raw", PROTOCOL_VERSION, "raw", 256, 3600.0, 1 << 24)
        bodies = {
            "hello": encode_reply(0, "hello", hello)[1],
            "ping": encode_reply(0, "ping", Pong("raw"))[1],
            "goodbye": encode_reply(0, "goodbye", Pong("raw"))[1],
        }
        while True:
            identity, header, _ = sock.recv_multipart()
            _, call_id, op = msgpack.unpackb(header)
            sock.send_multipart(
                [identity, msgpack.packb((PROTOCOL_VERSION, call_id, op)), bodies[op]]
            )
    while True:
        frames = sock.recv_multipart()
        sock.send_multipart([frames[0], *REPLY_FRAMES])


def start(cmd: list[str], ready: Callable[[subprocess.Popen[str]], None]) -> subprocess.Popen[str]:
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    ready(proc)
    return proc


def wait_line(proc: subprocess.Popen[str]) -> None:
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready"


# --------------------------------------------------------------------------- clients


def percentiles(samples: list[float]) -> tuple[float, float]:
    samples.sort()
    return samples[len(samples) // 2], samples[int(len(samples) * 0.99)]


def raw_sequential(kind: str, endpoint: str, n: int) -> dict[str, float]:
    sock = zmq.Context.instance().socket(zmq.REQ if kind == "rep" else zmq.DEALER)
    sock.connect(endpoint)
    for _ in range(200):  # warm up
        sock.send_multipart(REQUEST_FRAMES)
        sock.recv_multipart()
    samples = []
    t0 = time.perf_counter()
    for _ in range(n):
        start_ = time.perf_counter()
        sock.send_multipart(REQUEST_FRAMES)
        sock.recv_multipart()
        samples.append(time.perf_counter() - start_)
    total = time.perf_counter() - t0
    sock.close(linger=0)
    p50, p99 = percentiles(samples)
    return {"p50": p50, "p99": p99, "seq_rps": n / total}


def raw_windowed(endpoint: str, n: int) -> float:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.SNDHWM, 100_000)
    sock.setsockopt(zmq.RCVHWM, 100_000)
    sock.connect(endpoint)
    sock.send_multipart(REQUEST_FRAMES)
    sock.recv_multipart()
    t0 = time.perf_counter()
    for _ in range(WINDOW):
        sock.send_multipart(REQUEST_FRAMES)
    for i in range(n):
        sock.recv_multipart()
        if i + WINDOW < n:
            sock.send_multipart(REQUEST_FRAMES)
    total = time.perf_counter() - t0
    sock.close(linger=0)
    return n / total


def kvtrio_sequential(client: Client, n: int) -> dict[str, float]:
    for _ in range(200):
        client.request(REQUEST)
    samples = []
    t0 = time.perf_counter()
    for _ in range(n):
        start_ = time.perf_counter()
        client.request(REQUEST)
        samples.append(time.perf_counter() - start_)
    total = time.perf_counter() - t0
    p50, p99 = percentiles(samples)
    return {"p50": p50, "p99": p99, "seq_rps": n / total}


def kvtrio_windowed(client: Client, n: int) -> float:
    in_flight: collections.deque[object] = collections.deque()
    t0 = time.perf_counter()
    for _ in range(n):
        if len(in_flight) >= WINDOW:
            in_flight.popleft().result()  # type: ignore[attr-defined]
        in_flight.append(client.submit(REQUEST))
    while in_flight:
        in_flight.popleft().result()  # type: ignore[attr-defined]
    return n / (time.perf_counter() - t0)


def wait_connected(client: Client) -> None:
    deadline = time.monotonic() + 15
    while client.server_info is None and time.monotonic() < deadline:
        time.sleep(0.01)


def request_path(client: Client, n: int, pings: int, server_pid: int) -> dict[str, float]:
    """The scheduler's request path (see ``bench/_request_path.py``)."""
    adapter = SchedulerAdapter(client.endpoint, "bench", 1, 0, 16, client=client, timeout=10)
    row = path_bench.ping(client, pings, server_pid)
    raw = path_bench.raw_ping(client.endpoint, pings, server_pid)  # the server's share
    row.update({f"raw_{k}": v for k, v in raw.items()})
    for chunks in (1, 128):
        for spin in (False, True):
            count = n if chunks == 1 else max(50, n // 10)
            row[f"lookup{chunks}{'spin' if spin else ''}"] = path_bench.lookup(
                adapter, chunks, count, spin=spin
            )
        row[f"hashing{chunks}"] = path_bench.hashing(chunks, adapter.chunk_size)
    row["lookup_rps"] = path_bench.lookups_per_second(client, "bench", n * 5)
    row["burst"] = path_bench.burst(adapter, 5)
    return row


# --------------------------------------------------------------------------- codec


def codec_us() -> dict[str, float]:
    """µs per encode + decode of the request: kvtrio's converter vs an untuned cattrs one."""
    untuned = make_converter()

    def with_untuned() -> object:
        header = msgpack.packb((PROTOCOL_VERSION, 1, "probe"))
        body = msgpack.packb(untuned.unstructure(REQUEST))
        decode_header(header)
        return untuned.structure(msgpack.unpackb(body), Probe)

    def with_kvtrio() -> object:
        header, body = encode_request(1, REQUEST)
        return decode_request(decode_header(header).kind, body)

    assert with_untuned() == with_kvtrio() == REQUEST
    n = 5000
    return {
        name: min(timeit.repeat(fn, number=n, repeat=5)) / n * 1e6
        for name, fn in [("untuned", with_untuned), ("tuned", with_kvtrio)]
    }


# --------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--transport", choices=["ipc", "tcp"], default="ipc")
    parser.add_argument(
        "--server-args", default="", help="extra arguments of kvtrio serve (e.g. --http 0)"
    )
    parser.add_argument(
        "--baseline-src", type=Path, help="also measure the kvtrio server of this source tree"
    )
    parser.add_argument(
        "--raw-server", nargs=2, metavar=("KIND", "ENDPOINT"), help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    if args.raw_server:
        raw_server(*args.raw_server)
        return

    workdir = Path(tempfile.mkdtemp(prefix="kvb-", dir="/tmp"))
    # The CURVE row's keys, where the server and this process's client both find them.
    os.environ["KVTRIO_KEY_DIR"] = str(workdir / "keys")
    ensure_default_keys(workdir / "keys")
    port = iter(range(25_555, 26_000))

    def endpoint(name: str) -> str:
        if args.transport == "ipc":
            return f"ipc://{workdir}/{name}.sock"
        return f"tcp://127.0.0.1:{next(port)}"

    results: dict[str, list[dict[str, float]]] = collections.defaultdict(list)
    codec = codec_us()
    n = args.requests
    pings = max(1000, n)  # CPU per ping from 10 ms clock ticks: enough pings for µs
    for round_ in range(args.repeats):
        for kind in ("rep", "router"):
            ep = endpoint(f"{kind}{round_}")
            proc = start([sys.executable, __file__, "--raw-server", kind, ep], wait_line)
            try:
                row = raw_sequential(kind, ep, n)
                if kind == "router":
                    row["win_rps"] = raw_windowed(ep, n)
                results[kind].append(row)
            finally:
                proc.kill()
                proc.wait()
        # The client's share of a ping: a raw ROUTER answering kvtrio's reply bytes, pinged
        # by a raw DEALER and by kvtrio's client.
        ep = endpoint(f"kvecho{round_}")
        proc = start([sys.executable, __file__, "--raw-server", "kvecho", ep], wait_line)
        try:
            row = path_bench.raw_ping(ep, pings, proc.pid)
            with Client(ep, heartbeat=False) as client:
                wait_connected(client)
                row.update(
                    {f"kv_{k}": v for k, v in path_bench.ping(client, pings, proc.pid).items()}
                )
            results["kvecho"].append(row)
        finally:
            proc.kill()
            proc.wait()
        extra = shlex.split(args.server_args)
        if "--l1-size" not in extra:  # not 4 GiB to preallocate per server start
            extra += ["--l1-size", "256MiB"]
        servers: list[tuple[str, Path | None, str, list[str]]] = [
            ("kvtrio", None, endpoint(f"kvtrio{round_}"), extra),
            # tcp on loopback, the same server with CURVE (the default) and without.
            ("tcp-plain", None, f"tcp://127.0.0.1:{next(port)}", [*extra, "--insecure"]),
            ("tcp-curve", None, f"tcp://127.0.0.1:{next(port)}", extra),
        ]
        if args.baseline_src is not None:
            servers.append(("baseline", args.baseline_src, endpoint(f"baseline{round_}"), []))
        for kind, source, ep, server_args in servers:
            env = {**os.environ, "KVTRIO_LOG_LEVEL": "warning"}
            if source is not None:
                env["PYTHONPATH"] = str(source.resolve())
            if args.transport == "tcp" and kind == "kvtrio" and "--insecure" not in extra:
                server_args = [*server_args, "--insecure"]  # "kvtrio" stays the plain row
            plain = ep.startswith("tcp://") and kind != "tcp-curve"
            key = "none" if plain else None
            log_path = workdir / f"{kind}{round_}.log"
            with ServerProcess(ep, server_args, env, log_path=log_path, server_key=key) as server:
                pid = server.pid
                assert pid is not None
                with Client(ep, heartbeat=False, server_key=key) as client:
                    wait_connected(client)
                    path_bench.wait_quiet(pid)  # its start-up is over
                    row = kvtrio_sequential(client, n)
                    row["win_rps"] = kvtrio_windowed(client, n)
                    if kind == "kvtrio":
                        row.update(request_path(client, max(200, n // 10), pings, pid))
                    results[kind].append(row)
        print(f"round {round_ + 1}/{args.repeats} done", file=sys.stderr)

    def med(kind: str, key: str) -> float:
        return statistics.median(r[key] for r in results[kind])

    size = sum(map(len, REQUEST_FRAMES))
    print(f"\nprotocol bench: {n} requests/run, {args.repeats} rounds, {args.transport}, medians")
    print(f"request: 256 token ids + 64 block ids = {size} bytes on the wire")
    print(
        f"codec encode+decode: kvtrio {codec['tuned']:.1f} µs, untuned cattrs "
        f"{codec['untuned']:.1f} µs ({codec['untuned'] / codec['tuned']:.1f}× faster)\n"
    )
    print(f"{'':28}{'p50 µs':>10}{'p99 µs':>10}{'seq req/s':>12}{'64-in-flight req/s':>20}")
    rows = [
        ("raw pyzmq REQ/REP", "rep"),
        ("raw pyzmq DEALER/ROUTER", "router"),
        ("kvtrio (sync client)", "kvtrio"),
        ("kvtrio tcp, no auth", "tcp-plain"),
        ("kvtrio tcp, CURVE", "tcp-curve"),
    ]
    if args.baseline_src is not None:
        rows.append(("kvtrio baseline server", "baseline"))
    for label, kind in rows:
        win = f"{med(kind, 'win_rps'):>20,.0f}" if kind != "rep" else f"{'-':>20}"
        print(
            f"{label:28}{med(kind, 'p50') * 1e6:>10.1f}{med(kind, 'p99') * 1e6:>10.1f}"
            f"{med(kind, 'seq_rps'):>12,.0f}{win}"
        )
    p50 = med("kvtrio", "p50")
    rps = med("kvtrio", "win_rps")
    print()
    print(f"kvtrio p50 / raw REQ/REP p50:         {p50 / med('rep', 'p50'):.2f}×  (target ≤ 1.5×)")
    print(f"kvtrio p50 / raw DEALER/ROUTER p50:   {p50 / med('router', 'p50'):.2f}×")
    print(
        f"kvtrio / raw 64-in-flight throughput: {rps / med('router', 'win_rps'):.2f}  "
        f"(kvtrio {rps:,.0f} req/s, target ≥ 30,000)"
    )
    curve_p50, plain_p50 = med("tcp-curve", "p50"), med("tcp-plain", "p50")
    print(
        f"CURVE / plain tcp:                    p50 {curve_p50 / plain_p50:.3f}×  "
        f"({(curve_p50 - plain_p50) * 1e6:+.1f} µs), 64-in-flight throughput "
        f"{med('tcp-curve', 'win_rps') / med('tcp-plain', 'win_rps'):.3f}×"
    )
    request_path_table(med)
    if args.baseline_src is not None:
        base_p50, base_rps = med("baseline", "p50"), med("baseline", "win_rps")
        print(
            f"kvtrio / baseline server:             p50 {p50 / base_p50:.3f}×  "
            f"({(p50 - base_p50) * 1e6:+.1f} µs), 64-in-flight throughput {rps / base_rps:.3f}×"
        )


def request_path_table(med: Callable[[str, str], float]) -> None:
    rep, router = med("rep", "p50"), med("router", "p50")
    print(f"\nrequest path (sync client){'p50 µs':>12}{'/ REQ/REP':>11}{'/ DEALER':>10}  target")
    rows = [
        ("ping", "ping", "≤ 1.5× REQ/REP"),
        ("lookup 1 chunk, blocking", "lookup1", "≤ 2×"),
        ("lookup 1 chunk, spinning", "lookup1spin", "≤ 2×"),
        ("lookup 128 chunks, blocking", "lookup128", "≤ 3×"),
        ("lookup 128 chunks, spinning", "lookup128spin", "≤ 3×"),
    ]
    for label, key, target in rows:
        value = med("kvtrio", key)
        print(f"{label:30}{value * 1e6:>8.1f}{value / rep:>11.2f}{value / router:>10.2f}  {target}")
    for chunks in (1, 128):
        hashing = med("kvtrio", f"hashing{chunks}")
        rest = med("kvtrio", f"lookup{chunks}") - hashing
        print(
            f"  of a {chunks}-chunk lookup, the client hashing its tokens: {hashing * 1e6:,.1f} µs;"
            f" the rest {rest * 1e6:,.1f} µs = {rest / rep:.2f}× REQ/REP"
        )
    rps, raw_rps = med("kvtrio", "lookup_rps"), med("router", "win_rps")
    print(
        f"lookups/s, 64 in flight: {rps:,.0f} ({rps / raw_rps:.2f} of raw DEALER/ROUTER "
        f"{raw_rps:,.0f}; targets ≥ 15,000 and ≥ 0.5)"
    )
    one = med("kvtrio", "lookup1")
    burst = med("kvtrio", "burst")
    print(
        f"burst of 64 new requests: scheduler time {burst * 1e6:,.0f} µs = "
        f"{burst / one:.1f}× one blocking lookup round trip (target ≤ 3×)"
    )
    print(f"\nping, who costs what{'p50 µs':>18}{'client CPU µs':>15}{'server CPU µs':>15}")
    shares = [
        ("raw DEALER → raw ROUTER", "kvecho", ""),
        ("raw DEALER → kvtrio serve", "kvtrio", "raw_"),
        ("kvtrio client → raw ROUTER", "kvecho", "kv_"),
        ("kvtrio client → kvtrio serve", "kvtrio", ""),
    ]
    for label, kind, prefix in shares:
        print(
            f"{label:30}{med(kind, prefix + 'ping') * 1e6:>8.1f}"
            f"{med(kind, prefix + 'ping_client_cpu') * 1e6:>15.1f}"
            f"{med(kind, prefix + 'ping_server_cpu') * 1e6:>15.1f}"
        )
    print("(CPU of each whole process, libzmq's I/O thread included)")


if __name__ == "__main__":
    main()
