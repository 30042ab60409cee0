"""Where a client's own threads run: the CPUs they may use and their scheduling priority.

An engine's CPU worker computes with OpenMP threads bound to the cores vLLM gave it
(``VLLM_CPU_OMP_THREADS_BIND``); importing torch binds the worker's main thread to them, and
every thread started afterwards inherits that binding. Left alone, the adapter's transfer and
I/O threads would copy on the very cores the engine computes on, and a compute thread that
loses its core stalls the whole parallel region: every decode step waits for kvtrio's copy.
A :class:`ThreadPlacement` is applied by each thread the client starts, first thing, so they
run on the cores the engine leaves free (vLLM reserves one per rank for a connector), or, where
it leaves none, at a lower priority than the engine's threads.
"""

from __future__ import annotations

import logging
import os
import threading

import attrs

__all__ = ["INHERITED", "ThreadPlacement"]

log = logging.getLogger("kvtrio.client")


@attrs.frozen
class ThreadPlacement:
    """The CPUs (``None``: as inherited) and the nice increment (0: as inherited) of the
    threads a client starts. Linux applies both per thread; elsewhere they are ignored."""

    cpus: frozenset[int] | None = None
    nice: int = attrs.field(default=0, validator=attrs.validators.in_(range(20)))

    def apply(self) -> None:
        """Place the calling thread. A refusal by the OS (CPUs outside the process's cgroup,
        no permission) is logged once per thread and leaves the thread as it was."""
        try:
            if self.cpus and hasattr(os, "sched_setaffinity"):
                os.sched_setaffinity(0, self.cpus)  # 0: the calling thread
            if self.nice and hasattr(os, "setpriority"):
                tid = threading.get_native_id()
                current = os.getpriority(os.PRIO_PROCESS, tid)
                os.setpriority(os.PRIO_PROCESS, tid, current + self.nice)
        except OSError as exc:
            log.warning("kvtrio: thread %s not placed (%s): %s", threading.current_thread().name,
                        self.describe(), exc)  # fmt: skip

    def describe(self) -> str:
        """The placement in words, for logs."""
        cpus = "inherited CPUs" if not self.cpus else "CPUs " + _cpu_list(self.cpus)
        return cpus if not self.nice else f"{cpus}, nice +{self.nice}"


INHERITED = ThreadPlacement()
"""Threads run as the thread that starts them would: its CPUs, its priority."""


def _cpu_list(cpus: frozenset[int]) -> str:
    """``{0, 1, 2, 5}`` → ``0-2,5``."""
    ranges: list[str] = []
    ordered = sorted(cpus)
    start = prev = ordered[0]
    for cpu in [*ordered[1:], None]:
        if cpu is not None and cpu == prev + 1:
            prev = cpu
            continue
        ranges.append(str(start) if start == prev else f"{start}-{prev}")
        if cpu is not None:
            start = prev = cpu
    return ",".join(ranges)
