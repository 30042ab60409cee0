"""``kvtrio keygen`` and the security flags of the command line."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from kvtrio.cli import _build_parser, main
from kvtrio.transport import load_allowed_keys, load_keypair


def test_keygen_writes_a_pair_a_server_accepts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    directory = tmp_path / "clients"
    main(["keygen", "engine-a", "--dir", str(directory), "--tenants", "acme,beta"])
    pair = load_keypair(directory / "engine-a.key_secret")
    assert pair.public.decode() in capsys.readouterr().out
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    assert stat.S_IMODE((directory / "engine-a.key_secret").stat().st_mode) == 0o600
    (allowed,) = load_allowed_keys(directory).values()
    assert allowed.tenants == {"acme", "beta"}
    with pytest.raises(SystemExit) as exited:  # never overwrites a secret
        main(["keygen", "engine-a", "--dir", str(directory)])
    assert exited.value.code == 1
    assert load_keypair(directory / "engine-a.key_secret") == pair


def test_security_flags_parse() -> None:
    args = _build_parser().parse_args(
        ["serve", "--insecure", "--max-sessions", "8", "--ipc-group", "kv"]
    )
    assert (args.insecure, args.max_sessions, args.ipc_group) == (True, "8", "kv")
    assert not hasattr(_build_parser().parse_args(["serve"]), "insecure")
    ping = _build_parser().parse_args(["ping", "--server-key", "s.key", "--client-key", "c"])
    assert (ping.server_key, ping.client_key) == ("s.key", "c")


@pytest.mark.parametrize("tenants", ["a/b", "acme,a b", "x" * 65, "caf\u00e9"])
def test_keygen_refuses_a_tenant_outside_the_alphabet(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], tenants: str
) -> None:
    """Issue 32, item 3: tenant names are [A-Za-z0-9._-]{0,64} (docs/security.md): ``a/b``
    would have received tenant ``a``'s KV events. One line, no key written."""
    with pytest.raises(SystemExit) as exited:
        main(["keygen", "engine-a", "--dir", str(tmp_path), "--tenants", tenants])
    assert exited.value.code != 0
    err = capsys.readouterr().err.strip()
    assert "not a tenant name" in err
    assert len(err.splitlines()) == 1
    assert not list(tmp_path.iterdir())
