"""Which cores kvtrio's threads use in a CPU engine's worker: the ones the engine leaves free.

vLLM's CPU workers compute with OpenMP threads bound to ``VLLM_CPU_OMP_THREADS_BIND``'s cores;
torch binds the worker's main thread when it loads, and every thread started later inherits
that binding, kvtrio's transfer and I/O threads included. A store's copy then takes a core from
a compute thread, and one late thread holds up every other at the parallel region's end: with
both cores of a 2-core machine computing, decode steps took 3-10x longer while stores ran
(``docs/design.md``, "kvtrio's threads off the engine's cores"). vLLM reserves a core per rank
for an engine with a connector (``reserve_cpu_num``); this module finds the cores the engine's
processes may use but do not compute on, and puts kvtrio's threads there. Where there are none
(every core computes) they run at a lower priority instead, and the engine's log says how to
free a core. vLLM is imported only by :func:`engine_cpu_cores`, when a worker starts.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from collections.abc import Iterator, Mapping
from typing import Any

from ..client import ThreadPlacement

__all__ = [
    "SHARED_NICE",
    "affinity",
    "engine_cpu_cores",
    "frontend_advice",
    "omp_env_cpus",
    "worker_placement",
]

log = logging.getLogger("kvtrio.vllm")

SHARED_NICE = 10
"""Nice increment of kvtrio's worker threads where they share every core with the engine's
compute threads: they then run mostly when those wait (between steps), not in their place."""


def affinity(pid: int = 0) -> frozenset[int] | None:
    """The cores thread/process ``pid`` may run on (0: the calling thread); None where the OS
    cannot say."""
    try:
        return frozenset(os.sched_getaffinity(pid))
    except (OSError, AttributeError):
        return None


def _cpu_ids(text: str) -> set[int]:
    """``"0-2,5 7"`` (ranges, by commas or spaces) → ``{0, 1, 2, 5, 7}``; strides ``0-6:2``
    as GOMP writes them."""
    cpus: set[int] = set()
    for part in re.split(r"[,\s]+", text.strip()):
        found = re.fullmatch(r"(\d+)(?:-(\d+)(?::(\d+))?)?", part)
        if found:
            first, last, step = found.groups()
            cpus.update(range(int(first), int(last or first) + 1, int(step or 1)))
    return cpus


def omp_env_cpus(environ: Mapping[str, str]) -> frozenset[int] | None:
    """The cores this process's OpenMP threads are bound to, as vLLM told OpenMP through the
    environment it started the worker with (``GOMP_CPU_AFFINITY`` with libgomp preloaded,
    ``KMP_AFFINITY``'s ``proclist`` with Intel's, else ``OMP_PLACES``); None if none says."""
    if gomp := environ.get("GOMP_CPU_AFFINITY"):
        return frozenset(_cpu_ids(gomp)) or None
    if (kmp := re.search(r"proclist=\[([^\]]*)\]", environ.get("KMP_AFFINITY", ""))) is not None:
        return frozenset(_cpu_ids(kmp.group(1))) or None
    if places := environ.get("OMP_PLACES"):
        return frozenset(_cpu_ids(places.replace("{", ",").replace("}", ","))) or None
    return None


def _spare(
    compute: frozenset[int], reserved: frozenset[int], allowed: frozenset[int] | None
) -> frozenset[int]:
    """The cores kvtrio's threads (and vLLM's front end) should use: vLLM's reserved ones, else
    the allowed ones nobody computes on; never a compute core."""
    return (reserved or (allowed or frozenset()) - compute) - compute


def worker_placement(
    compute: frozenset[int] | None,
    reserved: frozenset[int] = frozenset(),
    allowed: frozenset[int] | None = None,
) -> tuple[ThreadPlacement, str]:
    """Where a CPU worker's kvtrio threads run, and a sentence for the log (a warning when
    they share the compute cores).

    ``compute``: the cores the engine's compute threads use, every rank's (None: unknown, the
    threads stay where they are); ``reserved``: those vLLM keeps free for other work (its
    scheduler, a connector); ``allowed``: those the engine's processes may use. kvtrio's
    threads take the reserved cores, else the allowed ones nobody computes on, else share the
    compute cores at a lower priority."""
    if compute is None:
        return ThreadPlacement(), "kvtrio's threads run where the worker's threads do"
    spare = _spare(compute, reserved, allowed)
    if spare:
        placement = ThreadPlacement(cpus=spare)
        return placement, (
            f"kvtrio's copies run on {placement.describe()}, off the engine's compute "
            f"{ThreadPlacement(cpus=compute).describe()}"
        )
    placement = ThreadPlacement(nice=SHARED_NICE)
    return placement, (
        f"every core this engine may use ({ThreadPlacement(cpus=compute).describe()}) runs its "
        f"compute threads, so kvtrio's copies share them ({placement.describe()}) and can slow "
        "its steps: leave a core free (VLLM_CPU_NUM_OF_RESERVED_CPU=1, or a "
        "VLLM_CPU_OMP_THREADS_BIND without the last core), as vLLM does for an engine with "
        "a connector where it has cores to spare"
    )


def frontend_advice(
    compute: frozenset[int] | None,
    reserved: frozenset[int] = frozenset(),
    allowed: frozenset[int] | None = None,
    own: frozenset[int] | None = None,
) -> str | None:
    """For vLLM's engine core process (where the scheduler side runs): a warning when it may run
    on the cores the engine computes on although others are free, else None.

    ``compute``, ``reserved``, ``allowed``: as for :func:`worker_placement`; ``own``: the cores
    this process may run on. Such a process (and the API server it was started from) stays off
    the compute cores while the spare ones are idle, but once ``kvtrio serve`` loads them the OS
    balances it onto a compute core, where it takes time from an OpenMP thread and every step
    waits: on a 2-CPU host that made steps ~15 % longer with kvtrio (``docs/vllm.md`` §12)."""
    if not compute or not own or not own & compute:
        return None
    spare = _spare(compute, reserved, allowed or own)
    if not spare:
        return None  # every core computes: nowhere better to run
    free = ThreadPlacement(cpus=spare).describe()
    return (
        f"vLLM's engine core may run on {ThreadPlacement(cpus=own).describe()}, the compute "
        f"{ThreadPlacement(cpus=compute).describe()} among them: with kvtrio serve loading "
        f"{free}, the OS moves it and the API server onto a compute core, which slows every "
        f"step; start vLLM on {free} (taskset -c {free.removeprefix('CPUs ')} vllm serve …, "
        "its workers still compute where VLLM_CPU_OMP_THREADS_BIND says)"
    )


def engine_cpu_cores(
    vllm_config: Any,
) -> tuple[frozenset[int] | None, frozenset[int], frozenset[int] | None]:
    """For a worker of a CPU engine: the cores every rank computes on, those vLLM reserves for
    other work, and those the engine may use (:func:`worker_placement`'s arguments);
    ``(None, ∅, None)`` for other engines.

    The compute cores are this rank's OpenMP set-up (the environment vLLM gave this process)
    and every rank's as vLLM's ``OMPProcessManager`` computes them. It is built here as vLLM's
    engine process built it: with that process's view of the machine (this thread is bound
    to one compute core already, which would make it see one CPU)."""
    if getattr(vllm_config.device_config, "device_type", None) != "cpu":
        return None, frozenset(), None
    own = affinity(0) or frozenset()
    allowed = (affinity(os.getppid()) or frozenset()) | own
    compute = omp_env_cpus(os.environ) or frozenset()
    reserved: frozenset[int] = frozenset()
    try:
        from vllm.utils.ompmultiprocessing import OMPProcessManager

        quiet = logging.getLogger("vllm.utils.ompmultiprocessing")  # logged once already
        level = quiet.level
        quiet.setLevel(logging.ERROR)
        try:
            with _bound_to(allowed):
                manager = OMPProcessManager(vllm_config)
        finally:
            quiet.setLevel(level)
        lists: list[list[int]] = manager.cpu_lists
        compute |= frozenset(cpu for cpus in lists for cpu in cpus)
        reserved = frozenset(manager.reserved_cpu_list)
        if manager.skip_setup:  # nobind: OpenMP threads go anywhere
            compute |= allowed
    except Exception as exc:  # another vLLM: this rank's cores, where it is the only one
        log.debug("kvtrio: vLLM's OpenMP core lists unknown (%r)", exc)
        if vllm_config.parallel_config.world_size > 1:
            return None, frozenset(), allowed
    return compute or own or None, reserved, allowed


@contextlib.contextmanager
def _bound_to(cpus: frozenset[int]) -> Iterator[None]:
    """The calling thread on ``cpus`` for the block (then back as it was)."""
    before = affinity(0)
    if not cpus or before is None or before == cpus:
        yield
        return
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)
