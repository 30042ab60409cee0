"""A hostile key's largest legal messages against a victim's pings (issue 22, items 2 and 6).

    python bench/hostile.py [--repeats 3] [--issue] [--l2 disk|none] [--out FILE.json]

Starts a real ``kvtrio serve`` (disk L2 in a temporary directory, as on the defaults) and two
clients of their own processes: a **victim** that pings the server back to back (2 ms apart)
for the whole run, and a **hostile** client that registers rank 0 of a model and sends, one
kind at a time, the largest message of each kind the server accepts:

* ``commit`` and ``release`` of ``MAX_HASHES`` chunk hashes it never stored or retrieved;
* ``store`` whose range has one chunk more than its ``MAX_HASHES`` hashes (a count mismatch);
* ``lookup`` of ``MAX_HASHES`` hashes at world size 1, and of ``MAX_LOOKUP_KEYS / world`` at
  the world size limit (``MAX_WORLD_SIZE``);
* ``lookup_batch`` of ``MAX_LOOKUP_BATCH`` lookups sharing ``MAX_LOOKUP_KEYS`` keys, at world
  size 1 and at the world size limit;
* L1 hits: a ``store`` reserving ``MAX_HASHES`` slots, their ``commit``, a ``lookup`` of them
  all (``MAX_HASHES`` pins) and a ``lookup_batch`` of ``MAX_LOOKUP_KEYS`` of them (as many pins).

The random hashes of the other lookups miss, so each lookup also probes the disk L2.

(The bounds are read from ``kvtrio.protocol``; a tree without them, such as the one before
issue 22, gets this tree's values, given on the command line, so both trees see the same
messages.) ``--issue`` adds the messages of the issue's report (900k hashes, 1,024 × 880,
and 32 lookups × 63 hashes at world 4,096), which the bounds now refuse.

For each kind, over ``--repeats`` messages: the median time the message took (send to reply,
on the hostile's side) and the victim's worst and median ping among the pings that overlapped
the message, plus what the server answered (a reply, or an error's code). Run it with
``PYTHONPATH`` naming the tree to measure (e.g. a worktree at 04cca5e for the before figures).
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

from kvtrio import protocol
from kvtrio.client import Client
from kvtrio.errors import KvtrioError, ServerError
from kvtrio.launch import launch_server
from kvtrio.protocol import (
    HASH_SCHEME_TOKENS,
    Commit,
    LayoutSpec,
    Lookup,
    LookupBatch,
    Register,
    Release,
    Request,
    Store,
)

CHUNK = 256
LAYOUT = LayoutSpec("flash_attn", 2, 64, 16, 1, 16, "float16")
SCHEME = HASH_SCHEME_TOKENS

VICTIM = r"""
import json, os, sys, time
from kvtrio.client import Client
from kvtrio.protocol import Ping
endpoint, stop = sys.argv[1], sys.argv[2]
pings, errors = [], []
with Client(endpoint, timeout=300, client_name="victim") as client:
    client.request(Ping())
    print("ready", flush=True)
    while not os.path.exists(stop):
        start = time.monotonic()
        try:
            client.request(Ping())
        except Exception as exc:
            errors.append([start, repr(exc)])
        pings.append([start, time.monotonic() - start])
        time.sleep(0.002)
print(json.dumps({"pings": pings, "errors": errors}))
"""


def _hashes(count: int, salt: int) -> tuple[bytes, ...]:
    prefix = salt.to_bytes(4, "little")
    return tuple(prefix + i.to_bytes(12, "little") for i in range(count))


def messages(args: argparse.Namespace) -> list[tuple[str, int, list[Request]]]:
    """(kind, world size, one message per repeat) of every kind measured."""
    hashes, keys, world, batch = args.max_hashes, args.max_keys, args.max_world, args.max_batch
    out: list[tuple[str, int, list[Request]]] = []
    r = range(args.repeats)
    out.append(("commit", 1, [Commit(f"c{i}", _hashes(hashes, 10 + i)) for i in r]))
    out.append(("release", 1, [Release(f"c{i}", _hashes(hashes, 20 + i)) for i in r]))
    out.append(
        (
            "store mismatch",
            1,
            [Store(f"s{i}", 0, CHUNK * (hashes + 1), _hashes(hashes, 30 + i)) for i in r],
        )
    )
    out.append(("lookup", 1, [Lookup(f"l{i}", "m", 1, _hashes(hashes, 40 + i)) for i in r]))
    per = max(1, keys // batch)
    out.append(("lookup_batch", 1, [_batch(1, batch, per, 50 + i) for i in r]))
    # L1 hits: the hostile stores and commits MAX_HASHES chunks, then looks them up (pins).
    stored = _hashes(hashes, 90)
    out.append(("store (reserves all)", 1, [Store("hit", 0, CHUNK * hashes, stored)]))
    out.append(("commit (owned)", 1, [Commit("hit", written=stored)]))
    out.append(("lookup, all hits", 1, [Lookup(f"h{i}", "m", 1, stored) for i in r]))
    hit_batch = max(1, keys // hashes)
    out.append(
        (
            "lookup_batch, all hits",
            1,
            [
                LookupBatch(
                    "m", 1, tuple(f"hb{i}-{j}" for j in range(hit_batch)), (stored,) * hit_batch
                )
                for i in r
            ],
        )
    )
    out.append(
        (
            f"lookup@{world}",
            world,
            [Lookup(f"w{i}", "m", world, _hashes(keys // world, 60 + i)) for i in r],
        )
    )
    lookups = max(1, min(batch, keys // world))
    per = max(1, keys // (world * lookups))
    out.append((f"lookup_batch@{world}", world, [_batch(world, lookups, per, 70 + i) for i in r]))
    if args.issue:
        big = 900_000
        out.append(("issue commit 900k", 1, [Commit("x", _hashes(big, 80))]))
        out.append(("issue release 900k", 1, [Release("x", _hashes(big, 81))]))
        out.append(("issue store mismatch 900k", 1, [Store("x", 0, CHUNK * (big + 1),
                                                           _hashes(big, 82))]))  # fmt: skip
        out.append(("issue lookup 900k", 1, [Lookup("x", "m", 1, _hashes(big, 83))]))
        out.append(("issue lookup_batch 1024x880", 1, [_batch(1, 1024, 880, 84)]))
        out.append(("issue lookup_batch@4096 32x63", 4096, [_batch(4096, 32, 63, 85)]))
    return out


def _batch(world: int, lookups: int, per: int, salt: int) -> LookupBatch:
    requests = tuple(f"b{salt}-{j}" for j in range(lookups))
    hashes = tuple(_hashes(per, salt * 10_000 + j) for j in range(lookups))
    return LookupBatch("m", world, requests, hashes)


def run(args: argparse.Namespace) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix="kvtrio-hostile-"))
    l2 = ["--l2", f"disk:path={workdir}/l2"] if args.l2 == "disk" else ["--l2", "none"]
    stop = workdir / "stop"
    results: dict[str, Any] = {}
    serve_args = ("--l1-size", "1GiB", "--log-level", "warning", *l2)
    with launch_server(*serve_args) as server:
        victim = subprocess.Popen(
            [sys.executable, "-c", VICTIM, server.endpoint, str(stop)],
            stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert victim.stdout is not None
        assert victim.stdout.readline().strip() == "ready"
        windows: list[tuple[str, float, float]] = []
        answers: dict[str, list[str]] = {}
        durations: dict[str, list[float]] = {}
        registered = 0
        with Client(server.endpoint, timeout=600, client_name="hostile") as hostile:
            for kind, world, requests in messages(args):
                if world != registered:
                    try:
                        hostile.request(Register("", "m", world, 0, LAYOUT, SCHEME))
                        registered = world
                    except ServerError as exc:
                        answers[kind] = [f"register refused: {exc.code.value}"]
                        continue
                time.sleep(0.2)  # the victim's pings in between are the baseline
                for request in requests:
                    start = time.monotonic()
                    try:
                        reply = hostile.request(request)
                        answer = type(reply).__name__
                        failed = getattr(reply, "failed", ())
                        if failed:
                            answer += f" ({len(failed)} failed: {failed[0].message[:80]})"
                    except ServerError as exc:
                        answer = f"{exc.code.value}: {str(exc)[:100]}"
                    except KvtrioError as exc:
                        answer = f"client error: {exc!r}"[:120]
                    end = time.monotonic()
                    windows.append((kind, start, end))
                    durations.setdefault(kind, []).append(end - start)
                    answers.setdefault(kind, []).append(answer)
            time.sleep(0.2)
        stop.touch()
        out, _ = victim.communicate(timeout=600)
    report = json.loads(out.strip().splitlines()[-1])
    pings = report["pings"]
    for kind in answers:
        spans = [(s, e) for k, s, e in windows if k == kind]
        overlapping = [rtt for t, rtt in pings if any(t <= e and t + rtt >= s for s, e in spans)]
        results[kind] = {
            "message_s": statistics.median(durations[kind]) if kind in durations else None,
            "victim_worst_ms": max(overlapping) * 1e3 if overlapping else None,
            "victim_median_ms": statistics.median(overlapping) * 1e3 if overlapping else None,
            "victim_pings": len(overlapping),
            "answers": sorted(set(answers[kind])),
        }
    all_rtts = [rtt for _, rtt in pings]
    results["victim, whole run"] = {
        "victim_worst_ms": max(all_rtts) * 1e3,
        "victim_median_ms": statistics.median(all_rtts) * 1e3,
        "victim_pings": len(all_rtts),
        "victim_errors": report["errors"][:3],
    }
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--issue", action="store_true", help="also the issue's own messages")
    parser.add_argument("--l2", choices=("disk", "none"), default="disk")
    parser.add_argument("--max-hashes", type=int, default=getattr(protocol, "MAX_HASHES", 8192))
    parser.add_argument(
        "--max-keys", type=int, default=getattr(protocol, "MAX_LOOKUP_KEYS", 1 << 16)
    )
    parser.add_argument("--max-world", type=int, default=getattr(protocol, "MAX_WORLD_SIZE", 256))
    parser.add_argument("--max-batch", type=int, default=protocol.MAX_LOOKUP_BATCH)
    parser.add_argument("--out", type=Path, help="also write the figures here (JSON)")
    args = parser.parse_args()
    results = run(args)
    print(f"kvtrio from {os.path.dirname(protocol.__file__)}; {args.repeats} messages per kind")
    print(
        f"bounds: {args.max_hashes} hashes, {args.max_keys} lookup keys, world "
        f"{args.max_world}, {args.max_batch} lookups per batch"
    )
    print(f"{'kind':<32} {'message s':>10} {'worst ms':>9} {'median ms':>9}  answer")
    for kind, row in results.items():
        seconds = row.get("message_s")
        shown = f"{seconds:>10.3f}" if seconds is not None else f"{'-':>10}"
        worst = row["victim_worst_ms"]
        median = row["victim_median_ms"]
        print(
            f"{kind:<32} {shown} {worst if worst is not None else float('nan'):>9.1f} "
            f"{median if median is not None else float('nan'):>9.1f}  "
            f"{'; '.join(row.get('answers', [])) or row.get('victim_errors', '')}"
        )
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
