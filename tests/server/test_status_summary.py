"""Where the data goes, as the status and the start-up line tell it (no server needed)."""

from __future__ import annotations

from kvtrio.config import BackendSpec, ServerConfig
from kvtrio.server import describe_storage, storage_summary


def test_defaults_are_filled_in_and_passwords_masked() -> None:
    config = ServerConfig(
        l1_size=1 << 30,
        shm_dir="/tmp",
        l2=(
            BackendSpec("disk"),
            BackendSpec("memory", {"capacity": "8MiB"}),
            BackendSpec("nonexistent-backend", {"path": "/x", "secret": "s3cr3t"}),
        ),
    )
    storage = storage_summary(config, "configured")
    assert storage["l1"] == {"bytes": 1 << 30, "directory": "/tmp", "sizing": "configured"}
    disk, memory, unknown = storage["l2"]
    assert disk["path"].endswith("/.cache/kvtrio/l2")
    assert not disk["path"].startswith("~")
    assert disk["capacity_bytes"] == 32 << 30
    assert memory == {"name": "memory", "capacity_bytes": 8 << 20}
    assert unknown == {"name": "nonexistent-backend", "path": "/x"}  # never other options
    line = describe_storage(storage)
    assert line.startswith(
        "L1 1GiB (configured) of shared memory in /tmp, committed now; L2 disk /"
    )
    assert "(up to 32GiB), then memory (up to 8MiB), then nonexistent-backend /x" in line


def test_urls_lose_their_password() -> None:
    config = ServerConfig(l2=(BackendSpec("x", {"url": "redis://me:pw@cache:6379/0"}),))
    assert storage_summary(config)["l2"][0]["url"] == "redis://me:***@cache:6379/0"


def test_a_password_given_as_a_query_option_is_masked_too() -> None:
    """Was shown as given (redis-py reads ``?password=``), to every key's ``stats``."""
    url = "redis://cache:6379/0?password=s3cr3t&db=2&aws_secret_access_key=abc"
    storage = storage_summary(ServerConfig(l2=(BackendSpec("redis", {"url": url}),)))
    masked = "redis://cache:6379/0?password=***&db=2&aws_secret_access_key=***"
    assert storage["l2"][0]["url"] == masked
    assert "s3cr3t" not in describe_storage(storage)


def test_an_l1_not_sized_yet_reads_auto() -> None:
    storage = storage_summary(ServerConfig(l2=()))
    assert storage["l1"]["bytes"] is None
    assert describe_storage(storage).startswith("L1 auto of shared memory in ")
