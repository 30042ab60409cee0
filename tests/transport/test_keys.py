"""CURVE key files, the allowed-keys list, default keys, the ZAP decision."""

from __future__ import annotations

import stat
import threading
from pathlib import Path

import pytest
import zmq
from zmq.utils import z85

from kvtrio.errors import ConfigError
from kvtrio.transport import (
    ensure_default_keys,
    load_allowed_keys,
    load_keypair,
    load_public_key,
    resolve_client_credentials,
    write_keypair,
)
from kvtrio.transport._zap import zap_reply


def test_keygen_writes_private_files_that_load_back(tmp_path: Path) -> None:
    directory = tmp_path / "a" / "keys"
    pair = write_keypair(directory, "engine", "acme,beta")
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    for name in ("engine.key", "engine.key_secret"):
        assert stat.S_IMODE((directory / name).stat().st_mode) == 0o600
    assert load_keypair(directory / "engine.key_secret") == pair
    assert load_public_key(str(directory / "engine.key")) == pair.public
    assert load_public_key(pair.public.decode()) == pair.public
    (allowed,) = load_allowed_keys(directory).values()
    assert allowed.tenants == {"acme", "beta"}
    assert allowed.may_use("acme")
    assert not allowed.may_use("victim")
    # zmq.auth reads our files too
    import zmq.auth

    assert zmq.auth.load_certificate(directory / "engine.key_secret") == (pair.public, pair.secret)


def test_bad_key_files_are_one_line_errors(tmp_path: Path) -> None:
    write_keypair(tmp_path, "x")
    with pytest.raises(ConfigError, match="no secret key"):
        load_keypair(tmp_path / "x.key")
    with pytest.raises(ConfigError, match="no tenants"):
        load_allowed_keys(tmp_path)  # a key without tenants may use nothing: refused
    (tmp_path / "junk").write_text("hello\n")
    with pytest.raises(ConfigError, match="not a CURVE key file"):
        load_keypair(tmp_path / "junk")
    with pytest.raises(ConfigError, match="expected PUBLIC_KEY TENANTS"):
        load_allowed_keys(tmp_path / "junk")
    with pytest.raises(ConfigError, match="cannot read"):
        load_keypair(tmp_path / "missing")
    with pytest.raises(ConfigError, match="key name"):
        write_keypair(tmp_path, "../evil")
    secret = (tmp_path / "x.key_secret").read_text()
    other = write_keypair(tmp_path / "o", "o")
    (tmp_path / "mixed").write_text(
        secret.replace(
            load_keypair(tmp_path / "x.key_secret").public.decode(), other.public.decode()
        )
    )
    with pytest.raises(ConfigError, match="does not match"):
        load_keypair(tmp_path / "mixed")


def test_default_keys_are_created_once_even_by_racing_processes(tmp_path: Path) -> None:
    directory = tmp_path / "keys"
    errors: list[BaseException] = []

    def create() -> None:
        try:
            ensure_default_keys(directory)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=create) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    server = load_keypair(directory / "server.key_secret")
    assert load_public_key(str(directory / "server.key")) == server.public
    client = load_keypair(directory / "client.key_secret")
    allowed = load_allowed_keys(directory / "clients")
    assert set(allowed) == {client.public}
    assert sorted(p.name for p in directory.iterdir()) == [
        "client.key",
        "client.key_secret",
        "clients",
        "server.key",
        "server.key_secret",
    ]
    credentials = resolve_client_credentials(environ={"KVTRIO_KEY_DIR": str(directory)})
    assert credentials is not None
    assert credentials.server_public == server.public
    # A client never creates keys (issue 22): only a server does, on its first start.
    with pytest.raises(ConfigError, match=r"no CURVE keys .*connect with --insecure"):
        resolve_client_credentials(environ={"KVTRIO_KEY_DIR": str(tmp_path / "fresh")})
    assert not (tmp_path / "fresh").exists()
    environ = {"KVTRIO_KEY_DIR": str(directory), "KVTRIO_SERVER_KEY": "none"}
    assert resolve_client_credentials(environ=environ) is None  # plain, to an --insecure server
    for plain in ({"KVTRIO_INSECURE": "1"}, {"KVTRIO_INSECURE": "yes", "KVTRIO_KEY_DIR": "/x"}):
        assert resolve_client_credentials(environ=plain) is None
    assert resolve_client_credentials(insecure=True, environ={}) is None
    assert resolve_client_credentials(environ={"KVTRIO_INSECURE": "0", **environ}) is None
    with pytest.raises(ConfigError, match="needs both"):
        resolve_client_credentials(server_key=server.public.decode(), environ={})


def test_zap_accepts_only_allowed_curve_keys() -> None:
    public, _ = zmq.curve_keypair()
    raw = z85.decode(public)

    def authorize(key: bytes, domain: bytes) -> str | None:
        return "user" if key == public and domain == b"kvtrio" else None

    def request(mechanism: bytes, *creds: bytes) -> list[bytes]:
        return [b"1.0", b"7", b"kvtrio", b"127.0.0.1", b"", mechanism, *creds]

    assert zap_reply(request(b"CURVE", raw), authorize)[1:5] == [b"7", b"200", b"OK", b"user"]
    other, _ = zmq.curve_keypair()
    assert zap_reply(request(b"CURVE", z85.decode(other)), authorize)[2] == b"400"
    assert zap_reply(request(b"NULL"), authorize)[2] == b"400"
    refused_there = [b"1.0", b"7", b"kvtrio-events", b"127.0.0.1", b"", b"CURVE", raw]
    assert zap_reply(refused_there, authorize)[2] == b"400"  # the domain reaches authorize
    assert zap_reply(request(b"PLAIN", b"u", b"p"), authorize)[2] == b"400"
    assert zap_reply([b"2.0", b"1"], authorize)[2] == b"500"
    assert zap_reply([], authorize)[2] == b"500"


def test_key_files_refuse_tenants_outside_the_alphabet(tmp_path: Path) -> None:
    """Issue 32, item 3: an allowed key whose tenants hold ``/`` (or anything outside
    ``[A-Za-z0-9._-]{0,64}``) is refused at start, in a directory or a list file."""
    from kvtrio.transport import write_keypair

    good = write_keypair(tmp_path / "ok", "e", "acme,beta-2,x.y_z")
    assert load_allowed_keys(tmp_path / "ok")[good.public].tenants == {"acme", "beta-2", "x.y_z"}
    with pytest.raises(ConfigError, match="not a tenant name"):
        write_keypair(tmp_path / "bad", "e", "a/b")
    listing = tmp_path / "allowed.txt"
    listing.write_text(f"{good.public.decode()} acme,a/b\n")
    with pytest.raises(ConfigError, match="not a tenant name"):
        load_allowed_keys(listing)
    listing.write_text(f"{good.public.decode()} *\n")
    assert load_allowed_keys(listing)[good.public].tenants == {"*"}
    pair = (tmp_path / "ok" / "e.key").read_text().replace('"acme,beta-2,x.y_z"', '"a/b"')
    (tmp_path / "ok" / "e.key").write_text(pair)
    with pytest.raises(ConfigError, match="not a tenant name"):
        load_allowed_keys(tmp_path / "ok")


def test_the_tenant_alphabet_is_the_protocols() -> None:
    """transport may not import protocol (tests/test_layers.py): one pattern, kept equal."""
    from kvtrio import protocol
    from kvtrio.transport import _keys

    assert protocol.TENANT_PATTERN == _keys.TENANT_PATTERN
