"""The L1's size: ``--l1-size`` as given, or the default sized from the machine.

The rule is tested on measured rooms passed in (a machine with 64 MiB of ``/dev/shm`` or a
memory cgroup cannot be made here without privileges), the cgroup reader on cgroup trees
written like the kernel's, and the whole start for real: a ``kvtrio serve`` on a small tmpfs
mounted over ``/dev/shm`` in a user and mount namespace of its own (``unshare -rm``, no root
needed where unprivileged user namespaces are allowed; skipped elsewhere).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvtrio.client import open_client
from kvtrio.config import ServerConfig
from kvtrio.errors import ConfigError
from kvtrio.options import format_size
from kvtrio.protocol import GetStats, StatsReply
from kvtrio.server import _serve, open_server, status_document, status_summary
from kvtrio.server._l1size import (
    DEFAULT_CAP,
    MIN_ARENA,
    Room,
    _cgroup_room,
    measure_room,
    plan_l1,
)

GiB, MiB = 1 << 30, 1 << 20
BIG = 1 << 40


def plan(room: Room, **settings: object) -> tuple[int, int, str, str]:
    result = plan_l1(ServerConfig(**settings), room)  # type: ignore[arg-type]
    return result.size, result.arena, result.sizing, result.warning


def test_a_big_machine_gets_the_4GiB_default() -> None:
    assert plan(Room("/dev/shm", BIG, BIG)) == (DEFAULT_CAP, DEFAULT_CAP, "default", "")
    assert plan(Room("/dev/shm", BIG, None)) == (DEFAULT_CAP, DEFAULT_CAP, "default", "")


def test_a_small_dev_shm_halves_its_free_space_rounded_down() -> None:
    size, _, sizing, _ = plan(Room("/dev/shm", int(3.4 * GiB), BIG))
    assert (size, sizing) == (int(1.5 * GiB), "50% of /dev/shm's 3.4GiB free")
    size, _, sizing, _ = plan(Room("/mnt/shm", 700 * MiB, BIG), shm_dir="/mnt/shm")
    assert (size, sizing) == (320 * MiB, "50% of /mnt/shm's 700MiB free")


def test_little_memory_takes_a_quarter_of_what_is_available() -> None:
    size, _, sizing, _ = plan(Room("/dev/shm", BIG, 6 * GiB))
    assert (size, sizing) == (int(1.5 * GiB), "25% of the 6GiB of memory available")
    size, _, sizing, _ = plan(Room("/dev/shm", BIG, 2 * GiB, memory_limited_by_cgroup=True))
    assert (size, sizing) == (512 * MiB, "25% of the 2GiB of memory the memory cgroup still allows")


def test_sizes_are_rounded_to_what_they_read() -> None:
    for shm in range(600 * MiB, 40 * GiB, 77 * MiB):
        size = plan(Room("/dev/shm", shm, BIG))[0]
        assert size <= min(DEFAULT_CAP, shm // 2)
        assert size % (64 * MiB) == 0
        if size >= GiB:
            assert size % (512 * MiB) == 0
        assert (
            float(re.sub("[MG]iB", "", format_size(size))) * (GiB if size >= GiB else MiB) == size
        )  # 1.5GiB is 1.5 GiB exactly


def test_tenants_split_the_default_and_each_arena_keeps_the_minimum() -> None:
    size, arena, sizing, _ = plan(Room("/dev/shm", 3 * GiB, BIG), l1_tenants=4)
    assert (size, arena) == (4 * 384 * MiB, 384 * MiB)
    assert sizing == "50% of /dev/shm's 3GiB free; 4 tenant arenas of 384MiB"
    with pytest.raises(ConfigError, match=r"is 1\.5GiB \(192MiB per tenant arena\), below its "):
        plan(Room("/dev/shm", 3 * GiB, BIG), l1_tenants=8)


def test_docker_s_64MiB_dev_shm_refuses_the_default_in_one_line() -> None:
    with pytest.raises(ConfigError) as error:
        plan(Room("/dev/shm", 64 * MiB, BIG))
    assert str(error.value) == (
        "no room for the default L1: 50% of /dev/shm's 64MiB free is 32MiB, below its minimum "
        "of 256MiB per arena: give /dev/shm more room (a container: --shm-size=1g, or "
        "--ipc=host), or set --l1-size (taken as given)"
    )
    with pytest.raises(ConfigError, match=r"of memory available is 250MiB, .*: free some memory"):
        plan(Room("/dev/shm", BIG, 1000 * MiB))
    assert plan(Room("/dev/shm", 2 * MIN_ARENA, BIG))[0] == MIN_ARENA  # just enough


def test_an_explicit_size_is_taken_exactly() -> None:
    odd = 1_234_567_891
    assert plan(Room("/dev/shm", BIG, BIG), l1_size=odd) == (odd, odd, "configured", "")
    assert plan(Room("/dev/shm", 40 * MiB, BIG), l1_size=32 * MiB)[:3] == (
        32 * MiB, 32 * MiB, "configured"
    )  # fmt: skip  # below the default's minimum: the operator's call
    size, arena, sizing, _ = plan(Room("/dev/shm", BIG, BIG), l1_size=8 * GiB, l1_tenants=2)
    assert (size, arena, sizing) == (8 * GiB, 4 * GiB, "configured; 2 tenant arenas of 4GiB")


def test_an_explicit_size_that_dev_shm_cannot_hold_is_refused() -> None:
    with pytest.raises(ConfigError) as error:
        plan(Room("/dev/shm", 64 * MiB, BIG), l1_size=128 * MiB)
    assert str(error.value) == (
        "the L1 needs 128MiB in /dev/shm, which has 64MiB free: lower --l1-size, or give "
        "/dev/shm more room (a container: --shm-size, or --ipc=host)"
    )


def test_an_explicit_size_above_the_memory_starts_with_a_warning() -> None:
    *_, warning = plan(Room("/dev/shm", BIG, 6 * GiB), l1_size=8 * GiB)
    assert warning == (
        "the L1 (8GiB) is more than the 6GiB of memory available: the machine may swap, or the "
        "OOM killer stop kvtrio or an engine"
    )


# --------------------------------------------------------------------------- reading the machine


@pytest.mark.skipif(not Path("/proc/meminfo").exists(), reason="Linux only")
def test_measure_room_reads_this_machine(tmp_path: Path) -> None:
    room = measure_room(str(tmp_path))
    stat = os.statvfs(tmp_path)
    assert abs(room.shm_free - stat.f_bavail * stat.f_frsize) < 64 * MiB  # (others write too)
    total = int(Path("/proc/meminfo").read_text().split()[1]) * 1024  # MemTotal comes first
    assert room.memory is not None
    assert 0 < room.memory <= total
    with pytest.raises(ConfigError, match="shm_dir /nonexistent: No such file or directory"):
        measure_room("/nonexistent")


def write_tree(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def test_cgroup_v2_limit_minus_what_cannot_be_reclaimed(tmp_path: Path) -> None:
    """A container limited to 4 GiB (``docker run --memory 4g``), holding 1.5 GiB of which
    0.5 GiB is inactive page cache; its parent has no limit."""
    write_tree(
        tmp_path,
        {
            "proc": "0::/docker/abc\n",
            "sys/memory.stat": "anon 1\n",  # the root: no memory.max
            "sys/docker/memory.max": "max\n",
            "sys/docker/memory.current": "0\n",
            "sys/docker/memory.stat": "inactive_file 0\n",
            "sys/docker/abc/memory.max": f"{4 * GiB}\n",
            "sys/docker/abc/memory.current": f"{int(1.5 * GiB)}\n",
            "sys/docker/abc/memory.stat": f"anon 5\ninactive_file {GiB // 2}\nactive_file 9\n",
        },
    )
    assert _cgroup_room(tmp_path / "proc", tmp_path / "sys") == 3 * GiB


def test_cgroup_v2_inside_the_container_namespace(tmp_path: Path) -> None:
    """With a cgroup namespace the container sees itself as ``/``: its files are the root's."""
    write_tree(
        tmp_path,
        {
            "proc": "0::/\n",
            "sys/memory.max": f"{2 * GiB}\n",
            "sys/memory.current": f"{GiB}\n",
            "sys/memory.stat": "inactive_file 0\n",
        },
    )
    assert _cgroup_room(tmp_path / "proc", tmp_path / "sys") == GiB


def test_cgroup_v1_takes_the_tightest_ancestor_and_ignores_no_limit(tmp_path: Path) -> None:
    unlimited = "9223372036854771712\n"
    write_tree(
        tmp_path,
        {
            "proc": "12:cpu,cpuacct:/x\n4:memory:/pod/box\n1:name=systemd:/x\n",
            "sys/memory/memory.limit_in_bytes": unlimited,
            "sys/memory/pod/memory.limit_in_bytes": f"{3 * GiB}\n",
            "sys/memory/pod/memory.usage_in_bytes": f"{2 * GiB}\n",
            "sys/memory/pod/memory.stat": f"inactive_file 7\ntotal_inactive_file {GiB // 4}\n",
            "sys/memory/pod/box/memory.limit_in_bytes": f"{8 * GiB}\n",
            "sys/memory/pod/box/memory.usage_in_bytes": f"{GiB}\n",
            "sys/memory/pod/box/memory.stat": "total_inactive_file 0\n",
        },
    )
    assert _cgroup_room(tmp_path / "proc", tmp_path / "sys") == GiB + GiB // 4
    (tmp_path / "sys/memory/pod/memory.limit_in_bytes").write_text(unlimited)
    assert _cgroup_room(tmp_path / "proc", tmp_path / "sys") == 7 * GiB
    (tmp_path / "sys/memory/pod/box/memory.limit_in_bytes").write_text(unlimited)
    assert _cgroup_room(tmp_path / "proc", tmp_path / "sys") is None  # no limit anywhere


def test_a_container_s_cgroup_path_missing_from_its_sys_reads_the_nearest(tmp_path: Path) -> None:
    """cgroup v1 without a namespace: /proc/self/cgroup names the host's path, which the
    container's /sys/fs/cgroup/memory (its own cgroup) does not have."""
    write_tree(
        tmp_path,
        {
            "proc": "4:memory:/docker/0123abcd\n",
            "sys/memory/memory.limit_in_bytes": f"{GiB}\n",
            "sys/memory/memory.usage_in_bytes": "0\n",
            "sys/memory/memory.stat": "total_inactive_file 0\n",
        },
    )
    assert _cgroup_room(tmp_path / "proc", tmp_path / "sys") == GiB
    assert _cgroup_room(tmp_path / "missing", tmp_path / "sys") is None


# --------------------------------------------------------------------------- the server


async def test_status_says_the_size_and_why(
    endpoint: str, short_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server sizes its L1 from the room measured at start (here: 600 MiB free), and
    ``stats`` / ``kvtrio status`` carry the size and the reason."""
    monkeypatch.setattr(_serve, "measure_room", lambda directory: Room(directory, 600 * MiB, BIG))
    config = ServerConfig(endpoint=endpoint, l2=(), shm_dir=str(short_dir))
    assert config.l1_size is None
    async with open_server(config) as handle, open_client(endpoint) as client:
        assert handle.state.config.l1_size == 256 * MiB
        stats = await client.call(GetStats(), StatsReply)
    document = status_document(stats)
    assert document["config"]["l1_size"] == 256 * MiB
    assert document["config"]["storage"]["l1"] == {
        "bytes": 256 * MiB,
        "directory": str(short_dir),
        "sizing": f"50% of {short_dir}'s 600MiB free",
    }
    assert f"size: 256MiB (50% of {short_dir}'s 600MiB free) in {short_dir}" in (
        status_summary(document).splitlines()
    )


async def test_a_start_that_does_not_fit_leaves_nothing_behind(
    endpoint: str, short_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_serve, "measure_room", lambda directory: Room(directory, 64 * MiB, BIG))
    with pytest.raises(ConfigError, match="no room for the default L1"):
        async with open_server(ServerConfig(endpoint=endpoint, l2=(), shm_dir=str(short_dir))):
            pass  # pragma: no cover
    assert os.listdir(short_dir) == []  # no arena file, no socket


# --------------------------------------------------------------------------- for real


def serve_on_a_small_dev_shm(size: str, *args: str, short_dir: Path) -> str:
    """Run ``kvtrio serve ARGS`` with a tmpfs of ``size`` mounted over ``/dev/shm`` (its own
    mount namespace), then ``kvtrio status`` against it, then stop it; return the output."""
    kvtrio = str(Path(sys.executable).with_name("kvtrio"))
    endpoint = f"ipc://{short_dir}/s.sock"
    script = textwrap.dedent(
        f"""
        set -u
        mount -t tmpfs -o size={size} tmpfs /dev/shm || exit 77
        {kvtrio} serve --endpoint {endpoint} --l2 none {" ".join(args)} 2>&1 &
        for i in $(seq 200); do
            {kvtrio} status {endpoint} 2>/dev/null && break
            kill -0 $! 2>/dev/null || break
            sleep 0.05
        done
        kill -TERM $! 2>/dev/null
        wait $!
        echo "exit $?"
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTRIO_")}
    env["KVTRIO_KEY_DIR"] = str(short_dir / "keys")  # (ipc needs no keys; never ~/.config)
    run = subprocess.run(
        ["unshare", "-rm", "sh", "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    if run.returncode == 77:
        pytest.skip(f"cannot mount a tmpfs in a user namespace here: {run.stderr.strip()}")
    return run.stdout + run.stderr


@pytest.fixture
def user_namespaces() -> None:
    if shutil.which("unshare") is None:
        pytest.skip("no unshare (util-linux)")
    probe = subprocess.run(["unshare", "-rm", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"unprivileged user namespaces are not allowed here: {probe.stderr.strip()}")


@pytest.mark.usefixtures("user_namespaces")
def test_on_docker_s_64MiB_dev_shm_the_default_stops_in_one_line(short_dir: Path) -> None:
    output = serve_on_a_small_dev_shm("64m", short_dir=short_dir)
    assert output.splitlines()[0] == (
        "kvtrio: error: no room for the default L1: 50% of /dev/shm's 64MiB free is 32MiB, "
        "below its minimum of 256MiB per arena: give /dev/shm more room (a container: "
        "--shm-size=1g, or --ipc=host), or set --l1-size (taken as given)"
    )
    assert output.splitlines()[-1] == "exit 2"
    output = serve_on_a_small_dev_shm("64m", "--l1-size", "32MiB", short_dir=short_dir)
    assert "data: L1 32MiB (configured) of shared memory in /dev/shm, committed now" in output
    assert "size: 32MiB (configured) in /dev/shm" in output
    assert output.splitlines()[-1] == "exit 0"
    output = serve_on_a_small_dev_shm("64m", "--l1-size", "65MiB", short_dir=short_dir)
    assert "kvtrio: error: the L1 needs 65MiB in /dev/shm, which has 64MiB free" in output


@pytest.mark.usefixtures("user_namespaces")
def test_on_a_700MiB_dev_shm_the_default_takes_half_and_says_so(short_dir: Path) -> None:
    output = serve_on_a_small_dev_shm("700m", short_dir=short_dir)
    assert output.splitlines()[-1] == "exit 0", output
    data = next(line for line in output.splitlines() if " data: " in line)
    # Half of 700 MiB, unless this machine has less than 1.3 GiB of memory available.
    match = re.search(
        r"data: L1 (\S+) \(([^)]*)\) of shared memory in /dev/shm, committed now", data
    )
    assert match is not None, data
    if "of memory" not in match[2]:
        assert match.groups() == ("320MiB", "50% of /dev/shm's 700MiB free")
    assert f"size: {match[1]} ({match[2]}) in /dev/shm" in output
