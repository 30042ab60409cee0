"""The ``kvtrio`` command: ``serve``, ``bench``, ``status``, ``backends``, ``ping``, ``keygen``.

Every expected failure (bad setting, address in use, server unreachable) ends the command with a
one-line message on stderr and a non-zero exit status, never a traceback.
"""

from __future__ import annotations

import argparse
import gc
import logging
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, cast

import attrs
import trio

if sys.version_info < (3, 11):  # pragma: no cover - exercised by the py310 tox env
    from exceptiongroup import BaseExceptionGroup

from ._logging import configure_logging, event
from ._version import __version__
from .config import ServerConfig, field_help, load_config
from .errors import ConfigError, KvtrioError
from .options import ByteSize, format_size

if TYPE_CHECKING:
    from .client import Client

__all__ = ["main"]

log = logging.getLogger("kvtrio")

DEFAULT_ENDPOINT = attrs.fields(ServerConfig).endpoint.default

_METAVARS = {
    "endpoint": "ENDPOINT",
    "chunk_size": "TOKENS",
    "http": "[HOST:]PORT",
    "shm_dir": "DIR",
    "log_level": "LEVEL",
    "log_format": "FORMAT",
    "eviction": "POLICY",
    "curve_secret_key": "FILE",
    "curve_allowed_keys": "PATH",
    "ipc_group": "GROUP",
    "events": "ENDPOINT",
    "lease_share": "SHARE",
    "lease_share_per_key": "SHARE",
}
_SHOWN_DEFAULTS = {
    "shm_dir": "/dev/shm, else the temporary directory",
    "http": "not served",
    "events": "none",
    "l1_size": "auto",
}
_SIZE_TYPES = (ByteSize, "ByteSize", "ByteSize | None")


def _metavar(field: attrs.Attribute[Any]) -> str:
    """What a flag takes: sizes take units, durations seconds, counts a number."""
    if field.name in _METAVARS:
        return _METAVARS[field.name]
    if field.type in _SIZE_TYPES:
        return "SIZE"
    if field.type in (float, "float"):
        return "SECONDS"
    return "N"


def _shown_default(field: attrs.Attribute[Any]) -> str:
    """A default as a person reads it: ``4GiB`` not 4294967296, ``off`` not a blank."""
    if field.name in _SHOWN_DEFAULTS:
        return _SHOWN_DEFAULTS[field.name]
    if field.type in _SIZE_TYPES:
        return format_size(cast(int, field.default))
    if field.type in (float, "float"):
        return f"{field.default:g}s" if _metavar(field) == "SECONDS" else f"{field.default:g}"
    return str(field.default) if field.default != "" else "none"


_TIMEOUT_HELP = (
    "seconds to wait for the answer, and for a server that is starting to listen [default: 2]"
)


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvtrio", description="A KV-cache server for LLM inference engines."
    )
    parser.add_argument("--version", action="version", version=f"kvtrio {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = commands.add_parser(
        "serve",
        help="run the server",
        description="Run the server. Settings come from flags, then --config, then KVTRIO_* "
        "environment variables, then defaults.",
    )
    serve.add_argument("--config", type=Path, metavar="FILE", help="TOML file of settings")
    for name, text in field_help().items():
        field = attrs.fields_dict(ServerConfig)[name]
        if name == "l2":
            serve.add_argument(
                "--l2",
                dest="l2",
                action="append",
                default=argparse.SUPPRESS,
                metavar="NAME:KEY=VALUE,...",
                help=f"{text} [default: disk]",
            )
            continue
        if field.type in (bool, "bool"):  # --insecure: a switch
            serve.add_argument(
                "--" + name.replace("_", "-"),
                dest=name,
                action="store_const",
                const=True,
                default=argparse.SUPPRESS,
                help=text,
            )
            continue
        serve.add_argument(
            "--" + name.replace("_", "-"),
            dest=name,
            default=argparse.SUPPRESS,
            metavar=_metavar(field),
            help=f"{text} [default: {_shown_default(field)}]",
        )

    commands.add_parser(
        "backends",
        help="list the installed L2 backends and their options",
        description="List the L2 backends found through the kvtrio.backends entry points.",
    )

    status = commands.add_parser(
        "status",
        help="print a short summary of a server's state (--json: the whole status document)",
        description="Print a server's state over the ZeroMQ stats operation, for servers that "
        "run without HTTP too: a short summary in sections, or with --json the same document "
        "as GET /status on its HTTP port. Its hit ratio is of every chunk hash looked up since "
        "the server started, by every client and tenant: each prompt's full chunks and its "
        "partial last chunk, which the server cannot tell apart and which rarely hits (kvtrio "
        "bench's own ratios are of its run alone: tokens, and full chunks).",
    )
    status.add_argument("endpoint", nargs="?", default=DEFAULT_ENDPOINT, help="server endpoint")
    status.add_argument("--json", action="store_true", help="print the whole document as JSON")
    status.add_argument("--timeout", type=float, default=2.0, help=_TIMEOUT_HELP)

    bench = commands.add_parser(
        "bench",
        help="run a workload through a server and a simulated engine; print what it measured",
        description="Start a server (or use --server), a scheduler and --world-size engine "
        "worker processes with KV caches in shared memory, and drive a workload through the "
        "real adapters: lookup, retrieve of the hits (checked byte for byte), store of the "
        "misses, end of the request. The built-in workload is multi-turn conversations sharing "
        "system prompts; --trace replays a Mooncake trace in hash mode. Its hit ratios are of "
        "its own requests, by tokens and by full chunks; the server's (kvtrio status, and the "
        "table's server row) also counts each prompt's partial last chunk, so it is lower.",
    )
    from .benchmark import add_arguments

    add_arguments(bench)

    ping = commands.add_parser(
        "ping",
        help="check that a server answers",
        description="Ping a server. A server that is starting (making its keys, not "
        "listening yet) is waited for, up to --timeout seconds: kvtrio serve & then "
        "kvtrio ping --timeout 30 succeeds once it serves.",
    )
    ping.add_argument("endpoint", nargs="?", default=DEFAULT_ENDPOINT, help="server endpoint")
    ping.add_argument("--timeout", type=float, default=2.0, help=_TIMEOUT_HELP)
    for client_command in (ping, status):
        _add_key_arguments(client_command)

    keygen = commands.add_parser(
        "keygen",
        help="write a CURVE key pair (NAME.key, NAME.key_secret)",
        description="Write a CURVE key pair for a server or a client (docs/security.md). Give "
        "a client's NAME.key to the server (its --curve-allowed-keys directory); keep "
        "NAME.key_secret with the client.",
    )
    keygen.add_argument("name", help="file name of the pair, e.g. engine-a or server")
    keygen.add_argument("--dir", type=Path, default=Path("."), help="where to write [default: .]")
    keygen.add_argument(
        "--tenants",
        default=None,
        help="tenants a client key may use: NAME,NAME (each 1-64 of A-Z a-z 0-9 . _ -) or * "
        "(required in an allowed-keys dir)",
    )
    return parser


def _add_key_arguments(command: argparse.ArgumentParser) -> None:
    command.add_argument(
        "--server-key",
        default=None,
        help="the server's CURVE public key or key file [default: KVTRIO_SERVER_KEY, then "
        "this user's default keys]",
    )
    command.add_argument(
        "--client-key",
        default=None,
        help="this client's .key_secret file [default: KVTRIO_CLIENT_KEY, then this user's "
        "default keys]",
    )
    command.add_argument(
        "--insecure",
        action="store_const",
        const=True,
        default=None,
        help="connect without CURVE, to a server started with --insecure [default: "
        "KVTRIO_INSECURE]",
    )


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of the ``kvtrio`` console script; exits the process."""
    args = _build_parser().parse_args(argv)
    try:
        if args.command == "serve":
            _serve(args)
        elif args.command == "ping":
            _ping(args)
        elif args.command == "keygen":
            _keygen(args)
        elif args.command == "backends":
            _backends()
        elif args.command == "status":
            _status(args)
        elif args.command == "bench":
            from .benchmark import main as bench_main

            sys.exit(bench_main(args))
    except BaseException as exc:
        error = _sole_error(exc)  # trio wraps errors raised in nurseries in exception groups
        if isinstance(error, KeyboardInterrupt):  # a signal after the server had stopped
            _fail("interrupted", status=130)
        if isinstance(error, ConfigError):
            _fail(str(error), status=2)
        if isinstance(error, KvtrioError):
            _fail(str(error), status=1)
        raise


def _sole_error(exc: BaseException) -> BaseException:
    """The single exception inside (possibly nested) one-member exception groups."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


def _fail(message: str, status: int) -> NoReturn:
    print(f"kvtrio: error: {message}", file=sys.stderr)
    sys.exit(status)


# --------------------------------------------------------------------------- serve


def _serve(args: argparse.Namespace) -> None:
    overrides = {
        name: getattr(args, name) for name in attrs.fields_dict(ServerConfig) if hasattr(args, name)
    }
    import os

    config = load_config(overrides, config_file=args.config, environ=os.environ)
    configure_logging(config.log_level, config.log_format)
    trio.run(_run_server, config)
    # Stopped: what is left is flushing the last replies (bounded by the socket linger).
    # A signal now must not turn into a KeyboardInterrupt traceback.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


async def _run_server(config: ServerConfig) -> None:
    from .server import describe_storage, serve

    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            handle = await nursery.start(serve, config)
            # What the start made (modules, classes, the server's tables) lives as long as the
            # process: out of the cyclic collector's way, so that its full collections, which
            # stop the event loop, walk only what requests made (issue 22, docs/design.md).
            gc.freeze()
            log.info(
                "kvtrio %s serving on %s (chunk size %d tokens, instance %s)",
                __version__,
                handle.endpoint,
                config.chunk_size,
                handle.instance_id,
                extra=event(
                    "serving",
                    endpoint=handle.endpoint,
                    version=__version__,
                    instance=handle.instance_id,
                ),
            )
            storage = handle.state.storage()
            log.info(
                "data: %s",
                describe_storage(storage),
                extra=event("storage", **storage),
            )
            draining = False
            async for signum in signals:
                name = signal.Signals(signum).name
                if draining:
                    log.warning("%s again: stopping now", name, extra=event("stop", signal=name))
                    handle.stop()
                    break
                log.info(
                    "%s: draining for up to %.1fs (again to stop now)",
                    name,
                    config.drain_timeout,
                    extra=event("shutdown", signal=name, grace_s=config.drain_timeout),
                )
                draining = True
                nursery.start_soon(_drain_then_stop, handle, nursery.cancel_scope)
    log.info("stopped", extra=event("stopped"))


async def _drain_then_stop(handle: object, scope: trio.CancelScope) -> None:
    from .server import ServerHandle

    assert isinstance(handle, ServerHandle)
    try:
        await handle.shutdown()
    finally:
        scope.cancel()


# --------------------------------------------------------------------------- keygen


def _keygen(args: argparse.Namespace) -> None:
    from .transport import write_keypair

    if (args.dir / f"{args.name}.key_secret").exists():
        _fail(f"{args.dir / args.name}.key_secret exists; not overwriting it", status=1)
    pair = write_keypair(args.dir, args.name, args.tenants)
    print(f"wrote {args.dir / args.name}.key (public) and {args.name}.key_secret (keep private)")
    print(f"public key: {pair.public.decode()}")


# --------------------------------------------------------------------------- backends


def _backends() -> None:
    from .l2 import describe_backends

    for info in describe_backends():
        print(f"{info.name}  ({info.target})")
        if info.error is not None:
            print(f"    unavailable: {info.error}")
        for option, default, text in info.options:
            if default.isdigit() and (option == "capacity" or option.endswith("_size")):
                default = format_size(int(default))
            shown = f" [default: {default}]" if default else ""
            print(f"    {option:<14} {text}{shown}")
        print()


# --------------------------------------------------------------------------- status


def _status(args: argparse.Namespace) -> None:
    import json

    from .protocol import GetStats, StatsReply
    from .server import status_document, status_summary

    deadline = time.monotonic() + args.timeout
    with _reach(args, "kvtrio-status") as client:
        stats = client.call(GetStats(), StatsReply, timeout=_left(deadline), fail_fast=True)
    document = status_document(stats)
    print(json.dumps(document, indent=2) if args.json else status_summary(document))


# --------------------------------------------------------------------------- ping


def _ping(args: argparse.Namespace) -> None:
    from .protocol import Ping, Pong

    deadline = time.monotonic() + args.timeout
    with _reach(args, "kvtrio-ping") as client:
        started = time.perf_counter()
        pong = client.call(Ping(), Pong, timeout=_left(deadline), fail_fast=True)
        elapsed = time.perf_counter() - started
    print(f"pong from {args.endpoint}: instance {pong.instance_id}, {elapsed * 1000:.2f} ms")


def _left(deadline: float) -> float:
    """Seconds to ``deadline``; at least 0.5 for the one request after connecting."""
    return max(0.5, deadline - time.monotonic())


def _reach(args: argparse.Namespace, name: str) -> Client:
    """A client of ``args.endpoint`` once it is up, waiting ``--timeout`` for it to start."""
    from .client import connect_waiting

    return connect_waiting(args.endpoint, args.timeout, client_name=name,
                           server_key=args.server_key, client_key=args.client_key,
                           insecure=args.insecure)  # fmt: skip
