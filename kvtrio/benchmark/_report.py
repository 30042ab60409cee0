"""Showing a bench run: rich's live progress bar, the end table, the optional matplotlib figure."""

from __future__ import annotations

import time
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from rich import progress as rp
from rich.console import Console
from rich.table import Table

from ._options import BenchError
from ._results import BenchResult

if TYPE_CHECKING:
    from ._driver import Driver

__all__ = ["Progress", "print_table", "write_plot"]


class Progress:
    """A live bar: requests done, hit ratio so far, requests/s and GB/s (rich.progress).

    Off when disabled or when the console is not a terminal."""

    def __init__(self, console: Console, total: int, *, enabled: bool) -> None:
        self._bar = rp.Progress(
            rp.TextColumn("[bold]bench"),
            rp.BarColumn(),
            rp.MofNCompleteColumn(),
            rp.TextColumn("hit {task.fields[hit]}"),
            rp.TextColumn("{task.fields[rate]}"),
            rp.TimeElapsedColumn(),
            console=console,
            disable=not enabled or not console.is_terminal,
            transient=False,
        )
        self._task = self._bar.add_task("bench", total=total, hit="-", rate="")
        self._started = time.perf_counter()

    def __enter__(self) -> Progress:
        self._bar.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._bar.stop()

    def update(self, driver: Driver) -> None:
        result = driver.result
        tokens = sum(r.tokens for r in result.requests)
        hits = sum(r.hit_tokens for r in result.requests)
        elapsed = max(time.perf_counter() - self._started, 1e-9)
        self._bar.update(
            self._task,
            completed=driver.done,
            hit=f"{hits / tokens:.1%}" if tokens else "-",
            rate=f"{driver.done / elapsed:.1f} req/s  {driver.moved / elapsed / 1e9:.2f} GB/s",
        )


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.2f}"


def _size(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def print_table(result: BenchResult, console: Console) -> None:
    """The end table (one row per figure)."""
    s = result.summary()
    console.print(f"[bold]kvtrio bench[/bold]: {s['workload']}", highlight=False)
    settings = result.settings or f"chunks of {s['chunk_size']} tokens"
    console.print(f"engine: {s['engine']}; {settings}", highlight=False, style="dim")
    if result.interrupted:
        console.print(
            f"[bold yellow]interrupted[/bold yellow]: {len(result.requests)} of "
            f"{result.planned} requests done; the figures below are of those",
            highlight=False,
        )
    table = Table(show_header=True)
    table.add_column("measure")
    table.add_column("value", justify="right")
    table.add_column("detail")
    table.add_row(
        "requests",
        f"{s['requests']}",
        f"in {s['wall_seconds']:.1f} s ({s['requests_per_second']:.1f}/s)",
    )
    table.add_row(
        "hit ratio (tokens)",
        f"{s['hit_ratio_tokens']:.1%}",
        f"{s['hit_tokens']:,} of {s['prompt_tokens']:,} prompt tokens",
    )
    table.add_row(
        "hit ratio (chunks)",
        f"{s['hit_ratio_chunks']:.1%}",
        f"{s['hit_chunks']:,} of {s['chunks']:,} full chunks",
    )
    l1, l2, missed = s["l1_hit_chunks"], s["l2_hit_chunks"], s["server_miss_chunks"]
    table.add_row(
        "hits from L1 / L2",
        "-" if l1 is None else f"{l1:,} / {l2:,}",
        "chunks, as the server counted them",
    )
    if l1 is not None and missed is not None and l1 + l2 + missed:
        found = l1 + l2
        table.add_row(
            "server's hit ratio",
            f"{found / (found + missed):.1%}",
            f"{found:,} of {found + missed:,} chunks looked up: each prompt's partial last "
            "chunk counts too (what kvtrio status shows, over the server's life)",
        )
    for name in ("lookup", "retrieve", "store"):
        lat = s["latency_seconds"][name]
        table.add_row(
            f"{name} p50 / p99",
            f"{_ms(lat['p50'])} / {_ms(lat['p99'])} ms",
            f"{lat['count']:,} {'lookups' if name == 'lookup' else 'per-worker operations'}",
        )
    table.add_row(
        "moved",
        f"{s['gb_per_second']:.2f} GB/s",
        f"{_size(s['bytes_retrieved'])} retrieved + {_size(s['bytes_stored'])} stored",
    )
    server = s["server"]
    if server:
        table.add_row(
            "L1 evictions",
            f"{server['l1_evictions']:,}",
            f"chunks; {server['write_behind_skipped']:,} not written to L2 (queue full), "
            f"{server['store_failures']:,} not stored (no room)",
        )
    table.add_row(
        "retrieve failures",
        f"{s['failed_blocks']:,}",
        "blocks reported failed (the engine would recompute them)",
    )
    table.add_row(
        "checksum failures",
        f"{s['checksum_failures']:,}",
        f"of {s['retrieved_blocks']:,} retrieved blocks, each checked byte for byte",
        style="bold red" if s["checksum_failures"] else None,
    )
    if s["lookup_failures"] or s["truncated_requests"]:
        table.add_row(
            "lookups failed / truncated",
            f"{s['lookup_failures']} / {s['truncated_requests']}",
            "requests",
        )
    console.print(table)


def write_plot(result: BenchResult, path: Path) -> None:
    """Latency CDFs (lookup, retrieve, store) and the hit ratio over time, as a PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise BenchError("--plot needs matplotlib: pip install 'kvtrio[plot]'") from None
    import numpy as np

    figure, (cdf, ratio) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, values in (
        ("lookup", result.lookup_seconds),
        ("retrieve", result.retrieve_seconds),
        ("store", result.store_seconds),
    ):
        if values:
            xs = np.sort(np.asarray(values)) * 1e3
            p50, p99 = np.percentile(xs, 50), np.percentile(xs, 99)
            (line,) = cdf.plot(
                xs,
                np.arange(1, len(xs) + 1) / len(xs),
                label=f"{name} ({len(xs)}): p50 {p50:.2f} ms, p99 {p99:.2f} ms",
            )
            cdf.plot([p50, p99], [0.5, 0.99], "o", color=line.get_color(), markersize=4)
    for level in (0.5, 0.99):
        cdf.axhline(level, color="grey", linewidth=0.6, linestyle=":")
    cdf.set_xscale("log")
    cdf.set_xlabel("latency (ms)")
    cdf.set_ylabel("fraction of operations")
    cdf.set_title("latency CDF")
    cdf.grid(True, which="both", alpha=0.3)
    cdf.legend()
    records = sorted(result.requests, key=lambda r: r.done_at)
    if records:
        times = np.array([r.done_at for r in records])
        tokens = np.cumsum([r.tokens for r in records])
        hits = np.cumsum([r.hit_tokens for r in records])
        ratio.plot(times, hits / np.maximum(tokens, 1), label="cumulative")
        window = max(1, len(records) // 20)
        recent: Any = [
            sum(r.hit_tokens for r in records[max(0, i - window + 1) : i + 1])
            / max(1, sum(r.tokens for r in records[max(0, i - window + 1) : i + 1]))
            for i in range(len(records))
        ]
        ratio.plot(times, recent, label=f"last {window} requests", alpha=0.6)
    ratio.set_ylim(0, 1)
    sped_up = f", trace replayed {result.speed:g}× faster" if result.speed else ""
    ratio.set_xlabel(f"time since the start (s{sped_up})")
    ratio.set_ylabel("hit ratio (tokens)")
    ratio.set_title("hit ratio over time")
    ratio.grid(True, alpha=0.3)
    ratio.legend()
    title = f"kvtrio bench: {result.workload}\n{result.settings}"
    if result.interrupted:
        title += f" (interrupted: {len(result.requests)} of {result.planned} requests)"
    figure.suptitle(title, fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
