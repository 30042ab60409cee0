"""One disk L2 directory, one backend; a path or secret that can never work is said at once
(issue 32: item 8 and item 9 of "found by attacking it", item 5 of "found by using it").

Each test here failed on 1bb9379: a second backend on a directory in use shared it silently
(each overwrote the other's records), a path under ``/proc`` or under a regular file was a
plain (retried) BackendError, a secret that is a FIFO hung the scan for good, and records of a
replaced secret were logged as "torn writes or damage"."""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import pytest
import trio

from kvtrio.l2 import BackendMisconfigured
from kvtrio.l2._diskio import key_id, key_id_of, parse_record_header, record_header
from kvtrio.l2._disklock import DirectoryLock
from kvtrio.l2.disk import DiskBackend, DiskOptions

KEY = b"k" * 32


def _disk(path: Path) -> DiskBackend:
    return DiskBackend(DiskOptions(path=str(path)))


async def test_a_second_backend_on_a_directory_in_use_is_refused_naming_the_holder(
    tmp_path: Path,
) -> None:
    first = _disk(tmp_path)
    assert await first.store([KEY], [[b"x" * 100]]) == [True]
    second = _disk(tmp_path)
    with pytest.raises(BackendMisconfigured) as refused:
        await second.lookup_and_lock([KEY])
    message = str(refused.value)
    assert message.startswith(f"disk: {tmp_path} is in use by another kvtrio server")
    assert f"(pid {os.getpid()})" in message
    assert "\n" not in message
    assert not any((tmp_path / "segments").glob("*.tmp"))
    assert await first.lookup_and_lock([KEY]) == 1  # the holder is untouched
    await first.unlock([KEY])
    await first.aclose()  # released: the next one may use it, and finds the object
    assert await second.lookup_and_lock([KEY]) == 1
    await second.aclose()


def test_the_lock_goes_with_its_holder_and_names_no_pid_it_does_not_know(tmp_path: Path) -> None:
    lock, other = DirectoryLock(tmp_path), DirectoryLock(tmp_path)
    lock.acquire()
    lock.acquire()  # (held already: nothing)
    (tmp_path / "lock").write_text("")  # a holder that wrote nothing yet
    with pytest.raises(Exception, match=r"in use by another kvtrio server \(pid unknown\)"):
        other.acquire()
    lock.release()
    other.acquire()
    assert other.held
    assert (tmp_path / "lock").read_text().split()[0] == str(os.getpid())
    other.release()
    assert (tmp_path / "lock").exists()  # the file stays, only the lock goes


@pytest.mark.parametrize("where", ["proc", "under_a_file", "a_file"])
async def test_a_path_that_can_never_work_is_misconfigured(tmp_path: Path, where: str) -> None:
    (tmp_path / "file").write_text("x")
    path = {
        "proc": Path("/proc/kvtrio-no-such-dir/l2"),
        "under_a_file": tmp_path / "file" / "l2",
        "a_file": tmp_path / "file",
    }[where]
    with pytest.raises(BackendMisconfigured, match=rf"^disk: cannot use {path}: .*; set path="):
        await _disk(path).lookup_and_lock([KEY])


def test_a_secret_that_is_a_fifo_is_refused_at_once(tmp_path: Path) -> None:
    """Was: the scan opened the FIFO to read it and waited for a writer forever."""
    os.mkfifo(tmp_path / "secret")
    outcome: list[BaseException | int] = []

    def start() -> None:  # (in a thread of its own: a hang must not hang the suite)
        try:
            outcome.append(trio.run(_disk(tmp_path).lookup_and_lock, [KEY]))
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=start, daemon=True)
    thread.start()
    thread.join(10)
    if thread.is_alive():
        with open(tmp_path / "secret", "wb"):  # (a writer: the hung scan goes on and ends)
            pass
        pytest.fail("the scan hangs on a FIFO secret")
    (error,) = outcome
    assert isinstance(error, BackendMisconfigured), error
    assert str(error) == f"disk: {tmp_path / 'secret'} is a FIFO; expected a regular file"


@pytest.mark.parametrize("how", ["replaced", "flipped"])
async def test_records_of_a_replaced_secret_are_logged_as_such(
    tmp_path: Path, how: str, caplog: pytest.LogCaptureFixture
) -> None:
    backend = _disk(tmp_path)
    assert await backend.store([KEY], [[b"x" * 100]]) == [True]
    await backend.aclose()
    if how == "replaced":  # another 32-byte secret (a copy from another node, a restore)
        (tmp_path / "secret").write_bytes(os.urandom(32))
    else:  # one flipped bit in the record's header: damage, not a secret
        segment = next((tmp_path / "segments").iterdir())
        with segment.open("r+b") as file:
            file.seek(20)
            bit = file.read(1)[0] ^ 1
            file.seek(20)
            file.write(bytes([bit]))
    caplog.set_level(logging.WARNING, logger="kvtrio.l2.disk")
    restarted = _disk(tmp_path)
    assert await restarted.lookup_and_lock([KEY]) == 0  # never trusted, either way
    stats = restarted.statistics()
    assert stats["scan_damaged"] == 1
    (line,) = [r.getMessage() for r in caplog.records if "damaged" in r.getMessage()]
    if how == "replaced":
        assert stats["scan_other_secret"] == 1
        assert "signed with another secret" in line, line
        assert "torn" not in line, line
    else:
        assert "scan_other_secret" not in stats
        assert "torn writes or damage" in line, line
        assert "another secret" not in line, line
    await restarted.aclose()


def test_the_key_id_names_the_secret_outside_the_mac() -> None:
    secret, other = os.urandom(32), os.urandom(32)
    header = record_header(KEY, 100, b"", secret)
    assert key_id_of(header) == key_id(secret) != key_id(other)
    assert len(key_id(secret)) == 8
    assert any(key_id(secret))
    assert key_id_of(bytes(len(header))) is None  # zeros: no header
    old = header[:80] + bytes(len(header) - 80)  # a record written before key ids existed
    assert key_id_of(old) is None
    assert parse_record_header(old, secret)[:3] == (KEY, 100, b"")  # and it is still a record
