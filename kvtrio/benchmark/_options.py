"""What ``kvtrio bench`` can be told: one frozen attrs class and its command-line flags."""

from __future__ import annotations

import argparse
from pathlib import Path

import attrs

from ..errors import KvtrioError
from ..options import parse_byte_size
from ..protocol import DEFAULT_CHUNK_SIZE
from ..storage import EVICTION_POLICIES
from ..transfer import LAYOUT_KINDS
from ..transport import check_endpoint

__all__ = ["DTYPES", "BenchError", "BenchOptions", "add_arguments", "options_from_args"]

DTYPES = ("float16", "float32", "int8", "uint8")
"""KV dtypes the simulated engine can hold (numpy has no bfloat16 or fp8)."""
MIN_L1_SIZE = 1 << 20
"""Smallest ``--l1-size``: a bare number is bytes, and a few bytes of L1 is always a mistake."""


class BenchError(Exception):
    """A bench that cannot run or could not finish: one line for the user."""


@attrs.frozen
class BenchOptions:
    """A bench run. ``server`` empty: start a server of our own (``chunk_size``, ``l1_size``,
    ``l2``); otherwise those three come from that server."""

    server: str = ""
    world_size: int = 2
    layers: int = 0
    """0: 4 for the built-in workload, 2 for a trace (which moves ~200× more tokens)."""
    heads: int = 0
    """KV heads of the model, split evenly over the ranks; 0: 4, or 2 for a trace."""
    head_dim: int = 0
    """0: 32, or 16 for a trace."""
    dtype: str = "float16"
    block_size: int = 16
    blocks: int = 0
    """Engine blocks per rank; 0: enough for ``concurrency`` of the largest requests."""
    layout: str = "flash_attn"
    chunk_size: int = DEFAULT_CHUNK_SIZE
    l1_size: str = "1GiB"
    l2: tuple[str, ...] = ("disk",)
    """Backends of our own server; ``disk`` without a path gets a temporary directory."""
    eviction: str = ""
    """L1 eviction policy of our own server; empty: the server's default."""
    l2_admission: str = ""
    """L2 admission of our own server (``all``, ``reuse``, ``auto``); empty: the server's."""
    # the built-in workload
    conversations: int = 48
    system_prompts: int = 4
    system_tokens: int = 1024
    user_tokens: int = 192
    output_tokens: int = 192
    turns: int = 4
    rate: float = 0.0
    """New conversations per second (Poisson arrivals); 0: as fast as ``concurrency`` allows."""
    concurrency: int = 4
    """Conversations (or trace requests) in flight at once."""
    seed: int = 0
    # trace replay
    trace: Path | None = None
    speed: float = 0.0
    """Replay the trace's timestamps this many times faster; 0: as fast as possible."""
    limit: int = 0
    """Replay only the first ``limit`` requests of the trace (0: all)."""
    # offline eviction evaluator (no server)
    simulate: bool = False
    capacities: str = "2000,8000,20000,0"
    """Capacities to simulate, in chunks (0: unbounded)."""
    sim_order: str = "reversed"
    held_out: bool = False
    """Count hits over the second half of the requests only (the first half warms)."""
    # output
    json: Path | None = None
    plot: Path | None = None
    progress: bool = True
    timeout: float = 60.0
    """Seconds any single step (a lookup, a worker's store or retrieve) may take before the
    bench gives up."""

    @property
    def mode(self) -> str:
        return "trace" if self.trace is not None else "chat"

    @property
    def heads_per_rank(self) -> int:
        return self.heads // self.world_size

    def resolved(self) -> BenchOptions:
        """The options with the model shape's defaults of the workload filled in."""
        layers, heads, dim = (2, 2, 16) if self.trace is not None else (4, 4, 32)
        return attrs.evolve(
            self,
            layers=self.layers or layers,
            heads=self.heads or heads,
            head_dim=self.head_dim or dim,
        )

    def check(self) -> None:
        """Raise :class:`BenchError` for settings that cannot work together."""
        positive = (
            "world_size",
            "layers",
            "heads",
            "head_dim",
            "block_size",
            "chunk_size",
            "conversations",
            "system_prompts",
            "turns",
            "concurrency",
        )
        for name in positive:
            if getattr(self, name) < 1:
                raise BenchError(f"--{name.replace('_', '-')} must be at least 1")
        for name in ("system_tokens", "user_tokens", "output_tokens", "blocks", "limit"):
            if getattr(self, name) < 0:
                raise BenchError(f"--{name.replace('_', '-')} must not be negative")
        if self.rate < 0 or self.speed < 0 or self.timeout <= 0:
            raise BenchError("--rate and --speed must not be negative, --timeout must be positive")
        if self.heads % self.world_size:
            raise BenchError(
                f"--heads {self.heads} cannot be split over --world-size {self.world_size}"
            )
        if self.layout == "mla" and self.heads_per_rank != 1:
            raise BenchError("an mla layout has one latent head per rank: --heads = --world-size")
        if not self.server and self.chunk_size % self.block_size:
            raise BenchError(
                f"--chunk-size {self.chunk_size} must be a multiple of --block-size "
                f"{self.block_size}"
            )
        if self.trace is not None and not self.trace.is_file():
            raise BenchError(f"--trace {self.trace}: no such file")
        try:
            l1_size = parse_byte_size(self.l1_size)
        except ValueError as exc:
            raise BenchError(f"--l1-size: {exc}") from None
        if self.eviction and self.eviction not in EVICTION_POLICIES:
            raise BenchError(f"--eviction: one of {', '.join(EVICTION_POLICIES)}")
        if self.l2_admission not in ("", "auto", "all", "reuse"):
            raise BenchError("--l2-admission: one of auto, all, reuse")
        try:
            if any(int(c) < 0 for c in self.capacities.split(",")):
                raise ValueError
        except ValueError:
            raise BenchError("--capacities: comma-separated chunk counts (0: unbounded)") from None
        if l1_size < MIN_L1_SIZE:
            raise BenchError(
                f"--l1-size {self.l1_size}: too small (at least 1MiB; give units, e.g. 64MiB)"
            )
        if self.server:
            try:
                check_endpoint(self.server)
            except KvtrioError as exc:
                raise BenchError(f"--server: {exc}") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the flags of ``kvtrio bench`` to ``parser``."""
    d = BenchOptions()
    where = parser.add_argument_group("server")
    where.add_argument(
        "--server",
        metavar="ENDPOINT",
        default=d.server,
        help="use this running server instead of starting one",
    )
    where.add_argument(
        "--chunk-size", type=int, default=d.chunk_size, help="[default: %(default)s]"
    )
    where.add_argument("--l1-size", default=d.l1_size, help="[default: %(default)s]")
    where.add_argument(
        "--eviction",
        default=d.eviction,
        choices=list(EVICTION_POLICIES),
        help="L1 eviction policy of the started server [default: the server's]",
    )
    where.add_argument(
        "--l2-admission",
        default=d.l2_admission,
        choices=["auto", "all", "reuse"],
        help="which chunks the started server writes to L2 [default: the server's]",
    )
    where.add_argument(
        "--l2",
        action="append",
        metavar="NAME:KEY=VALUE,...",
        help="L2 backend of the started server, repeatable; 'none' for no L2 [default: disk in a "
        "temporary directory]",
    )
    engine = parser.add_argument_group("simulated engine")
    engine.add_argument("--world-size", type=int, default=d.world_size, help="worker processes")
    engine.add_argument("--layers", type=int, default=d.layers, help="[default: 4; trace: 2]")
    engine.add_argument(
        "--heads", type=int, default=d.heads, help="KV heads over all ranks [default: 4; trace: 2]"
    )
    engine.add_argument("--head-dim", type=int, default=d.head_dim, help="[default: 32; trace: 16]")
    engine.add_argument("--dtype", choices=DTYPES, default=d.dtype)
    engine.add_argument("--block-size", type=int, default=d.block_size, help="tokens per block")
    engine.add_argument(
        "--blocks", type=int, default=d.blocks, help="KV blocks per rank [default: enough]"
    )
    engine.add_argument("--layout", choices=LAYOUT_KINDS, default=d.layout)
    chat = parser.add_argument_group("built-in workload: multi-turn conversations")
    chat.add_argument("--conversations", type=int, default=d.conversations)
    chat.add_argument(
        "--system-prompts",
        type=int,
        default=d.system_prompts,
        help="distinct system prompts the conversations share",
    )
    chat.add_argument("--system-tokens", type=int, default=d.system_tokens)
    chat.add_argument("--user-tokens", type=int, default=d.user_tokens, help="per turn")
    chat.add_argument("--output-tokens", type=int, default=d.output_tokens, help="per turn")
    chat.add_argument("--turns", type=int, default=d.turns)
    chat.add_argument(
        "--rate",
        type=float,
        default=d.rate,
        help="new conversations per second, Poisson [default: as fast as --concurrency allows]",
    )
    chat.add_argument("--seed", type=int, default=d.seed)
    sim = parser.add_argument_group("offline eviction evaluator")
    sim.add_argument(
        "--simulate",
        action="store_true",
        help="no server: replay the workload's chunk keys through every eviction policy, LFU "
        "and the offline optimum; print the hit ratio by L1 capacity",
    )
    sim.add_argument(
        "--capacities",
        default=d.capacities,
        help="L1 capacities to simulate, in chunks; 0: unbounded [default: %(default)s]",
    )
    sim.add_argument(
        "--sim-order",
        choices=("reversed", "server"),
        default=d.sim_order,
        help="store a prompt's chunks in reversed order (issue 16's conventions) or as the "
        "server does [default: %(default)s]",
    )
    sim.add_argument(
        "--held-out",
        action="store_true",
        help="count hits over the second half of the requests only: the first half warms the "
        "cache (the held-out half of docs/eviction.md)",
    )
    trace = parser.add_argument_group("trace replay (Mooncake format, hash mode)")
    trace.add_argument("--trace", type=Path, metavar="FILE.jsonl")
    trace.add_argument(
        "--speed",
        type=float,
        default=d.speed,
        help="honour the timestamps, sped up this many times [default: as fast as possible]",
    )
    trace.add_argument("--limit", type=int, default=d.limit, help="first N requests only")
    both = parser.add_argument_group("both workloads and output")
    both.add_argument(
        "--concurrency",
        type=int,
        default=d.concurrency,
        help="conversations or trace requests in flight [default: %(default)s]",
    )
    both.add_argument("--timeout", type=float, default=d.timeout, help=argparse.SUPPRESS)
    both.add_argument("--json", type=Path, metavar="FILE", help="write the results as JSON")
    both.add_argument(
        "--plot",
        type=Path,
        metavar="FILE.png",
        help="draw latency CDFs and the hit ratio over time (needs matplotlib: kvtrio[plot])",
    )
    both.add_argument(
        "--no-progress", dest="progress", action="store_false", help="no live progress bar"
    )


def options_from_args(args: argparse.Namespace) -> BenchOptions:
    """The :class:`BenchOptions` of parsed ``kvtrio bench`` arguments."""
    values = {
        a.name: getattr(args, a.name)
        for a in attrs.fields(BenchOptions)
        if a.name != "l2" and hasattr(args, a.name)
    }
    if getattr(args, "l2", None):
        values["l2"] = tuple(args.l2)
    return BenchOptions(**values)
