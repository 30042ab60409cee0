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
free a core. No vLLM import.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

from ..client import ThreadPlacement

__all__ = ["SHARED_NICE", "affinity", "omp_env_cpus", "worker_placement"]

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
    spare = (reserved or (allowed or frozenset()) - compute) - compute
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
