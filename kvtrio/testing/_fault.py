"""``fault``: a test backend that wraps another and injects latency, errors and dropped loads.

For kvtrio's own tests (and anyone testing how a deployment degrades). Not an installed backend:
construct it (``FaultBackend(inner=MemoryBackend())``), or register it in the process
(``kvtrio.l2.register("fault", FaultBackend)``; kvtrio's suite: the ``fault_registered``
fixture) to use
``--l2 fault:inner=memory,latency=0.5,error_rate=0.1,seed=1``. Deterministic for a given seed
and call sequence. The knobs can be changed at run time with :meth:`FaultBackend.configure`.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence

import attrs
import trio

from ..l2 import Backend, BackendUnavailable, Buffers, create_backend

__all__ = ["FaultBackend", "FaultOptions"]


@attrs.frozen
class FaultOptions:
    inner: str = attrs.field(default="memory", metadata={"help": "Backend to wrap (its defaults)."})
    latency: float = attrs.field(
        default=0.0, metadata={"help": "Seconds added to every operation."}
    )
    error_rate: float = attrs.field(
        default=0.0, metadata={"help": "Probability an operation fails."}
    )
    drop_rate: float = attrs.field(
        default=0.0, metadata={"help": "Probability a loaded key is a miss."}
    )
    seed: int = attrs.field(default=0, metadata={"help": "Seed of the fault decisions."})


class FaultBackend:
    """Fault injection around ``inner``; ``inner`` defaults to the backend named in the options."""

    name = "fault"
    Options = FaultOptions

    def __init__(
        self, options: FaultOptions | None = None, *, inner: Backend | None = None
    ) -> None:
        options = options or FaultOptions()
        if inner is None:
            inner = create_backend(options.inner, {})
        self.inner = inner
        self.latency = options.latency
        self.error_rate = options.error_rate
        self.drop_rate = options.drop_rate
        self._random = random.Random(options.seed)
        self.injected = {"errors": 0, "drops": 0}

    def configure(
        self,
        *,
        latency: float | None = None,
        error_rate: float | None = None,
        drop_rate: float | None = None,
    ) -> None:
        """Change the faults from now on (e.g. "the service just went down")."""
        if latency is not None:
            self.latency = latency
        if error_rate is not None:
            self.error_rate = error_rate
        if drop_rate is not None:
            self.drop_rate = drop_rate

    async def _fault(self, operation: str) -> None:
        if self.latency:
            await trio.sleep(self.latency)
        else:
            await trio.lowlevel.checkpoint()
        if self.error_rate and self._random.random() < self.error_rate:
            self.injected["errors"] += 1
            raise BackendUnavailable(f"injected failure of {operation}")

    async def lookup_and_lock(self, keys: Sequence[bytes]) -> int:
        await self._fault("lookup_and_lock")
        return await self.inner.lookup_and_lock(keys)

    async def unlock(self, keys: Sequence[bytes]) -> None:
        await self.inner.unlock(keys)  # never fails: a fault here would leak locks

    async def load(self, keys: Sequence[bytes], buffers: Sequence[Buffers]) -> list[bool]:
        await self._fault("load")
        results = await self.inner.load(keys, buffers)
        for index, ok in enumerate(results):
            if ok and self.drop_rate and self._random.random() < self.drop_rate:
                self.injected["drops"] += 1
                results[index] = False
        return results

    async def store(self, keys: Sequence[bytes], buffers: Sequence[Buffers]) -> list[bool]:
        await self._fault("store")
        return await self.inner.store(keys, buffers)

    async def delete(self, keys: Sequence[bytes]) -> None:
        await self.inner.delete(keys)

    async def aclose(self) -> None:
        await self.inner.aclose()

    def statistics(self) -> Mapping[str, float]:
        return {
            **self.inner.statistics(),
            "injected_errors": self.injected["errors"],
            "injected_drops": self.injected["drops"],
        }
