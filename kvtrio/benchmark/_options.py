"""What ``kvtrio bench`` can be told: one frozen attrs class, its flags made from its fields and
read by the settings' converter, as ``kvtrio serve``'s are."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import attrs
import cattrs

from ..errors import KvtrioError
from ..options import (
    describe_error,
    make_converter,
    not_negative,
    one_of,
    parse_byte_size,
    positive,
)
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


def _meta(group: str, help: str | None = None, **flag: Any) -> dict[str, Any]:
    """A setting's ``metadata``: its flag's ``group`` and ``help`` (None: no help text;
    :data:`argparse.SUPPRESS`: a hidden flag) and the flag's ``choices``, ``metavar`` or
    ``flag`` name."""
    return {"group": group, "help": help, **flag}


_SERVER = "server"
_ENGINE = "simulated engine"
_CHAT = "built-in workload: multi-turn conversations"
_SIM = "offline eviction evaluator"
_TRACE = "trace replay (Mooncake format, hash mode)"
_BOTH = "both workloads and output"
_GROUPS = (_SERVER, _ENGINE, _CHAT, _SIM, _TRACE, _BOTH)
_L2_ADMISSIONS = ("auto", "all", "reuse")


@attrs.frozen(kw_only=True)
class BenchOptions:
    """A bench run. ``server`` empty: start a server of our own (``chunk_size``, ``l1_size``,
    ``l2``); otherwise those three come from that server.

    Read like the server's settings (``kvtrio.config``): each field's ``metadata`` makes its
    flag (:func:`add_arguments`), the flags' strings are read by the settings' converter
    (:func:`kvtrio.options.make_converter`, :func:`options_from_args`), each field's validator
    checks it at construction (``ValueError("NAME: problem")``) and :meth:`check` what fields
    say together."""

    server: str = attrs.field(
        default="",
        metadata=_meta(
            _SERVER, "use this running server instead of starting one", metavar="ENDPOINT"
        ),
    )
    chunk_size: int = attrs.field(
        default=DEFAULT_CHUNK_SIZE,
        validator=positive,
        metadata=_meta(_SERVER, "[default: %(default)s]"),
    )
    l1_size: str = attrs.field(default="1GiB", metadata=_meta(_SERVER, "[default: %(default)s]"))
    eviction: str = attrs.field(
        default="",
        validator=one_of("", *EVICTION_POLICIES),
        metadata=_meta(
            _SERVER,
            "L1 eviction policy of the started server [default: the server's]",
            choices=list(EVICTION_POLICIES),
        ),
    )
    """L1 eviction policy of our own server; empty: the server's default."""
    l2_admission: str = attrs.field(
        default="",
        validator=one_of("", *_L2_ADMISSIONS),
        metadata=_meta(
            _SERVER,
            "which chunks the started server writes to L2 [default: the server's]",
            choices=list(_L2_ADMISSIONS),
        ),
    )
    """L2 admission of our own server (``all``, ``reuse``, ``auto``); empty: the server's."""
    l2: tuple[str, ...] = attrs.field(
        default=("disk",),
        metadata=_meta(
            _SERVER,
            "L2 backend of the started server, repeatable; 'none' for no L2 [default: disk in a "
            "temporary directory]",
            metavar="NAME:KEY=VALUE,...",
        ),
    )
    """Backends of our own server; ``disk`` without a path gets a temporary directory."""
    # the simulated engine
    world_size: int = attrs.field(
        default=2, validator=positive, metadata=_meta(_ENGINE, "worker processes")
    )
    layers: int = attrs.field(
        default=0, validator=not_negative, metadata=_meta(_ENGINE, "[default: 4; trace: 2]")
    )
    """0: 4 for the built-in workload, 2 for a trace (which moves ~200× more tokens)."""
    heads: int = attrs.field(
        default=0,
        validator=not_negative,
        metadata=_meta(_ENGINE, "KV heads over all ranks [default: 4; trace: 2]"),
    )
    """KV heads of the model, split evenly over the ranks; 0: 4, or 2 for a trace."""
    head_dim: int = attrs.field(
        default=0, validator=not_negative, metadata=_meta(_ENGINE, "[default: 32; trace: 16]")
    )
    """0: 32, or 16 for a trace."""
    dtype: str = attrs.field(
        default="float16", validator=one_of(*DTYPES), metadata=_meta(_ENGINE, choices=list(DTYPES))
    )
    block_size: int = attrs.field(
        default=16, validator=positive, metadata=_meta(_ENGINE, "tokens per block")
    )
    blocks: int = attrs.field(
        default=0,
        validator=not_negative,
        metadata=_meta(_ENGINE, "KV blocks per rank [default: enough]"),
    )
    """Engine blocks per rank; 0: enough for ``concurrency`` of the largest requests."""
    layout: str = attrs.field(
        default="flash_attn",
        validator=one_of(*LAYOUT_KINDS),
        metadata=_meta(_ENGINE, choices=list(LAYOUT_KINDS)),
    )
    # the built-in workload
    conversations: int = attrs.field(default=48, validator=positive, metadata=_meta(_CHAT))
    system_prompts: int = attrs.field(
        default=4,
        validator=positive,
        metadata=_meta(_CHAT, "distinct system prompts the conversations share"),
    )
    system_tokens: int = attrs.field(default=1024, validator=not_negative, metadata=_meta(_CHAT))
    user_tokens: int = attrs.field(
        default=192, validator=not_negative, metadata=_meta(_CHAT, "per turn")
    )
    output_tokens: int = attrs.field(
        default=192, validator=not_negative, metadata=_meta(_CHAT, "per turn")
    )
    turns: int = attrs.field(default=4, validator=positive, metadata=_meta(_CHAT))
    rate: float = attrs.field(
        default=0.0,
        validator=not_negative,
        metadata=_meta(
            _CHAT,
            "new conversations per second, Poisson [default: as fast as --concurrency allows]",
        ),
    )
    """New conversations per second (Poisson arrivals); 0: as fast as ``concurrency`` allows."""
    seed: int = attrs.field(default=0, metadata=_meta(_CHAT))
    # offline eviction evaluator (no server)
    simulate: bool = attrs.field(
        default=False,
        metadata=_meta(
            _SIM,
            "no server: replay the workload's chunk keys through every eviction policy, LFU "
            "and the offline optimum; print the hit ratio by L1 capacity",
        ),
    )
    capacities: str = attrs.field(
        default="2000,8000,20000,0",
        metadata=_meta(
            _SIM, "L1 capacities to simulate, in chunks; 0: unbounded [default: %(default)s]"
        ),
    )
    """Capacities to simulate, in chunks (0: unbounded)."""
    sim_order: str = attrs.field(
        default="reversed",
        validator=one_of("reversed", "server"),
        metadata=_meta(
            _SIM,
            "store a prompt's chunks in reversed order (issue 16's conventions) or as the "
            "server does [default: %(default)s]",
            choices=["reversed", "server"],
        ),
    )
    held_out: bool = attrs.field(
        default=False,
        metadata=_meta(
            _SIM,
            "count hits over the second half of the requests only: the first half warms the "
            "cache (the held-out half of docs/eviction.md)",
        ),
    )
    """Count hits over the second half of the requests only (the first half warms)."""
    # trace replay
    trace: Path | None = attrs.field(default=None, metadata=_meta(_TRACE, metavar="FILE.jsonl"))
    speed: float = attrs.field(
        default=0.0,
        validator=not_negative,
        metadata=_meta(
            _TRACE, "honour the timestamps, sped up this many times [default: as fast as possible]"
        ),
    )
    """Replay the trace's timestamps this many times faster; 0: as fast as possible."""
    limit: int = attrs.field(
        default=0, validator=not_negative, metadata=_meta(_TRACE, "first N requests only")
    )
    """Replay only the first ``limit`` requests of the trace (0: all)."""
    # both workloads, and the output
    concurrency: int = attrs.field(
        default=4,
        validator=positive,
        metadata=_meta(_BOTH, "conversations or trace requests in flight [default: %(default)s]"),
    )
    """Conversations (or trace requests) in flight at once."""
    timeout: float = attrs.field(
        default=60.0, validator=positive, metadata=_meta(_BOTH, argparse.SUPPRESS)
    )
    """Seconds any single step (a lookup, a worker's store or retrieve) may take before the
    bench gives up."""
    json: Path | None = attrs.field(
        default=None, metadata=_meta(_BOTH, "write the results as JSON", metavar="FILE")
    )
    plot: Path | None = attrs.field(
        default=None,
        metadata=_meta(
            _BOTH,
            "draw latency CDFs and the hit ratio over time (needs matplotlib: kvtrio[plot])",
            metavar="FILE.png",
        ),
    )
    progress: bool = attrs.field(
        default=True, metadata=_meta(_BOTH, "no live progress bar", flag="--no-progress")
    )

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
        """Raise :class:`BenchError` for settings that cannot work together (each one alone
        was checked at construction)."""
        if min(self.layers, self.heads, self.head_dim) < 1:
            raise BenchError("--layers, --heads and --head-dim must be at least 1 once resolved")
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


def _flag(field: attrs.Attribute[Any]) -> str:
    return str(field.metadata.get("flag", "--" + field.name.replace("_", "-")))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the flags of ``kvtrio bench`` to ``parser``, one per field of :class:`BenchOptions`
    (its ``metadata``), in groups. A flag given is kept as typed (a string) for
    :func:`options_from_args`; one not given is absent, and the field's default applies."""
    groups = {name: parser.add_argument_group(name) for name in _GROUPS}
    for field in attrs.fields(BenchOptions):
        meta = field.metadata
        extra: dict[str, Any] = {}
        if field.type in (bool, "bool"):  # a switch: --simulate, --held-out, --no-progress
            extra["action"] = "store_const"
            extra["const"] = not field.default
        elif field.name == "l2":
            extra["action"] = "append"
        for name in ("choices", "metavar"):
            if name in meta:
                extra[name] = meta[name]
        if meta["help"] is not None:  # (the flag's default is SUPPRESS: say the field's)
            extra["help"] = meta["help"].replace("%(default)s", str(field.default))
        groups[meta["group"]].add_argument(
            _flag(field), dest=field.name, default=argparse.SUPPRESS, **extra
        )


def _make_converter() -> cattrs.Converter:
    """The settings' converter (:func:`kvtrio.options.make_converter`) plus paths."""
    conv = make_converter()
    conv.register_structure_hook(Path, lambda value, _: Path(conv.structure(value, str)))
    return conv


attrs.resolve_types(BenchOptions)  # field types as types, for the converter
_converter = _make_converter()


def options_from_args(args: argparse.Namespace) -> BenchOptions:
    """The :class:`BenchOptions` of parsed ``kvtrio bench`` arguments, read as the server's
    settings are; a bad value raises :class:`BenchError` in one line naming its flag
    (``invalid setting: world_size = 'two' (from --world-size): expected an integer``)."""
    fields = attrs.fields(BenchOptions)
    merged = {
        field.name: (getattr(args, field.name), _flag(field))
        for field in fields
        if hasattr(args, field.name)
    }
    raw = {name: value for name, (value, _) in merged.items()}
    try:
        return _converter.structure(raw, BenchOptions)
    except Exception as exc:
        raise BenchError(describe_error(exc, merged)) from None
