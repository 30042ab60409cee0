"""``kvtrio bench`` end to end: server, engine processes, the run, the report."""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import trio
from rich.console import Console

if sys.version_info < (3, 11):  # pragma: no cover - exercised by the py310 tox env
    from exceptiongroup import BaseExceptionGroup

from ..client import SchedulerAdapter
from ..errors import KvtrioError
from ..launch import ServerProcess, ServerStartError
from ..options import format_size, parse_size
from ..protocol import GetStats, StatsReply
from ..transfer import KVLayout
from ._driver import Driver, engine_blocks
from ._engine import model_name, worker_main
from ._options import BenchError, BenchOptions, options_from_args
from ._report import Progress, print_table, write_plot
from ._results import BenchResult
from ._simulate import simulate_main
from ._workload import Workload, load_workload

__all__ = ["main", "run_bench"]


def main(args: argparse.Namespace) -> int:
    """``kvtrio bench``: run, print the table, write ``--json`` / ``--plot``. Exit status 1 if
    any retrieved byte was wrong, 2 for a bench that could not run."""
    console = Console()
    # A timeout's SIGTERM ends the run like Ctrl-C, and the partial results are still printed.
    # Handled here, not re-sent as SIGINT: a process started with SIGINT ignored (nohup, `&` in
    # a script) would drop that. Before the workload it raises KeyboardInterrupt; during the
    # run, _drive receives it and cancels the run.
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        options = options_from_args(args)
        if options.simulate:
            return simulate_main(options.resolved(), console)
        result = run_bench(options, console)
    except BenchError as exc:
        print(f"kvtrio bench: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("kvtrio bench: interrupted before the workload started", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    print_table(result, console)
    if options.json is not None:
        options.json.write_text(json.dumps(result.to_json(), indent=1) + "\n")
        console.print(f"wrote {options.json}", highlight=False)
    if options.plot is not None:
        write_plot(result, options.plot)
        console.print(f"wrote {options.plot}", highlight=False)
    if result.interrupted:
        return 130
    return 1 if result.checksum_failures else 0


def run_bench(options: BenchOptions, console: Console | None = None) -> BenchResult:
    """Run the bench the options describe; :class:`BenchError` if it cannot run or finish."""
    console = console or Console(quiet=True)
    options = options.resolved()
    options.check()
    workload = load_workload(options)
    with contextlib.ExitStack() as stack:
        endpoint = options.server or stack.enter_context(_own_server(options, console))
        return _run(options, workload, endpoint, console)
    raise AssertionError("unreachable")  # pragma: no cover  (mypy: ExitStack may swallow)


def _run(options: BenchOptions, workload: Workload, endpoint: str, console: Console) -> BenchResult:
    tenant = f"bench-{uuid.uuid4().hex[:12]}"  # runs against one server do not share chunks
    scheduler = SchedulerAdapter(
        endpoint,
        model_name(options),
        options.world_size,
        0,
        options.block_size,
        tenant=tenant,
        timeout=options.timeout,
    )
    try:
        if not scheduler.client.wait_for_server(15.0, while_away=True):
            why = scheduler.client.handshake_error or "nothing answered within 15 s"
            raise BenchError(f"no server at {endpoint}: {why}")
        chunk = scheduler.chunk_size
        if chunk % options.block_size:
            raise BenchError(
                f"the server's chunk size {chunk} is not a multiple of --block-size "
                f"{options.block_size}"
            )
        layout = KVLayout(
            options.layout,
            options.layers,
            1,
            options.block_size,
            1 if options.layout == "mla" else options.heads_per_rank,
            options.head_dim,
            options.dtype,
        )
        block_bytes = layout.layer_nbytes * options.layers
        blocks = engine_blocks(options, workload, chunk, block_bytes)
        result = BenchResult(
            mode=workload.mode,
            workload=workload.describe(),
            engine=_describe_engine(options, blocks),
            endpoint=endpoint,
            chunk_size=chunk,
            world_size=options.world_size,
            settings=_describe_settings(options, chunk),
            speed=options.speed if options.trace is not None else 0.0,
            planned=len(workload.requests),
        )
        with _Sigterm() as term, _workers(options, endpoint, blocks, tenant) as conns:
            before = _stats(scheduler)
            driver = Driver(options, workload, scheduler, conns, blocks, chunk, result)
            total = len(workload.requests)
            with Progress(console, total, enabled=options.progress) as progress:
                term.raising = False  # from now on, _drive's receiver or term.received
                try:
                    trio.run(_drive, driver, progress.update, term)
                except KeyboardInterrupt:  # Ctrl-C: report what was measured
                    result.interrupted = True
                except BaseExceptionGroup as group:  # trio's nurseries wrap what they raise
                    if group.subgroup(KeyboardInterrupt) is not None:
                        result.interrupted = True
                    else:
                        raise _first(group, BenchError) or group from None
                result.interrupted |= term.received
            try:
                after = _stats(scheduler)
            except BenchError:
                if not result.interrupted:
                    raise
                after = before  # the server went down with the interruption: no deltas
        if before.cache is not None and after.cache is not None:
            delta = {
                name: getattr(after.cache, name) - getattr(before.cache, name)
                for name in _SERVER_COUNTERS
            }
            result.l2_hit_chunks = delta["lookup_l2_chunks"]
            result.l1_hit_chunks = delta["lookup_hit_chunks"] - delta["lookup_l2_chunks"]
            result.server_miss_chunks = delta["lookup_miss_chunks"]
            result.server = {
                name: delta[name] for name in _SERVER_COUNTERS if not name.startswith("lookup_")
            }
            result.server["lookup_timeouts"] = delta["lookup_timeouts"]
        return result
    finally:
        scheduler.close()


class _Sigterm:
    """SIGTERM while entered: a KeyboardInterrupt while ``raising`` (the workers starting),
    then only recorded in ``received``: outside :func:`_drive`'s own signal receiver (trio
    starting or ending, the statistics after the run, the workers stopping) an exception could
    land anywhere. The handler before is restored on exit."""

    def __init__(self) -> None:
        self.raising = True
        self.received = False
        self._previous: Any = None

    def _record(self, signum: int, frame: object) -> None:
        if self.raising:
            raise KeyboardInterrupt
        self.received = True

    def __enter__(self) -> _Sigterm:
        self._previous = signal.signal(signal.SIGTERM, self._record)
        return self

    def __exit__(self, *exc: object) -> None:
        signal.signal(signal.SIGTERM, self._previous)


async def _drive(driver: Driver, on_progress: Any, term: _Sigterm) -> None:
    """Run the workload until it ends or SIGTERM comes (then it is cancelled, the requests in
    flight with it, and the result marked interrupted)."""
    with trio.open_signal_receiver(signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:

            async def stop_on_sigterm() -> None:
                if not term.received:  # one that came before the receiver was open counts too
                    await signals.__anext__()
                    term.received = True
                driver.result.interrupted = True
                nursery.cancel_scope.cancel()

            nursery.start_soon(stop_on_sigterm)
            await driver.run(on_progress)
            nursery.cancel_scope.cancel()


def _describe_engine(options: BenchOptions, blocks: int) -> str:
    heads = 1 if options.layout == "mla" else options.heads_per_rank
    kind = "latent head" if options.layout == "mla" else "KV head"
    return (
        f"{options.world_size} rank{'s' * (options.world_size != 1)} × {options.layers} layers "
        f"× {heads} {kind}{'s' * (heads != 1)} per rank ({options.heads} in all) × "
        f"{options.head_dim} {options.dtype}, {options.layout}, blocks of "
        f"{options.block_size} tokens, {blocks} blocks per rank"
    )


def _describe_settings(options: BenchOptions, chunk: int) -> str:
    if options.server:
        return f"chunks of {chunk} tokens; server {options.server}"
    l2 = ", ".join(spec.partition(":")[0] for spec in options.l2) or "none"
    l1 = format_size(parse_size(options.l1_size))
    return f"chunks of {chunk} tokens, L1 {l1}, L2 {l2}"


_SERVER_COUNTERS = (
    "lookup_hit_chunks",
    "lookup_miss_chunks",
    "lookup_l2_chunks",
    "lookup_timeouts",
    "l1_evictions",
    "store_failures",
    "write_behind_skipped",
    "loads_failed",
)


def _first(group: BaseExceptionGroup[BaseException], kind: type[BenchError]) -> BenchError | None:
    """The first ``kind`` exception in a (nested) exception group."""
    matched, _ = group.split(kind)
    while isinstance(matched, BaseExceptionGroup):
        matched = matched.exceptions[0]  # type: ignore[assignment]
    return matched


def _stats(scheduler: SchedulerAdapter) -> StatsReply:
    try:
        return scheduler.client.call(GetStats(), StatsReply)
    except KvtrioError as exc:
        raise BenchError(f"stats from the server failed: {exc}") from None


@contextlib.contextmanager
def _workers(options: BenchOptions, endpoint: str, blocks: int, tenant: str) -> Iterator[list[Any]]:
    """Start ``world_size`` worker processes; yield their pipes once all are registered; stop
    them (by their process objects) afterwards."""
    context = multiprocessing.get_context("spawn")
    processes, conns = [], []
    try:
        for rank in range(options.world_size):
            ours, theirs = context.Pipe()
            process = context.Process(
                target=worker_main,
                args=(theirs, options, rank, endpoint, blocks, tenant),
                name=f"kvtrio-bench-worker-{rank}",
                daemon=True,
            )
            process.start()
            theirs.close()
            processes.append(process)
            conns.append(ours)
        for conn in conns:
            if not conn.poll(options.timeout + 30):
                raise BenchError("a worker did not start in time")
            try:
                message = conn.recv()
            except EOFError:
                raise BenchError("a worker exited while starting") from None
            if message[0] == "error":
                raise BenchError(f"worker {message[1]} failed: {message[2]}")
        yield conns
    finally:
        for conn in conns:
            with contextlib.suppress(OSError, BrokenPipeError):
                conn.send(("stop",))
        for process in processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
                process.join()
        for conn in conns:
            conn.close()


@contextlib.contextmanager
def _own_server(options: BenchOptions, console: Console) -> Iterator[str]:
    """A ``kvtrio serve`` child process on an ipc endpoint in a temporary directory (with the
    disk backend's objects, unless told otherwise), stopped and removed afterwards."""
    workdir = Path(
        tempfile.mkdtemp(prefix="kvtrio-bench-", dir="/tmp" if os.path.isdir("/tmp") else None)
    )
    args = ["--chunk-size", str(options.chunk_size), "--l1-size", options.l1_size]
    args += ["--log-level", "warning"]
    if options.eviction:
        args += ["--eviction", options.eviction]
    if options.l2_admission:
        args += ["--l2-admission", options.l2_admission]
    for spec in options.l2:
        if spec == "disk":
            spec = f"disk:path={workdir / 'l2'}"
        args += ["--l2", spec]
    # Its own process session (setsid): a Ctrl-C meant for the bench must not drain the server
    # under it.
    server = ServerProcess(
        f"ipc://{workdir}/kvtrio.sock",
        args,
        {k: v for k, v in os.environ.items() if not k.startswith("KVTRIO_")},
        log_path=workdir / "server.log",
        new_session=True,
    )
    try:
        try:
            server.start(timeout=30.0)
        except ServerStartError as exc:
            raise BenchError(f"the server did not start: {exc}") from None
        yield server.endpoint
    finally:
        returncode = server.stop()
        if returncode not in (0, None, -signal.SIGTERM):
            console.print(server.log()[-2000:], highlight=False)
        _remove_tree(workdir)


def _remove_tree(workdir: Path) -> None:
    """Remove the bench's directory, the disk L2's segment files in parallel threads: after
    the trace it holds ~90 files of 64 MiB, and removing one takes ~0.1 s on this VM's ext4
    (the filesystem frees and discards its blocks), a third of that with 8 at once."""
    segments = workdir / "l2" / "segments"
    with contextlib.suppress(OSError):
        files = [entry.path for entry in os.scandir(segments) if entry.is_file()]
        with concurrent.futures.ThreadPoolExecutor(8, thread_name_prefix="bench-rm") as pool:
            list(pool.map(_unlink_quietly, files))
    shutil.rmtree(workdir, ignore_errors=True)


def _unlink_quietly(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)
