"""What ``kvtrio bench`` prints: the engine's shape as the flags say it, the settings, the files
it wrote, and the partial table of an interrupted run."""

from __future__ import annotations

import json
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from kvtrio.benchmark import BenchError, BenchOptions, run_bench
from kvtrio.client import Client
from kvtrio.launch import ServerProcess
from kvtrio.protocol import GetStats, StatsReply

from .._support.command import KVTRIO, run
from .._support.waiting import wait_for

SMALL = ("--world-size", "2", "--layers", "2", "--heads", "2", "--head-dim", "16")
SHORT = ("--conversations", "2", "--turns", "2", "--system-tokens", "300", "--no-progress")


def test_output_names_heads_settings_and_the_files_written(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    plot, out = tmp_path / "bench.png", tmp_path / "bench.json"
    files = ("--plot", str(plot), "--json", str(out))
    run = subprocess.run(
        [KVTRIO, "bench", *SMALL, *SHORT, "--l1-size", "64MiB", "--l2", "none", *files],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    text = " ".join(run.stdout.split())
    assert "2 ranks × 2 layers × 1 KV head per rank (2 in all)" in text
    assert "chunks of 256 tokens, L1 64MiB, L2 none" in text
    assert f"wrote {out}" in text
    assert f"wrote {plot}" in text
    assert plot.stat().st_size > 0


def test_a_bare_number_is_too_small_an_l1() -> None:
    with pytest.raises(BenchError, match="too small"):
        run_bench(BenchOptions(l1_size="512KiB"))
    with pytest.raises(BenchError, match=r"--l1-size: a size without a unit is bytes; did you"):
        run_bench(BenchOptions(l1_size="1"))


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.parametrize(
    "sigint", ["default", "ignored"], ids=["foreground", "sigint-ignored-as-under-nohup"]
)
def test_sigterm_prints_the_partial_table(
    server_process: Callable[..., ServerProcess], sigint: str
) -> None:
    """A process started with SIGINT ignored (nohup, `&` in a script) still stops on SIGTERM
    with the partial table: the bench handles SIGTERM itself."""
    server = server_process()
    # Paced arrivals: 40 conversations at 2 per second take 20 s; the test stops it early.
    command = [KVTRIO, "bench", *SMALL, "--no-progress", "--server", server.endpoint]
    command += ["--conversations", "40", "--turns", "1", "--rate", "2", "--concurrency", "1"]
    bench = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_ignore_sigint if sigint == "ignored" else None,
    )
    try:
        with Client(server.endpoint) as client:

            def some_lookups() -> bool:
                stats = client.call(GetStats(), StatsReply)
                return stats.cache is not None and stats.cache.lookups >= 2

            wait_for(some_lookups, what="the bench to make lookups")
        bench.send_signal(signal.SIGTERM)
        stdout, stderr = bench.communicate(timeout=60)
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.communicate()
    assert bench.returncode == 130, stdout + stderr
    assert "interrupted: " in stdout
    assert "of 40 requests done" in stdout
    assert "checksum failures" in stdout  # the table of what was measured
    assert "Traceback" not in stderr


def test_the_servers_hit_ratio_is_in_the_table_as_kvtrio_status_shows_it(
    server_process: Callable[..., ServerProcess], tmp_path: Path
) -> None:
    """Issue 32: one run, two ratios (status 63.3 %, bench 73.1 %) and no word on why. The
    server counts each prompt's partial last chunk too; the table shows both, and says so."""
    server = server_process()
    out = tmp_path / "bench.json"
    command = [KVTRIO, "bench", *SMALL, *SHORT, "--server", server.endpoint, "--json", str(out)]
    bench = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert bench.returncode == 0, bench.stdout + bench.stderr
    result = json.loads(out.read_text())
    status = json.loads(run("status", "--json", server.endpoint).stdout)["lookups"]
    assert result["l1_hit_chunks"] + result["l2_hit_chunks"] == status["hit_chunks_l1"]
    assert result["server_miss_chunks"] == status["miss_chunks"]  # a fresh server: one run
    assert result["hit_chunks"] == status["hit_chunks_l1"]  # every hit is of full chunks here
    assert result["chunks"] < status["hit_chunks_l1"] + status["miss_chunks"]  # + partial ones
    text = " ".join(bench.stdout.split())
    assert f"server's hit ratio │ {status['hit_ratio']:.1%}" in text
    assert "partial last" in text  # (the detail cell wraps: its words, not the sentence)
    for help_text in (run("status", "--help").stdout, run("bench", "--help").stdout):
        assert "partial last chunk" in " ".join(help_text.split())
