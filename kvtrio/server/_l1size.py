"""How big the L1 is: ``--l1-size`` exactly as given, or, by default, sized from the machine.

The L1 is committed when the server starts (every page allocated: a tmpfs that fills up later
would SIGBUS an engine worker writing into its slots, far from the cause), so its default must
fit the machine it starts on: a laptop, a container whose ``/dev/shm`` is Docker's 64 MiB, a
cgroup with a memory limit. The default is the smallest of

- :data:`DEFAULT_CAP` (4 GiB): a default should not take more; more is the operator's choice;
- :data:`SHM_SHARE` (half) of the free space of the L1's directory (``/dev/shm``), which the
  engines share: vLLM's own processes and torch put their shared memory there too;
- :data:`MEMORY_SHARE` (a quarter) of the memory kvtrio may still take: ``MemAvailable``, or
  less if the memory cgroup allows less (its limit minus what it holds that cannot be
  reclaimed). The engines are the main users of the host's memory (weights, their own KV
  cache), and kvtrio often starts before them, so it leaves them three quarters;

rounded down (to 64 MiB below 1 GiB, to 512 MiB above, so that it reads as it is), split into
``--l1-tenants`` arenas, each at least :data:`MIN_ARENA`. Below that the server refuses to
start, in one line, rather than run a cache that cannot hold a few chunks of a real model.

An explicit ``--l1-size`` is taken as given (split the same way); it is refused only if the
directory cannot hold it, and a warning says so if it exceeds the memory available.

:func:`measure_room` is the only code that reads the machine (``statvfs``, ``/proc/meminfo``,
the cgroup files); :func:`plan_l1` is pure. No trio, no waiting.
"""

from __future__ import annotations

import os
from pathlib import Path

from attrs import frozen

from ..config import ServerConfig
from ..errors import ConfigError
from ..options import format_size

__all__ = [
    "DEFAULT_CAP",
    "MEMORY_SHARE",
    "MIN_ARENA",
    "SHM_SHARE",
    "L1Plan",
    "Room",
    "measure_room",
    "plan_l1",
]

DEFAULT_CAP = 4 << 30
SHM_SHARE = 0.5
MEMORY_SHARE = 0.25
MIN_ARENA = 256 << 20
"""The smallest default arena: 8 chunks of 256 tokens of a Llama-3-8B-shaped cache (32 layers,
8 KV heads × 128, fp16: 128 KiB per token, 32 MiB per chunk); thousands of a small model's."""

_UNLIMITED = 1 << 60
"""cgroup v1 writes "no limit" as a huge number (9223372036854771712)."""


@frozen
class Room:
    """What the machine has for the L1 when the server starts."""

    directory: str
    """The L1's directory (``--shm-dir``, else ``/dev/shm``)."""
    shm_free: int
    """Bytes free in ``directory`` (for this user: ``f_bavail``)."""
    memory: int | None = None
    """Bytes of memory kvtrio may still take; None where it is not known (not Linux)."""
    memory_limited_by_cgroup: bool = False
    """True if ``memory`` is what the memory cgroup allows (less than ``MemAvailable``)."""


@frozen
class L1Plan:
    """The L1 the server commits: ``tenants`` arenas of ``arena`` bytes in ``directory``."""

    size: int
    """All arenas together (the value ``l1_size`` takes once the server runs)."""
    arena: int
    directory: str
    sizing: str
    """Why this size, for people: ``default``, ``configured``, ``50% of /dev/shm's 3GiB free``."""
    warning: str = ""
    """A reason to worry that does not stop the start (an explicit size above the memory)."""


def measure_room(directory: str) -> Room:
    """Measure ``directory``'s free space and the memory this process may still take.

    :class:`ConfigError` (one line) if ``directory`` cannot be examined. Blocking only for
    reads of ``/proc`` and ``/sys`` files, which do not wait.
    """
    try:
        stat = os.statvfs(directory)
    except OSError as exc:
        raise ConfigError(f"shm_dir {directory}: {exc.strerror}") from None
    available = _mem_available()
    cgroup = _cgroup_room()
    limited = cgroup is not None and (available is None or cgroup < available)
    return Room(
        directory=directory,
        shm_free=stat.f_bavail * stat.f_frsize,
        memory=cgroup if limited else available,
        memory_limited_by_cgroup=limited,
    )


def plan_l1(config: ServerConfig, room: Room) -> L1Plan:
    """The L1 for ``config`` on a machine with ``room``: ``config.l1_size`` if set (None means
    the default), else the default rule (module docstring). :class:`ConfigError` in one line if
    it does not fit."""
    tenants = config.l1_tenants
    where = room.directory
    if config.l1_size is not None:
        size = config.l1_size
        if room.shm_free < size:
            raise ConfigError(
                f"the L1 needs {format_size(size)} in {where}, which has "
                f"{format_size(room.shm_free)} free: lower --l1-size, or give {where} more room "
                "(a container: --shm-size, or --ipc=host)"
            )
        warning = ""
        if room.memory is not None and size > room.memory:
            warning = (
                f"the L1 ({format_size(size)}) is more than the {_memory(room)}: the machine "
                "may swap, or the OOM killer stop kvtrio or an engine"
            )
        arena = size // tenants
        return L1Plan(size, arena, where, _split("configured", arena, tenants), warning)

    limits = [(DEFAULT_CAP, "default")]
    shm_share = int(room.shm_free * SHM_SHARE)
    limits.append((shm_share, f"{SHM_SHARE:.0%} of {where}'s {format_size(room.shm_free)} free"))
    if room.memory is not None:
        limits.append(
            (int(room.memory * MEMORY_SHARE), f"{MEMORY_SHARE:.0%} of the {_memory(room)}")
        )
    budget, why = min(limits, key=lambda limit: limit[0])
    arena = _round_down(budget // tenants)
    if arena < MIN_ARENA:
        each = f" ({format_size(budget // tenants)} per tenant arena)" if tenants > 1 else ""
        fix = (
            f"give {where} more room (a container: --shm-size=1g, or --ipc=host)"
            if budget == shm_share
            else "free some memory"
        )
        raise ConfigError(
            f"no room for the default L1: {why} is {format_size(budget)}{each}, below its "
            f"minimum of {format_size(MIN_ARENA)} per arena: {fix}, or set --l1-size (taken as "
            "given)"
        )
    return L1Plan(arena * tenants, arena, where, _split(why, arena, tenants))


def _split(why: str, arena: int, tenants: int) -> str:
    return f"{why}; {tenants} tenant arenas of {format_size(arena)}" if tenants > 1 else why


def _memory(room: Room) -> str:
    amount = format_size(room.memory or 0)
    if room.memory_limited_by_cgroup:
        return f"{amount} of memory the memory cgroup still allows"
    return f"{amount} of memory available"


def _round_down(size: int) -> int:
    """To 64 MiB below 1 GiB, to 512 MiB above: a size that :func:`format_size` shows exactly."""
    step = 512 << 20 if size >= 1 << 30 else 64 << 20
    return size - size % step


# --------------------------------------------------------------------------- reading the machine


def _mem_available() -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes; None where there is none (not Linux)."""
    try:
        text = Path("/proc/meminfo").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return None


def _cgroup_room(
    cgroup_file: Path = Path("/proc/self/cgroup"), sys_root: Path = Path("/sys/fs/cgroup")
) -> int | None:
    """Bytes the memory cgroups of this process still allow (the tightest of its cgroup and
    their ancestors, v1 or v2), or None if none of them has a limit or none is readable.

    What a cgroup holds in reclaimable page cache (inactive files) counts as room, as
    ``docker stats`` counts it. In a container the cgroup's path may not exist under
    ``/sys/fs/cgroup``: then the nearest existing ancestor (the container's own cgroup) is read.
    """
    try:
        lines = cgroup_file.read_text().splitlines()
    except OSError:
        return None
    rooms: list[int] = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            root, files = sys_root, ("memory.max", "memory.current", "inactive_file")
        elif "memory" in controllers.split(","):
            root = sys_root / "memory"
            files = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
        else:
            continue
        node = root / path.lstrip("/")
        while True:
            room = _room_of(node, *files)
            if room is not None:
                rooms.append(room)
            if node == root or root not in node.parents:
                break
            node = node.parent
    return min(rooms) if rooms else None


def _room_of(node: Path, limit_file: str, usage_file: str, inactive_key: str) -> int | None:
    try:
        limit_text = (node / limit_file).read_text().strip()
        if limit_text == "max" or int(limit_text) >= _UNLIMITED:
            return None
        usage = int((node / usage_file).read_text())
        inactive = 0
        for line in (node / "memory.stat").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == inactive_key:
                inactive = int(value)
    except (OSError, ValueError):
        return None
    return max(0, int(limit_text) - max(0, usage - inactive))
