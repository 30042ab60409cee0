"""Settings: precedence (flags > file > env > defaults) and one-line errors naming the source."""

from __future__ import annotations

import grp
from pathlib import Path

import attrs
import pytest

from kvtrio.config import ServerConfig, field_help, load_config
from kvtrio.errors import ConfigError
from kvtrio.options import parse_size
from kvtrio.transport import group_id


def test_defaults() -> None:
    config = load_config(environ={})
    assert config == ServerConfig()
    assert config.endpoint == "tcp://127.0.0.1:5577"
    assert config.chunk_size == 256


def test_precedence(tmp_path: Path) -> None:
    file = tmp_path / "kvtrio.toml"
    file.write_text('chunk_size = 512\nl1_size = "2GiB"\nlog_level = "debug"\n')
    env = {"KVTRIO_CHUNK_SIZE": "1024", "KVTRIO_LOOKUP_TIMEOUT": "0.25", "KVTRIO_OTHER": "x"}
    config = load_config({"log_level": "warning"}, config_file=file, environ=env)
    assert config.chunk_size == 512  # file beats env
    assert config.lookup_timeout == 0.25  # env beats default
    assert config.l1_size == 2 << 30
    assert config.log_level == "warning"  # flag beats file


def test_the_l1_size_is_auto_unless_given(tmp_path: Path) -> None:
    """None: sized from the machine when the server starts (tests/server/test_l1size.py)."""
    assert load_config(environ={}).l1_size is None
    assert load_config({"l1_size": "auto"}, environ={"KVTRIO_L1_SIZE": "2GiB"}).l1_size is None
    assert load_config(environ={"KVTRIO_L1_SIZE": "AUTO"}).l1_size is None
    file = tmp_path / "kvtrio.toml"
    file.write_text('l1_size = "auto"\n')
    assert load_config(config_file=file, environ={"KVTRIO_L1_SIZE": "2GiB"}).l1_size is None
    assert load_config({"l1_size": "768MiB"}, environ={}).l1_size == 768 << 20
    with pytest.raises(ConfigError, match=r"l1_size = '0' \(from --l1-size\): must be greater"):
        load_config({"l1_size": "0"}, environ={})


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("4096", 4096),
        (4096, 4096),
        ("4GiB", 4 << 30),
        ("1.5MB", 1_500_000),
        ("512m", 512 * 10**6),
        ("64KiB", 64 << 10),
        ("1_000", 1000),
        ("2 gib", 2 << 30),
    ],
)
def test_sizes(text: str | int, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize(
    ("overrides", "env", "message"),
    [
        ({"chunk_size": "abc"}, {}, "chunk_size = 'abc' (from --chunk-size): expected an integer"),
        ({}, {"KVTRIO_LOOKUP_TIMEOUT": "-1"}, "from environment variable KVTRIO_LOOKUP_TIMEOUT"),
        ({"l1_size": "4XB"}, {}, "is not a size"),
        ({"endpoint": "http://x"}, {}, "over tcp:// or ipc://, not http://"),
        ({"log_level": "loud"}, {}, "must be one of debug, info, warning, error"),
        ({"chunk_size": 1 << 21}, {}, "must be at most 1048576"),
        ({"chunk_size": 7}, {}, "chunk_size = 7 (from --chunk-size): must be a multiple of 16"),
        ({"chunk_size": 0}, {}, "must be greater than 0"),
        ({"max_message_size": "1B"}, {}, "max_message_size = '1B' (from --max-message-size): must"),
        (  # issue 22: was a 10-byte L1
            {"l1_size": "10"},
            {},
            "l1_size = '10' (from --l1-size): a size without a unit is bytes; did you mean "
            "10GiB or 10MiB? (10B for 10 bytes)",
        ),
        ({}, {"KVTRIO_MAX_MESSAGE_SIZE": "4096"}, "did you mean 4096MiB or 4096KiB?"),
        ({"max_message_size": "512KiB"}, {}, "must be at least 1048576"),
        (
            {"heartbeat_timeout": 0},
            {},
            "heartbeat_timeout = 0 (from --heartbeat-timeout): must be greater than 0",
        ),
        (  # issue 32: was a 62-line traceback at the start on a tcp endpoint
            {"ipc_group": "nosuchgroup"},
            {},
            "ipc_group = 'nosuchgroup' (from --ipc-group): no group named 'nosuchgroup'",
        ),
        ({}, {"KVTRIO_IPC_GROUP": "4294967295"}, "'4294967295' is not a group id"),
        # (was: accepted; SIGTERM then ended the server with a traceback, NaN as a deadline)
        ({"drain_timeout": "nan"}, {}, "drain_timeout = 'nan' (from --drain-timeout): must not"),
        ({}, {"KVTRIO_L2_WRITE_THROUGH": "nan"}, "l2_write_through = 'nan'"),
        ({"events_interval": "inf"}, {}, "must be greater than 0 (and finite), got inf"),
        ({"pin_ttl": "inf"}, {}, "pin_ttl = 'inf' (from --pin-ttl): must be greater than 0"),
    ],
)
def test_invalid_settings_are_one_line_errors(overrides: dict, env: dict, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(overrides, environ=env)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_file_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(config_file=tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("chunk_size = [")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(config_file=bad)
    unknown = tmp_path / "unknown.toml"
    unknown.write_text("chunk_sise = 5")
    with pytest.raises(ConfigError, match="unknown setting 'chunk_sise'"):
        load_config(config_file=unknown)
    typed = tmp_path / "typed.toml"
    typed.write_text("chunk_size = true")
    with pytest.raises(ConfigError, match=f"from {typed}"):
        load_config(config_file=typed)


def test_every_setting_has_help() -> None:
    helps = field_help()
    assert set(helps) == {a.name for a in attrs.fields(ServerConfig)}
    assert all(helps.values())


def test_security_settings_are_validated() -> None:
    config = load_config({"insecure": "yes", "lease_share": "0.5", "max_sessions": "8"})
    assert (config.insecure, config.lease_share, config.max_sessions) == (True, 0.5, 8)
    with pytest.raises(ConfigError, match="lease_share"):
        load_config({"lease_share": "1.5"})
    with pytest.raises(ConfigError, match="max_sessions_per_key"):
        load_config({"max_sessions_per_key": "0"})


def test_the_ipc_group_is_a_group_name_or_a_numeric_id() -> None:
    """Issue 32: ``--ipc-group 1000`` (docs/fleet.md's DaemonSet) was refused: no such name."""
    root = grp.getgrgid(0).gr_name
    assert load_config({"ipc_group": root}).ipc_group == root
    assert load_config({"ipc_group": "1000"}).ipc_group == "1000"  # (named or not)
    assert group_id("1000") == 1000
    assert group_id(root) == 0
