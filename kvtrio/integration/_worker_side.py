"""The connector's worker side (one per rank): registers the engine's KV tensors, runs each
step's loads and stores on the :class:`~kvtrio.client.WorkerAdapter`, reports what finished
and what failed, and times the forward and the loads for the scheduler side's load policy.

No vLLM import: vLLM's config and tensors are read by their attributes, so this runs without
vLLM. Nothing here raises into the engine's step loop but registration (tensors kvtrio cannot
copy, at start-up): a failed load names its blocks, which vLLM recomputes.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Mapping, Sequence
from typing import Any

from ..client import WorkerAdapter
from ._cpu_kernels import check_cpu_kernels
from ._kv_groups import KvGroup
from ._measurements import Measurements
from ._planner import PlannedTransfer
from ._scheduler_side import StepPlan

__all__ = ["WorkerSide"]


class WorkerSide:
    """The state of the connector in one of vLLM's workers."""

    def __init__(
        self, adapter: WorkerAdapter, vllm_config: Any, groups: Sequence[KvGroup] = ()
    ) -> None:
        self.adapter = adapter
        self._vllm_config = vllm_config
        self.per_request_failures = len(groups) > 1
        """Several KV cache groups: vLLM takes failed loads per request (``failed_recving``),
        not per block."""
        self._load_blocks: dict[str, set[int]] = {}
        """Asynchronous loads in flight: request → the blocks they write (several groups)."""
        self._failed: set[int] = set()
        self._windowed: list[concurrent.futures.Future[None]] = []
        """Stores of windowed groups' blocks, which vLLM may reuse while the request runs:
        finished before the next forward."""
        self._step: StepPlan | None = None
        self._async_loads: set[str] = set()
        self._stores: dict[str, list[concurrent.futures.Future[None]]] = {}
        self.measured = Measurements()

    def register(self, kv_caches: Mapping[str, Any]) -> None:
        """Register this rank's KV cache (layers that share one tensor count once); raises
        ``ValueError`` for KV tensors kvtrio cannot copy (CPU caches packed by attention
        kernels its layouts do not describe)."""
        distinct: dict[tuple[int, tuple[int, ...]], tuple[str, Any]] = {}
        for name, tensor in kv_caches.items():
            if not hasattr(tensor, "data_ptr"):
                continue  # Mamba state (a list of tensors), which kvtrio does not keep
            distinct.setdefault((tensor.data_ptr(), tuple(tensor.shape)), (name, tensor))
        if distinct:
            check_cpu_kernels(self._vllm_config, next(iter(distinct.values()))[1])
        self.adapter.register_kv_caches(dict(distinct.values()))

    def bind(self, step: StepPlan | None) -> None:
        """The step's plan, before its forward (which starts now, as far as timing goes)."""
        self._step = step
        if self._windowed:
            concurrent.futures.wait(self._windowed)  # each store ends within kvtrio.timeout
            self._windowed = []
        self.measured.step_started(step.step_tokens if step is not None else 0)

    def clear(self) -> None:
        """The step is over."""
        self._step = None

    def preemptions(self, step: StepPlan) -> None:
        """Before the step runs: wait for the stores still copying out of the blocks of the
        requests vLLM preempted, since those blocks are about to be reused."""
        futures = [f for rid in step.preempted for f in self._stores.pop(rid, ())]
        concurrent.futures.wait(futures)  # each store ends within kvtrio.timeout

    def start_loads(self) -> None:
        """Start this step's loads; a synchronous load is complete when this returns (then
        the forward starts, as far as timing goes)."""
        sync: list[concurrent.futures.Future[None]] = []
        for transfer in self._transfers("load"):
            future = self.adapter.submit_retrieve_request(transfer.request_id, transfer.op)
            op = transfer.op
            if transfer.tier == "l1":  # the copy's own time, for the load policy
                self.measured.time_load(op.end - op.start - op.skip_first_n_tokens, future)
            if transfer.sync:
                sync.append(future)
            else:
                self._async_loads.add(transfer.request_id)
                if self.per_request_failures:
                    self._load_blocks.setdefault(transfer.request_id, set()).update(
                        op.block_ids[
                            (op.start + op.skip_first_n_tokens) // self.adapter.block_size :
                        ]
                    )
        if sync:
            concurrent.futures.wait(sync)  # each retrieve ends within kvtrio.timeout
            self.measured.step_started(self._step.step_tokens if self._step else 0)

    def start_stores(self) -> None:
        """The forward is done: queue this step's stores (vLLM keeps the blocks until
        :meth:`finished` reports the request's stores done, or, for a preempted request,
        until :meth:`preemptions` has waited for them)."""
        self.measured.step_done()
        for transfer in self._transfers("store"):
            future = self.adapter.submit_store_request(transfer.request_id, transfer.op)
            pending = [f for f in self._stores.get(transfer.request_id, ()) if not f.done()]
            self._stores[transfer.request_id] = [*pending, future]
            if transfer.windowed:
                self._windowed.append(future)

    def _transfers(self, kind: str) -> list[PlannedTransfer]:
        step = self._step
        return [] if step is None else [t for t in step.transfers if t.kind == kind]

    def finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """Requests whose stores are done (among those vLLM finished), and whose asynchronous
        loads are done."""
        stores, loads = self.adapter.get_finished(finished_req_ids)
        for request_id in stores | (finished_req_ids or set()):
            futures = self._stores.get(request_id)
            if futures is not None and all(f.done() for f in futures):
                del self._stores[request_id]
        loads &= self._async_loads
        self._async_loads -= loads
        return stores, loads

    def failed_blocks(self) -> set[int]:
        """Blocks whose load failed since the last call: vLLM recomputes them (none with
        several groups: see :meth:`failed_loads`)."""
        failed = self.adapter.get_block_ids_with_load_errors()
        if not self.per_request_failures:
            return failed
        self._failed |= failed
        return set()

    def failed_loads(self, loads: set[str]) -> set[str]:
        """Of the requests whose asynchronous loads are done (``loads``), those with a block
        that failed to load (several groups: vLLM then recomputes the request's prompt)."""
        self._failed |= self.adapter.get_block_ids_with_load_errors()
        failed = set()
        for request_id in loads:
            blocks = self._load_blocks.pop(request_id, set())
            if blocks & self._failed:
                failed.add(request_id)
                self._failed -= blocks
        return failed

    def close(self) -> None:
        """Finish queued transfers, unregister, close the connection."""
        self.adapter.shutdown()
