"""CURVE key pairs on disk: writing them, reading them, the allowed-keys list, the defaults.

Key files are ZeroMQ's certificate format (what ``zmq.auth`` reads and writes): ``NAME.key``
holds the public key, ``NAME.key_secret`` the public and the secret key. kvtrio adds one
metadata line, ``tenants = "acme,beta"`` (``*``: any tenant), which says what a client key may
use. Directories are created 0700 and every key file 0600, atomically (a reader never sees a
half-written key).

The default key directory (``$KVTRIO_KEY_DIR``, else ``$XDG_CONFIG_HOME/kvtrio/keys``, else
``~/.config/kvtrio/keys``) holds ``server.key[_secret]`` and ``client.key[_secret]``, generated
on the server's first start; ``clients/`` there holds the allowed client public keys. A client
of the same user finds the server's public key and its own secret key there by itself; it never
creates them.
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
from collections.abc import Mapping
from pathlib import Path

import attrs
import zmq
from zmq.utils import z85

from ..errors import ConfigError

__all__ = [
    "ANY_TENANT",
    "AllowedKey",
    "ClientCredentials",
    "KeyPair",
    "curve_client_options",
    "default_key_dir",
    "ensure_default_keys",
    "load_allowed_keys",
    "load_keypair",
    "load_public_key",
    "resolve_client_credentials",
    "write_keypair",
]

NO_KEY = "none"
"""As a client's server key: connect without CURVE."""
ANY_TENANT = "*"
"""In a ``tenants`` list: the key may use every tenant."""


@attrs.frozen
class KeyPair:
    """A CURVE key pair, Z85-encoded (40 bytes each); ``secret`` is None for a public key only."""

    public: bytes
    secret: bytes | None = None


@attrs.frozen
class AllowedKey:
    """A client key the server accepts: its name (for logs) and the tenants it may use."""

    name: str
    public: bytes
    tenants: frozenset[str]

    def may_use(self, tenant: str) -> bool:
        return ANY_TENANT in self.tenants or tenant in self.tenants


@attrs.frozen
class ClientCredentials:
    """What a client needs for CURVE: the server's public key and its own key pair."""

    server_public: bytes
    public: bytes
    secret: bytes


def default_key_dir(environ: Mapping[str, str] | None = None) -> Path:
    """Where the default keys live (see the module's docstring)."""
    env = os.environ if environ is None else environ
    if env.get("KVTRIO_KEY_DIR"):
        return Path(env["KVTRIO_KEY_DIR"])
    config_home = env.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(config_home) / "kvtrio" / "keys"


def _private_dir(path: Path) -> None:
    """Create ``path`` (and parents) as 0700 directories; tighten it if it exists."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    if path.stat().st_mode & 0o077:
        path.chmod(0o700)


def _write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` 0600, atomically (temp file + rename in the same directory)."""
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=path.suffix)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:  # mkstemp creates it 0600
            out.write(text)
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise


def _certificate(pair: KeyPair, tenants: str | None, secret: bool) -> str:
    lines = ["#   ZeroMQ CURVE certificate written by kvtrio keygen", "metadata"]
    if tenants is not None:
        lines.append(f'    tenants = "{tenants}"')
    lines += ["curve", f'    public-key = "{pair.public.decode()}"']
    if secret:
        assert pair.secret is not None
        lines.append(f'    secret-key = "{pair.secret.decode()}"')
    return "\n".join(lines) + "\n"


def write_keypair(directory: Path, name: str, tenants: str | None = None) -> KeyPair:
    """Generate a key pair, write ``NAME.key`` and ``NAME.key_secret`` into ``directory``
    (created 0700; files 0600) and return it. ``tenants``: comma-separated names or ``*``."""
    if not name or "/" in name or name.startswith("."):
        raise ConfigError(f"{name!r} is not a key name (a plain file name, e.g. engine-a)")
    if tenants is not None:
        tenants = ",".join(sorted(_tenant_set(tenants, "--tenants")))
    public, secret = zmq.curve_keypair()
    pair = KeyPair(public, secret)
    _private_dir(directory)
    _write_private(directory / f"{name}.key", _certificate(pair, tenants, secret=False))
    _write_private(directory / f"{name}.key_secret", _certificate(pair, tenants, secret=True))
    return pair


def _parse_certificate(path: Path) -> tuple[KeyPair, str | None]:
    """Read a certificate file: its key pair and its ``tenants`` metadata, if any."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read key file {path}: {exc.strerror}") from None
    values: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.strip().partition("=")
        if sep and not line.lstrip().startswith("#"):
            values[key.strip()] = value.strip().strip('"')
    public = values.get("public-key", "").encode()
    secret = values.get("secret-key", "").encode() or None
    if len(public) != 40 or (secret is not None and len(secret) != 40):
        raise ConfigError(f"{path} is not a CURVE key file (write one with `kvtrio keygen`)")
    if secret is not None and zmq.curve_public(secret) != public:
        raise ConfigError(f"{path}: the secret key does not match the public key")
    return KeyPair(public, secret), values.get("tenants")


def load_keypair(path: str | Path) -> KeyPair:
    """A key pair with its secret from a ``.key_secret`` file; :class:`ConfigError` if not."""
    pair, _ = _parse_certificate(Path(path))
    if pair.secret is None:
        raise ConfigError(f"{path} holds no secret key (use the .key_secret file)")
    return pair


def load_public_key(value: str) -> bytes:
    """A public key given as its 40 Z85 characters or as a key file's path."""
    if len(value) == 40 and not os.path.exists(value):
        try:
            z85.decode(value.encode())
        except (ValueError, KeyError):
            raise ConfigError(f"{value!r} is neither a Z85 public key nor a key file") from None
        return value.encode()
    pair, _ = _parse_certificate(Path(value))
    return pair.public


TENANT_PATTERN = r"[A-Za-z0-9._-]{0,64}"
"""A tenant name (``kvtrio.protocol.TENANT_PATTERN``, which this layer may not import; a test
keeps the two equal): 0-64 of ``A-Z a-z 0-9 . _ -``, so no events topic prefixes another."""

_TENANT = re.compile(TENANT_PATTERN)


def _tenant_set(text: str | None, where: str) -> frozenset[str]:
    """The tenants of a comma-separated list (``*``: any); ``ConfigError`` if it names none
    or a name outside the tenant alphabet."""
    tenants = frozenset(t.strip() for t in (text or "").split(",") if t.strip())
    if not tenants:
        raise ConfigError(f'{where}: no tenants (add tenants = "NAME,..." or "*")')
    for tenant in sorted(tenants - {ANY_TENANT}):
        if _TENANT.fullmatch(tenant) is None:
            raise ConfigError(
                f"{where}: {tenant[:80]!r} is not a tenant name (at most 64 of A-Z a-z 0-9 . _ -)"
            )
    return tenants


def load_allowed_keys(path: str | Path) -> dict[bytes, AllowedKey]:
    """The client keys a server accepts, by public key.

    ``path`` is a directory of ``*.key`` certificate files (``kvtrio keygen`` writes them, with
    their ``tenants``), or a text file of lines ``PUBLIC_KEY TENANT[,TENANT...]`` (``*``: any;
    a word starting with ``#`` starts a comment). A key without tenants is refused: what it
    may use must be explicit.
    """
    path = Path(path)
    allowed: dict[bytes, AllowedKey] = {}
    if path.is_dir():
        for file in sorted(path.glob("*.key")):
            pair, tenants = _parse_certificate(file)
            allowed[pair.public] = AllowedKey(
                file.stem, pair.public, _tenant_set(tenants, str(file))
            )
        return allowed
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise ConfigError(f"cannot read allowed keys {path}: {exc.strerror}") from None
    for number, line in enumerate(lines, 1):
        fields = line.split()  # Z85 keys may hold '#': comments start a line or a word
        if not fields or fields[0].startswith("#"):
            continue
        fields = [fields[0], *(f for f in fields[1:2] if not f.startswith("#"))]
        where = f"{path}:{number}"
        public = fields[0].encode()
        if len(public) != 40:
            raise ConfigError(f"{where}: expected PUBLIC_KEY TENANTS, got {line.strip()!r}")
        tenant_set = _tenant_set(fields[1] if len(fields) > 1 else None, where)
        allowed[public] = AllowedKey(f"{path.name}:{number}", public, tenant_set)
    return allowed


def ensure_default_keys(directory: Path | None = None) -> Path:
    """Create the default keys in ``directory`` (default: :func:`default_key_dir`) unless they
    exist: a server pair, a client pair allowed every tenant, ``clients/client.key``. Safe when
    several processes start at once (each file appears whole, once). Returns the directory."""
    directory = directory or default_key_dir()
    _private_dir(directory)
    _private_dir(directory / "clients")
    for name in ("server", "client"):
        if not (directory / f"{name}.key").exists():
            _create_once(directory, name)
    allowed = directory / "clients" / "client.key"
    if not allowed.exists():
        pair, _ = _parse_certificate(directory / "client.key")
        _write_private(allowed, _certificate(pair, ANY_TENANT, secret=False))
    return directory


def _create_once(directory: Path, name: str) -> None:
    """Write a pair ``name`` into ``directory`` unless another process got there first."""
    staging = Path(tempfile.mkdtemp(dir=directory, prefix=".new-"))
    tenants = ANY_TENANT if name == "client" else None
    try:
        write_keypair(staging, name, tenants)
        # The secret file decides: the first process to link it wins, and the public file is
        # (re)written from whichever secret won.
        with contextlib.suppress(FileExistsError):
            os.link(staging / f"{name}.key_secret", directory / f"{name}.key_secret")
    finally:
        for file in staging.iterdir():
            file.unlink()
        staging.rmdir()
    pair = load_keypair(directory / f"{name}.key_secret")
    public = directory / f"{name}.key"
    if not public.exists() or load_public_key(str(public)) != pair.public:
        _write_private(public, _certificate(pair, tenants, secret=False))


_TRUE = ("1", "true", "yes", "on")


def resolve_client_credentials(
    server_key: str | None = None,
    client_key: str | None = None,
    environ: Mapping[str, str] | None = None,
    *,
    insecure: bool | None = None,
) -> ClientCredentials | None:
    """The CURVE credentials a client uses, or None for a plain connection.

    Plain (to a server started with ``--insecure``) when told so: ``insecure=True``, else
    ``KVTRIO_INSECURE`` true (``1``, ``true``, ``yes``, ``on``: the variable that starts a
    server without CURVE), or ``server_key="none"``. Otherwise ``server_key`` (Z85 public key
    or key file) and ``client_key`` (a ``.key_secret`` file) come from the caller, else
    ``KVTRIO_SERVER_KEY`` / ``KVTRIO_CLIENT_KEY``, else the default key directory's
    ``server.key`` and ``client.key_secret``. Giving one without the other is a
    :class:`ConfigError`, and so are default keys that do not exist: a client never creates
    keys (only a server does, on its first start), nor falls back to plain by itself.
    """
    env = os.environ if environ is None else environ
    if insecure is None:
        insecure = env.get("KVTRIO_INSECURE", "").strip().lower() in _TRUE
    server_key = server_key or env.get("KVTRIO_SERVER_KEY") or None
    if insecure or server_key == NO_KEY:
        return None
    client_key = client_key or env.get("KVTRIO_CLIENT_KEY") or None
    if server_key is None and client_key is None:
        directory = default_key_dir(env)
        server_file, client_file = directory / "server.key", directory / "client.key_secret"
        for file in (server_file, client_file):
            if not file.exists():
                raise ConfigError(
                    f"no CURVE keys for this client: {file} does not exist (a kvtrio server "
                    "creates the default keys on its first start, as this user: start it "
                    "first, or give server_key and client_key); for a server started with "
                    "--insecure, connect with --insecure (KVTRIO_INSECURE=1, insecure=True)"
                )
        server_key, client_key = str(server_file), str(client_file)
    if server_key is None or client_key is None:
        raise ConfigError(
            "CURVE needs both the server's public key (server_key, KVTRIO_SERVER_KEY) and the "
            "client's secret key file (client_key, KVTRIO_CLIENT_KEY)"
        )
    pair = load_keypair(client_key)
    assert pair.secret is not None
    return ClientCredentials(load_public_key(server_key), pair.public, pair.secret)


def curve_client_options(credentials: ClientCredentials | None) -> dict[int, bytes]:
    """Socket options that make a DEALER a CURVE client with ``credentials`` (none: plain)."""
    if credentials is None:
        return {}
    return {
        zmq.CURVE_SERVERKEY: credentials.server_public,
        zmq.CURVE_PUBLICKEY: credentials.public,
        zmq.CURVE_SECRETKEY: credentials.secret,
    }
