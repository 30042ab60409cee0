"""Server settings: one frozen attrs class, loaded from defaults, environment, file and flags.

Precedence, lowest first: the defaults below, ``KVTRIO_<NAME>`` environment variables, a TOML file
(``--config``; flat keys named like the fields), then command-line flags. Every invalid setting
is reported as a one-line :class:`~kvtrio.errors.ConfigError` that names where it came from.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import cattrs
from attrs import field, frozen

from ._backend_spec import BackendSpec, parse_backend_spec, structure_backends
from .errors import ConfigError, KvtrioError
from .options import (
    ByteSize,
    HttpAddress,
    at_least,
    at_most,
    describe_error,
    make_converter,
    multiple_of,
    not_negative,
    one_of,
    parse_http_address,
    positive,
    share,
)
from .protocol import DEFAULT_CHUNK_SIZE
from .storage import DEFAULT_EVICTION, EVICTION_POLICIES

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised by the py310 tox env
    import tomli as tomllib

__all__ = [
    "BackendSpec",
    "HttpAddress",
    "ServerConfig",
    "config_summary",
    "field_help",
    "load_config",
    "parse_backend_spec",
]

LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("text", "json")
ENV_PREFIX = "KVTRIO_"

CHUNK_MULTIPLE = 16
"""``chunk_size`` must be a positive multiple of this: every power-of-two engine block size up to
16 (vLLM's default is 16) then divides it, and a larger block size must divide it anyway (checked
at registration). Odd sizes such as 7 could only ever serve block size 1 or 7."""

MIN_MESSAGE_SIZE = 1 << 20
"""The smallest ``max_message_size``: a lookup of a 128k-token prompt (token mode, 32-bit token
ids) encodes to 655,576 bytes; anything smaller would refuse ordinary long prompts."""


def _http_address(instance: object, attribute: attrs.Attribute[Any], value: str) -> None:
    if value:
        try:
            parse_http_address(value)
        except ValueError as exc:
            raise ValueError(f"{attribute.name}: {exc}") from None


def _ipc_group(instance: object, attribute: attrs.Attribute[Any], value: str) -> None:
    """A group name that exists here, or a numeric id (checked at load: a bad group stops the
    start in one line, whatever the endpoint; it also owns the L1 arena files)."""
    if value:
        from .transport import group_id

        try:
            group_id(value)
        except KvtrioError as exc:
            raise ValueError(f"{attribute.name}: {str(exc).removeprefix('ipc_group: ')}") from None


def _optional_endpoint(instance: object, attribute: attrs.Attribute[Any], value: str) -> None:
    if value:
        _endpoint(instance, attribute, value)


def _endpoint(instance: object, attribute: attrs.Attribute[Any], value: str) -> None:
    from .transport import check_endpoint  # the one parser of endpoints (issue 15)

    try:
        check_endpoint(value, bind=True)
    except KvtrioError as exc:
        raise ValueError(f"{attribute.name}: {exc}") from None


@frozen
class ServerConfig:
    """Everything ``kvtrio serve`` can be told; ``metadata["help"]`` is each flag's help."""

    endpoint: str = field(
        default="tcp://127.0.0.1:5577",
        validator=_endpoint,
        metadata={"help": "ZeroMQ endpoint to listen on (tcp://HOST:PORT or ipc://PATH)."},
    )
    chunk_size: int = field(
        default=DEFAULT_CHUNK_SIZE,
        validator=[
            positive,
            at_most(1 << 20),
            multiple_of(CHUNK_MULTIPLE, "engine block sizes divide it"),
        ],
        metadata={"help": "Tokens per cached chunk (a multiple of 16)."},
    )
    l1_size: ByteSize | None = field(
        default=None,
        validator=attrs.validators.optional(positive),
        metadata={
            "help": "Capacity of the host-memory tier, shared memory committed at start (e.g. "
            "8GiB). auto: the smallest of 4GiB, half the shm dir's free space and a quarter of "
            "the memory available, at least 256MiB per tenant arena."
        },
    )
    l1_tenants: int = field(
        default=1,
        validator=[positive, at_most(1024)],
        metadata={
            "help": "Tenants whose CPU workers may use L1 at once: each gets its own arena of "
            "--l1-size / N, created at its first registration (docs/security.md)."
        },
    )
    eviction: str = field(
        default=DEFAULT_EVICTION,
        validator=one_of(*EVICTION_POLICIES),
        metadata={
            "help": f"L1 eviction policy: {', '.join(EVICTION_POLICIES)} (lru: plain LRU, "
            "blind to prefixes, for comparison)."
        },
    )
    lookup_timeout: float = field(
        default=0.5,
        validator=positive,
        metadata={"help": "Seconds a lookup may take before it answers with what it has."},
    )
    heartbeat_timeout: float = field(
        default=10.0,
        validator=positive,
        metadata={"help": "Seconds a silent client keeps its session (and its resources)."},
    )
    drain_timeout: float = field(
        default=10.0,
        validator=not_negative,
        metadata={
            "help": "Seconds to finish in-flight requests on SIGINT/SIGTERM before stopping."
        },
    )
    max_message_size: ByteSize = field(
        # 2 MiB: the largest legal message is ~1.2 MB (a lookup_batch of MAX_LOOKUP_KEYS
        # hashes), and the router decodes a body in the event loop before it can refuse it
        # (16 MiB of chunk hashes took 110 ms to decode; issue 22, docs/design.md).
        default=ByteSize(2 << 20),
        validator=at_least(MIN_MESSAGE_SIZE, "a lookup of a 128k-token prompt needs 656 kB"),
        metadata={"help": "Largest request accepted; larger ones get a message_too_large error."},
    )
    session_queue_size: int = field(
        default=1024,
        validator=positive,
        metadata={
            "help": "Requests a client may have queued at the server before it gets busy errors."
        },
    )
    pin_ttl: float = field(
        default=60.0,
        validator=positive,
        metadata={"help": "Seconds a lookup's or retrieve's pin lives unless released."},
    )
    reservation_ttl: float = field(
        default=30.0,
        validator=positive,
        metadata={"help": "Seconds a worker has to write a store's slots and commit them."},
    )
    request_ttl: float = field(
        default=600.0,
        validator=positive,
        metadata={"help": "Unused since protocol 2 (the server keeps no prompts); accepted."},
    )
    max_requests: int = field(
        default=16384,
        validator=positive,
        metadata={
            "help": "Requests holding pins or reservations at once; beyond it new requests "
            "get busy."
        },
    )
    max_pins: int = field(
        default=1 << 18,
        validator=positive,
        metadata={"help": "Pins (lookup, read and write leases) held at once; beyond it busy."},
    )
    retrieve_timeout: float = field(
        default=5.0,
        validator=positive,
        metadata={"help": "Seconds a retrieve waits for its chunks' L2 loads before failing them."},
    )
    write_behind_queue: int = field(
        default=4096,
        validator=positive,
        metadata={
            "help": "Chunks waiting to be written to L2 (pinning at most a quarter of L1); "
            "beyond it stores are skipped."
        },
    )
    l2_loaders: int = field(
        default=4,
        validator=positive,
        metadata={"help": "Concurrent L2→L1 loads per backend."},
    )
    l2_write_through: float = field(
        default=0.0,
        validator=not_negative,
        metadata={
            "help": "Seconds a store's commit waits for its chunks' L2 writes (0: it does not "
            "wait): bounds when other servers sharing the L2 see them (docs/fleet.md)."
        },
    )
    l2_admission: str = field(
        default="auto",
        validator=one_of("auto", "all", "reuse"),
        metadata={
            "help": "Which committed chunks are written to L2: all; reuse (those likely to be "
            "read again: looked up before, or continuing a reused prefix; others once used "
            "again while in L1); auto: reuse unless a backend is a shared store (redis, s3)."
        },
    )
    shm_dir: str = field(
        default="",
        metadata={"help": "Directory of the shared-memory L1 file."},
    )
    l2: tuple[BackendSpec, ...] = field(
        default=(BackendSpec("disk"),),
        metadata={
            "help": "L2 backend NAME:key=value,... (repeat for a cascade, in order; 'none' for "
            "no L2). See `kvtrio backends`."
        },
    )
    http: HttpAddress = field(
        default=HttpAddress(""),
        validator=_http_address,
        metadata={
            "help": "Serve /metrics, /healthz and /status over HTTP on PORT or HOST:PORT (the "
            "host defaults to 127.0.0.1; empty: no HTTP)."
        },
    )
    events: str = field(
        default="",
        validator=_optional_endpoint,
        metadata={"help": "Publish KV events on this tcp:// or ipc:// endpoint (docs/events.md)."},
    )
    events_buffer: int = field(
        default=10_000, validator=positive, metadata={"help": "KV event batches kept for replay."}
    )
    events_interval: float = field(
        default=0.005, validator=positive, metadata={"help": "Seconds per KV event batch."}
    )
    log_level: str = field(
        default="info",
        validator=one_of(*LOG_LEVELS),
        metadata={"help": "Logging level (debug, info, warning, error)."},
    )
    log_format: str = field(
        default="text",
        validator=one_of(*LOG_FORMATS),
        metadata={"help": "Log lines as text, or json (one object per line)."},
    )
    # Security (docs/security.md).
    insecure: bool = field(
        default=False,
        metadata={
            "help": "Serve tcp:// without CURVE authentication (anyone who can reach the port "
            "reads and writes the cache; one tenant only)."
        },
    )
    curve_secret_key: str = field(
        default="",
        metadata={
            "help": "The server's CURVE secret key file (kvtrio keygen); default: the key dir's "
            "server.key_secret, created on first start."
        },
    )
    curve_allowed_keys: str = field(
        default="",
        metadata={
            "help": "Directory of allowed client *.key files, or a file of 'PUBLIC_KEY "
            "TENANT,...' lines; default: the key dir's clients/."
        },
    )
    ipc_group: str = field(
        default="",
        validator=_ipc_group,
        metadata={
            "help": "Group (name or numeric id) that may connect to an ipc:// endpoint too "
            "(socket 0660; default 0600: this user only) and map the L1 arena files."
        },
    )
    max_sessions: int = field(
        default=1024,
        validator=positive,
        metadata={"help": "Client sessions the server holds at once; beyond it: busy."},
    )
    max_leases_per_session: int = field(
        default=65536,
        validator=positive,
        metadata={
            "help": "Pins and reservations one client session may hold; beyond: quota_exceeded."
        },
    )
    lease_share: float = field(
        default=0.9,
        validator=share,
        metadata={
            "help": "Share of L1 that pins and reservations together may take (the rest stays "
            "evictable, so stores keep working)."
        },
    )
    lease_share_per_key: float = field(
        default=0.5,
        validator=share,
        metadata={"help": "Share of L1 one CURVE client key's pins and reservations may take."},
    )
    max_sessions_per_key: int = field(
        default=256,
        validator=positive,
        metadata={"help": "Sessions one CURVE client key may hold at once; beyond it: busy."},
    )


def config_summary(config: ServerConfig) -> dict[str, Any]:
    """The settings an operator wants to see in ``/status``: never backend options (they may
    hold credentials), only the backends' names."""
    return {
        "endpoint": config.endpoint,
        "chunk_size": config.chunk_size,
        "l1_size": config.l1_size,
        "l1_tenants": config.l1_tenants,
        "eviction": config.eviction,
        "l2": [spec.name for spec in config.l2],
        "lookup_timeout": config.lookup_timeout,
        "retrieve_timeout": config.retrieve_timeout,
        "l2_write_through": config.l2_write_through,
        "l2_admission": config.l2_admission,
        "heartbeat_timeout": config.heartbeat_timeout,
        "drain_timeout": config.drain_timeout,
        "pin_ttl": config.pin_ttl,
        "reservation_ttl": config.reservation_ttl,
        "write_behind_queue": config.write_behind_queue,
        "l2_loaders": config.l2_loaders,
        "http": config.http,
        "log_level": config.log_level,
        "log_format": config.log_format,
        "insecure": config.insecure,
        "max_sessions": config.max_sessions,
        "max_sessions_per_key": config.max_sessions_per_key,
        "max_leases_per_session": config.max_leases_per_session,
        "lease_share": config.lease_share,
        "lease_share_per_key": config.lease_share_per_key,
    }


def field_help() -> dict[str, str]:
    """One-line help per setting (the ``--help`` text of its flag)."""
    return {a.name: a.metadata["help"] for a in attrs.fields(ServerConfig)}


# --------------------------------------------------------------------------- loading


def _make_converter() -> cattrs.Converter:
    """The option converter plus the server's own type: the L2 backends."""
    conv = make_converter()

    conv.register_structure_hook_func(lambda t: t == tuple[BackendSpec, ...], structure_backends)
    return conv


_converter = _make_converter()
_FIELDS = {a.name: a for a in attrs.fields(ServerConfig)}


def _from_env(environ: Mapping[str, str]) -> dict[str, tuple[Any, str]]:
    values: dict[str, tuple[Any, str]] = {}
    for name in _FIELDS:
        key = ENV_PREFIX + name.upper()
        if key in environ:
            values[name] = (environ[key], f"environment variable {key}")
    return values


def _from_file(path: Path) -> dict[str, tuple[Any, str]]:
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    values: dict[str, tuple[Any, str]] = {}
    for name, value in data.items():
        if name not in _FIELDS:
            known = ", ".join(_FIELDS)
            raise ConfigError(f"unknown setting {name!r} in {path} (known: {known})")
        values[name] = (value, f"{path}")
    return values


def load_config(
    overrides: Mapping[str, Any] | None = None,
    *,
    config_file: Path | None = None,
    environ: Mapping[str, str] | None = None,
) -> ServerConfig:
    """Build the :class:`ServerConfig` from env, an optional TOML file and flag ``overrides``.

    ``overrides`` maps field names to values given on the command line (already typed or strings).
    Raises :class:`ConfigError` with a one-line message naming the bad setting and its source.
    """
    merged: dict[str, tuple[Any, str]] = {}
    merged.update(_from_env(environ or {}))
    if config_file is not None:
        merged.update(_from_file(config_file))
    for name, value in (overrides or {}).items():
        if name not in _FIELDS:
            raise ConfigError(f"unknown setting {name!r}")
        merged[name] = (value, "--" + name.replace("_", "-"))
    raw = {name: value for name, (value, _) in merged.items()}
    try:
        return _converter.structure(raw, ServerConfig)
    except Exception as exc:
        raise ConfigError(describe_error(exc, merged)) from None
