"""``bench/serve.py``'s parts that need no engine: the workloads it writes for vLLM's benchmark
client (Mooncake prefix groups kept whole, multi-turn histories that grow, in request order)
and what it reads back (vLLM's metrics, its OpenMP binding line, the connector's account).
The bench itself runs in the ``vllm-cpu`` environment (``docs/vllm.md`` §12)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch) -> tuple[ModuleType, ModuleType]:
    monkeypatch.syspath_prepend(str(BENCH))
    import _serve_workloads
    import serve

    return _serve_workloads, serve


def write_trace(path: Path) -> Path:
    rows = [
        # group A (first block 0): three rows sharing blocks 0 and 1
        {"timestamp": 1000, "input_length": 1100, "output_length": 40, "hash_ids": [0, 1, 2]},
        {"timestamp": 1500, "input_length": 600, "output_length": 8, "hash_ids": [10]},
        {"timestamp": 2000, "input_length": 1024, "output_length": 400, "hash_ids": [0, 1]},
        {"timestamp": 2600, "input_length": 700, "output_length": 1, "hash_ids": [20, 21]},
        {"timestamp": 3000, "input_length": 1500, "output_length": 4, "hash_ids": [0, 1, 3]},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_mooncake_slice_keeps_prefix_groups_whole_and_in_order(
    bench: tuple[ModuleType, ModuleType], tmp_path: Path
) -> None:
    workloads, _ = bench
    trace = write_trace(tmp_path / "trace.jsonl")
    for seed in range(20):
        rows = workloads.mooncake_slice(
            trace, 2, seed, token_scale=1 / 16, output_scale=1 / 4, max_input=80, max_output=64
        )
        firsts = [r["hash_ids"][0] for r in rows]
        if 0 in firsts:  # a group is all in or all out
            assert firsts.count(0) == 3
        assert rows[0]["timestamp"] == 0
        assert [r["timestamp"] for r in rows] == sorted(r["timestamp"] for r in rows)
        for row in rows:
            assert 1 <= row["input_length"] <= 80
            assert 2 <= row["output_length"] <= 64
    everything = workloads.mooncake_slice(
        trace, 99, 0, token_scale=1 / 16, output_scale=1 / 4, max_input=80, max_output=64
    )
    assert [r["timestamp"] for r in everything] == [0, 500, 1000, 1600, 2000]
    assert [r["input_length"] for r in everything] == [69, 38, 64, 44, 80]  # 1500/16 capped
    assert [r["output_length"] for r in everything] == [10, 2, 64, 2, 2]


def test_multiturn_histories_grow_and_users_take_turns(
    bench: tuple[ModuleType, ModuleType],
) -> None:
    workloads, _ = bench
    rows = workloads.multiturn_rows(
        10, 7, 2.0, turns=3, system_blocks=4, user_blocks=2, reply_blocks=1, output_tokens=5
    )
    assert [r["user"] for r in rows] == [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]
    last: dict[int, list[int]] = {}
    seen: set[int] = set()
    for row in rows:
        ids = row["hash_ids"]
        assert ids[:4] == [0, 1, 2, 3]  # one system prompt for every user
        assert row["input_length"] == 32 * len(ids)
        assert row["output_length"] == 5
        if row["user"] in last:  # this turn's prompt extends the previous one, and its reply
            previous = last[row["user"]]
            assert ids[: len(previous)] == previous
            assert len(ids) == len(previous) + 1 + 2
        assert not seen & set(ids[-2:])  # the new message is new
        seen |= set(ids[4:])
        last[row["user"]] = ids
    times = [r["timestamp"] for r in rows]
    assert times[0] == 0
    assert times == sorted(times)
    assert workloads.multiturn_rows(10, 7, 2.0) == workloads.multiturn_rows(10, 7, 2.0)


def test_what_the_bench_reads_from_vllm_and_the_connector(
    bench: tuple[ModuleType, ModuleType],
) -> None:
    _, serve = bench
    metrics = serve.prometheus(
        "# HELP x\n"
        'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 64.0\n'
        'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 128.0\n'
        'vllm:external_prefix_cache_hits_total{engine="0"} 32.0\n'
        "vllm:something_else 5\n"
    )
    assert metrics["vllm:prefix_cache_hits_total"] == 64
    assert metrics["vllm:prefix_cache_queries_total"] == 128
    assert metrics["vllm:external_prefix_cache_hits_total"] == 32
    timed = serve.prometheus(
        'vllm:request_queue_time_seconds_sum{engine="0"} 1.5\n'
        'vllm:request_queue_time_seconds_count{engine="0"} 10.0\n'
        'vllm:request_queue_time_seconds_bucket{engine="0",le="0.3"} 10.0\n'
        'vllm:time_to_first_token_seconds_sum{engine="0"} 3.0\n'
        'vllm:time_to_first_token_seconds_count{engine="0"} 10.0\n'
    )
    assert serve.timings_ms(timed) == {"engine_ttft": 300.0, "queue": 150.0}
    log = (
        "INFO 2026-11-28 04:16:29,646 [vllm.utils.ompmultiprocessing] OpenMP thread binding "
        "info: \n\tVLLM_CPU_OMP_THREADS_BIND='0', auto_setup=False, skip_setup=False\n"
        "\tlocal_world_size=1, reserve_cpu_num=1\n\tlocal_rank=0, core ids=[0]\n"
        "\treserved_cpus=[]\nINFO next line\n"
        "INFO [kvtrio] kvtrio: a hit of 256 tokens (request r1) is computed, not loaded: "
        "loading takes ~9.0 ms, computing ~5.0 ms here\n"
        "INFO [kvtrio] kvtrio load policy: {'loads': 3, 'skipped': 1, 'skipped_tokens': 256}\n"
    )
    assert serve.omp_binding(log) == [
        "OpenMP thread binding info: VLLM_CPU_OMP_THREADS_BIND='0', auto_setup=False, "
        "skip_setup=False local_world_size=1, reserve_cpu_num=1 local_rank=0, core ids=[0] "
        "reserved_cpus=[]"
    ]
    account = serve.connector_counters(log)
    assert account["loads"] == 3
    assert account["skipped"] == 1
    assert account["skip_reasons"] == ["loading takes ~9.0 ms, computing ~5.0 ms here"]
    assert serve.connector_counters("nothing") == {}
    assert serve.connector_counters('kvtrio load policy: {"loads": 2, "on": true}')["loads"] == 2
    stats = (
        "INFO [loggers.py] KV Transfer metrics: loads=3, split=1, skipped_idle=2, judged=4, "
        "regret=1\nINFO other\nINFO [loggers.py] KV Transfer metrics: loads=2, judged=2\n"
    )
    assert serve.interval_counters(stats) == {
        "loads": 5, "split": 1, "skipped_idle": 2, "judged": 6, "regret": 1
    }  # fmt: skip
    row = {"case": "l1", "policy": serve.interval_counters(stats)}
    assert (serve._decisions(row), serve._regret(row)) == ("5/1/2", "1/6")


def test_the_summary_gives_medians_and_spreads(bench: tuple[ModuleType, ModuleType]) -> None:
    _, serve = bench
    runs = [
        {"workload": "random", "rate": 0.5, "case": case, "failed": 0,
         "median_ttft_ms": t, "p99_ttft_ms": 2 * t, "median_itl_ms": 10, "p99_itl_ms": 20,
         "request_throughput": 0.5, "output_throughput": 16, "vllm_hit_ratio": 0.0,
         "external_hit_ratio": 0.0}
        for case, t in (("vllm", 100), ("vllm", 300), ("vllm", 200), ("l1", 150))
    ]  # fmt: skip
    rows = serve.summarize(runs)
    assert [(r["case"], r["runs"]) for r in rows] == [("vllm", 3), ("l1", 1)]
    assert rows[0]["median_ttft_ms"] == {"median": 200, "min": 100, "max": 300}
    lines = serve.table(rows)
    assert "200 (100–300)" in lines[2]
    assert sys.modules["serve"] is serve


def test_the_sustained_rate_is_the_last_rate_under_ten_times_the_unloaded_ttft(
    bench: tuple[ModuleType, ModuleType],
) -> None:
    """vLLM alone's TTFT p50 at the lowest rate is the unloaded TTFT (50 ms: limit 500 ms); a
    case sustains each rate up to the first whose p99 passes the limit."""
    _, serve = bench
    p99s = {"vllm": (300, 2_000, 400), "l1": (200, 450, 5_000), "l1+disk": (900, 100, 100)}
    runs = [
        {"workload": "multiturn", "rate": rate, "case": case, "failed": 0,
         "median_ttft_ms": 50, "p99_ttft_ms": p99, "median_itl_ms": 10, "p99_itl_ms": 20,
         "request_throughput": rate, "output_throughput": 16, "vllm_hit_ratio": 0.0,
         "external_hit_ratio": 0.0}
        for case, values in p99s.items()
        for rate, p99 in zip((2, 4, 8), values, strict=True)
    ]  # fmt: skip
    (found,) = serve.sustained(serve.summarize(runs))
    assert found["limit_ms"] == 500
    assert found["rates"] == {"vllm": 2, "l1": 4, "l1+disk": None}
    assert found["ratios"]["l1"] == 2.0
    (_, line) = serve.sustained_lines([found])
    assert "2/s vllm, 4/s (2.00×) l1, <lowest l1+disk" in line


def test_where_the_ttft_goes_is_split_by_vllms_histograms(
    bench: tuple[ModuleType, ModuleType],
) -> None:
    """Per case the medians of each run's mean client TTFT, vLLM's TTFT, its queue and prefill,
    and the API server's rest; ``vllm-big`` (vLLM with kvtrio's L1 as its own KV cache) sits
    beside vLLM alone."""
    _, serve = bench
    runs = [
        {"workload": "multiturn", "rate": 5, "case": case, "failed": 0,
         "median_ttft_ms": 90, "p99_ttft_ms": 500, "median_itl_ms": 10, "p99_itl_ms": 20,
         "request_throughput": 5, "output_throughput": 16, "vllm_hit_ratio": 0.5,
         "external_hit_ratio": 0.0, "mean_ttft_ms": client,
         "timings_ms": {"engine_ttft": engine, "queue": queue, "prefill": 60.0},
         "policy": {"hook_us": 5000, "worker_hook_us": 1000, "requests": 4} if case == "l1"
         else {},
         "cpu_ms_per_request": {"vllm": 44.0 if case == "l1" else 40.0,
                                "kvtrio_serve": 2.5 if case == "l1" else 0.0}}
        for case, client, engine, queue in (
            ("l1", 110.0, 100.0, 30.0), ("vllm", 95.0, 90.0, 20.0), ("vllm-big", 80.0, 75.0, 5.0)
        )
    ]  # fmt: skip
    rows = serve.summarize(runs)
    assert [r["case"] for r in rows] == ["vllm", "vllm-big", "l1"]
    lines = serve.timing_lines(rows)
    assert lines[3].split() == [
        "multiturn", "5", "vllm", "95", "90", "20", "60", "10", "-", "-", "40.0", "ms", "0.0", "ms"
    ]  # fmt: skip
    assert lines[5].split() == [
        "multiturn", "5", "l1", "110", "100", "30", "60", "10", "1.25", "ms", "0.25", "ms",
        "44.0", "ms", "2.5", "ms",
    ]  # fmt: skip
    assert serve.parse_args(["--workloads", "random"]).cases == ["vllm", "l1", "l1+disk"]
    assert os.getpid() in serve.process_tree(os.getpid())
    assert serve.cpu_seconds([os.getpid()]) > 0


def test_the_cases_that_switch_kvtrio_parts_off_are_valid_connector_options(
    bench: tuple[ModuleType, ModuleType],
) -> None:
    from kvtrio.integration._options import parse_options

    _, serve = bench
    assert set(serve.CASE_CONFIG) <= set(serve.KVTRIO_CASES) <= set(serve.CASES)
    idle = parse_options(serve.CASE_CONFIG["l1-idle"])
    assert (idle.load, idle.save) == (False, False)
    nosave = parse_options(serve.CASE_CONFIG["l1-nosave"])
    assert (nosave.load, nosave.save) == (True, False)
    noload = parse_options(serve.CASE_CONFIG["l1-noload"])
    assert (noload.load, noload.save) == (False, True)
    args = serve.parse_args(["--cases", "vllm", "l1", "l1-idle", "l1-nosave", "l1-noload"])
    assert args.cases == ["vllm", "l1", "l1-idle", "l1-nosave", "l1-noload"]


def test_a_variant_is_l1_with_its_options_and_kvtrio_serves_niceness(
    bench: tuple[ModuleType, ModuleType], capsys: pytest.CaptureFixture[str]
) -> None:
    _, serve = bench
    args = serve.parse_args([
        "--variant", "slow", '{"kvtrio.lookup_wait": 0, "serve_nice": 10, "threads_nice": 5}',
        "--variant", "late", '{"kvtrio.async_load": false}',
        "--cases", "vllm", "slow", "late", "l1-nosave",
    ])  # fmt: skip
    assert args.cases == ["vllm", "slow", "late", "l1-nosave"]
    assert args.variant["slow"] == {"kvtrio.lookup_wait": 0, "serve_nice": 10, "threads_nice": 5}
    bad = (
        ["--cases", "vllm", "nope"],  # neither a case nor a variant
        ["--variant", "l1", "{}"],  # a case's name
        ["--variant", "x", "[1]"],  # not an object
        ["--variant", "x", "{"],  # not JSON
        ["--variant", "x", '{"nice": 1}'],  # neither an option nor the bench's
    )
    for argv in bad:
        with pytest.raises(SystemExit):
            serve.parse_args(argv)
        assert "--" in capsys.readouterr().err
    runs = [{"case": c} for c in ("late", "l1", "vllm", "slow", "l1")]
    assert serve.case_order(runs) == ["vllm", "l1", "late", "slow"]


def test_paired_ttft_compares_each_request_with_itself_under_vllm_alone(
    bench: tuple[ModuleType, ModuleType],
) -> None:
    _, serve = bench

    def run(case: str, rep: int, ttfts: list[float], lens: list[int] | None = None) -> dict:
        return {"workload": "multiturn", "rate": 2, "case": case, "repetition": rep,
                "ttfts_ms": ttfts, "input_lens": lens or [100] * len(ttfts)}  # fmt: skip

    runs = [
        run("vllm", 0, [50, 60, 70, 80]),
        run("l1", 0, [55, 58, 75, 86]),  # +5 -2 +5 +6
        run("vllm", 1, [100, 100]),
        run("l1", 1, [101, 99]),  # +1 -1
        run("l1+disk", 1, [1, 2], lens=[7, 7]),  # not the same requests: no pairs
        run("l1-nosave", 2, [1, 2]),  # no vLLM-alone run in its repetition
    ]
    (row,) = serve.paired_ttft(runs)
    assert (row["case"], row["pairs"]) == ("l1", 6)
    assert row["median_ms"] == 3  # of -2 -1 +1 +5 +5 +6
    assert row["slower"] == 4 / 6
    assert row["per_repetition_ms"] == [5, 0]
    (_, _, line) = serve.paired_lines([row])
    assert "6 pairs:   +3.0" in line
    assert "67% slower; per repetition +5.0, +0.0" in line
    assert serve.paired_lines([]) == []
