"""``kvtrio bench`` as a user runs it, in short configurations: every retrieved byte checked, and
the hit ratio equal to the one this test computes on its own from the workload's definition.

With one conversation (or trace request) in flight at a time, and a cache that loses nothing (L1
large enough, or an L2 behind it), a chunk is a hit exactly when an earlier request had the same
prefix up to that chunk's end: the hit ratio of an unbounded prefix cache, computed here with
plain sets.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from kvtrio.benchmark import BenchError, BenchOptions, run_bench

from .._support.command import KVTRIO

SMALL_ENGINE = ("--world-size", "2", "--layers", "2", "--heads", "2", "--head-dim", "16")


def bench(tmp_path: Path, *args: str) -> dict[str, Any]:
    out = tmp_path / "result.json"
    run = subprocess.run(
        [KVTRIO, "bench", *SMALL_ENGINE, "--json", str(out), *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "checksum failures" in run.stdout  # the table
    return dict(json.loads(out.read_text()))


def hits_of_an_unbounded_cache(prompts: list[list[Any]], chunk: int) -> tuple[int, int, int]:
    """(hit chunks, full chunks, prompt tokens) of prompts looked up, then stored, in order.
    A prompt is a list of hashable token stand-ins."""
    stored: set[tuple[Any, ...]] = set()
    hits = chunks = tokens = 0
    for prompt in prompts:
        prefixes = [tuple(prompt[: (k + 1) * chunk]) for k in range(len(prompt) // chunk)]
        found = 0
        while found < len(prefixes) and prefixes[found] in stored:
            found += 1
        stored.update(prefixes)
        hits, chunks, tokens = hits + found, chunks + len(prefixes), tokens + len(prompt)
    return hits, chunks, tokens


def test_multi_turn_conversations_hit_what_an_unbounded_prefix_cache_would(
    tmp_path: Path,
) -> None:
    convs, systems, system, user, answer, turns, chunk = 6, 2, 600, 100, 150, 3, 256
    result = bench(
        tmp_path,
        *("--conversations", str(convs), "--system-prompts", str(systems)),
        *("--system-tokens", str(system), "--user-tokens", str(user)),
        *("--output-tokens", str(answer), "--turns", str(turns), "--concurrency", "1"),
        *("--chunk-size", str(chunk), "--l1-size", "64MiB", "--l2", "none"),
    )
    # The workload as documented: conversation c uses system prompt c % systems; turn t's
    # prompt is the system prompt, the earlier turns' user messages and answers, and its own
    # user message. Token stand-ins name where each token comes from.
    prompts = []
    for c in range(convs):
        history: list[Any] = [("system", c % systems, i) for i in range(system)]
        for t in range(turns):
            history += [("user", c, t, i) for i in range(user)]
            prompts.append(list(history))
            history += [("answer", c, t, i) for i in range(answer)]
    hits, chunks, tokens = hits_of_an_unbounded_cache(prompts, chunk)

    assert result["checksum_failures"] == 0
    assert result["failed_blocks"] == 0
    assert result["retrieved_blocks"] == hits * chunk // 16 * 2  # 16-token blocks, 2 ranks
    assert (result["hit_chunks"], result["chunks"], result["prompt_tokens"]) == (
        hits,
        chunks,
        tokens,
    )
    assert result["hit_ratio_tokens"] == hits * chunk / tokens
    assert (result["l1_hit_chunks"], result["l2_hit_chunks"]) == (hits, 0)
    assert result["requests"] == convs * turns
    assert result["latency_seconds"]["retrieve"]["count"] > 0


def synthetic_trace(path: Path) -> list[dict[str, Any]]:
    """Mooncake-format requests: a few shared document prefixes, each continued differently,
    some repeated whole, partial last blocks."""
    rows, next_id = [], 1000
    documents = [list(range(d * 100, d * 100 + 3 + d)) for d in range(3)]  # 3-5 blocks each
    for i in range(24):
        ids = list(documents[i % 3])
        if i % 4 != 3:  # every fourth request repeats its document alone
            own = 1 + i % 3
            ids += list(range(next_id, next_id + own))
            next_id += own
        length = len(ids) * 512 - (i * 37) % 400  # the last block is partial
        rows.append(
            {"timestamp": i * 10, "input_length": length, "output_length": 5, "hash_ids": ids}
        )
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return rows


def test_mooncake_trace_replay_hits_what_an_unbounded_prefix_cache_would(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    rows = synthetic_trace(trace)
    chunk = 256
    # A small L1 (evictions) with an L2 behind it that gets every chunk: nothing is lost, so
    # the hit ratio is still the unbounded cache's, and some hits come from L2. (At 2MiB the
    # write-behind queue, a quarter of L1's bytes, is smaller than one request's store, and
    # skips some chunks.)
    result = bench(
        tmp_path,
        *("--trace", str(trace), "--concurrency", "1", "--chunk-size", str(chunk)),
        *("--l1-size", "2560KiB", "--l2", "memory", "--l2-admission", "all", "--speed", "100"),
    )
    # Token i of a request lies in the 512-token block hash_ids[i // 512]: that id names the
    # block and everything before it, so (id, place in the block) names the token's prefix.
    prompts = [
        [(row["hash_ids"][i // 512], i % 512) for i in range(row["input_length"])] for row in rows
    ]
    hits, chunks, tokens = hits_of_an_unbounded_cache(prompts, chunk)
    assert hits > 0
    assert result["checksum_failures"] == 0
    assert result["failed_blocks"] == 0
    assert (result["hit_chunks"], result["chunks"], result["prompt_tokens"]) == (
        hits,
        chunks,
        tokens,
    ), result["server"]
    assert result["hit_ratio_chunks"] == hits / chunks
    assert result["l1_hit_chunks"] + result["l2_hit_chunks"] == hits
    assert result["l2_hit_chunks"] > 0


def test_a_bad_trace_is_one_line_of_error(tmp_path: Path) -> None:
    trace = tmp_path / "bad.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 10}\n')
    run = subprocess.run(
        [KVTRIO, "bench", "--trace", str(trace)], capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 2
    assert run.stderr.startswith("kvtrio bench: error: ")
    assert "bad.jsonl:1: expected {timestamp, input_length, hash_ids}" in run.stderr
    assert "Traceback" not in run.stdout + run.stderr


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (BenchOptions(heads=3), "cannot be split over --world-size 2"),
        (BenchOptions(chunk_size=100), "must be a multiple of --block-size"),
        (BenchOptions(trace=Path("/nonexistent.jsonl")), "no such file"),
        (BenchOptions(l1_size="lots"), "--l1-size"),
    ],
)
def test_settings_that_cannot_work_are_refused_before_starting(
    options: BenchOptions, message: str
) -> None:
    with pytest.raises(BenchError, match=message):
        run_bench(options)


def test_the_bench_directory_is_removed_with_its_l2_segments(tmp_path: Path) -> None:
    from kvtrio.benchmark._run import _remove_tree

    workdir = tmp_path / "kvtrio-bench-x"
    (workdir / "l2" / "segments").mkdir(parents=True)
    for i in range(3):
        (workdir / "l2" / "segments" / f"{i:016x}.seg").write_bytes(b"x")
    (workdir / "server.log").write_text("log")
    _remove_tree(workdir)
    assert not workdir.exists()
    _remove_tree(workdir)  # (gone already: nothing to do, no error)
