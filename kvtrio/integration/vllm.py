"""kvtrio as a vLLM KV connector: ``KvtrioConnector``.

Enable it with::

    --kv-transfer-config '{"kv_connector": "KvtrioConnector",
                           "kv_connector_module_path": "kvtrio.integration.vllm",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"kvtrio.url": "tcp://127.0.0.1:5577"}}'

vLLM builds one connector in its scheduler (role ``SCHEDULER``) and one in each worker (role
``WORKER``). The scheduler side looks prompts up (:class:`~kvtrio.client.SchedulerAdapter`) and
plans, per step, which chunks to load and store (:mod:`._planner`), loading a hit only where it
pays (:mod:`._costs`); the worker side moves the bytes (:class:`~kvtrio.client.WorkerAdapter`).
Nothing here raises into vLLM's step loop: a kvtrio server that is away means misses and skipped
stores, and vLLM recomputes any block whose load failed. Bad options are refused when vLLM
starts, with a message naming them. This is the only kvtrio module that imports vLLM when it
is imported (:mod:`._cpu_kernels` asks vLLM's CPU
backend which kernels it runs, when a worker registers).
"""

from __future__ import annotations

import concurrent.futures
import logging
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

try:  # vLLM ≥ 0.32: workers report to the scheduler side
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata
except ImportError:  # pragma: no cover - older vLLM: `load_policy=auto` never learns
    KVConnectorWorkerMetadata = object  # type: ignore[assignment,misc]
from vllm.v1.request import RequestStatus

from ..client import SchedulerAdapter, WorkerAdapter
from ._costs import CostModel, LoadPolicy, Measurements
from ._cpu_kernels import check_cpu_kernels
from ._options import ConnectorOptions, opted_out, parse_options, request_switches
from ._planner import (
    RequestPlan,
    Transfer,
    held_after_lookup,
    plan_load,
    plan_store,
    usable_hit,
)

try:  # vLLM ≥ 0.32 labels external hits by tier in its metrics
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    _HOST: Any = CacheHitSource.HOST
except ImportError:  # pragma: no cover - older vLLM
    _HOST = None

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["KvtrioConnector", "KvtrioConnectorMetadata", "KvtrioWorkerMetadata"]

log = logging.getLogger("kvtrio.vllm")


class KvtrioConnectorMetadata(KVConnectorMetadata):
    """What the scheduler side hands to every worker for one step: loads and stores, the
    requests vLLM preempted (their blocks are about to be reused), and the tokens the step
    computes (workers time the forward per token)."""

    def __init__(
        self,
        transfers: list[Transfer],
        preempted: frozenset[str] = frozenset(),
        step_tokens: int = 0,
    ) -> None:
        self.transfers = transfers
        self.preempted = preempted
        self.step_tokens = step_tokens

    def __repr__(self) -> str:
        return f"KvtrioConnectorMetadata({self.transfers!r}, preempted={set(self.preempted)})"


class KvtrioWorkerMetadata(KVConnectorWorkerMetadata):  # type: ignore[misc]
    """What workers measured since their last report, for ``load_policy=auto``: forward steps
    and finished loads, as ``(tokens, seconds)``."""

    def __init__(self, steps: list[tuple[int, float]], loads: list[tuple[int, float]]) -> None:
        self.steps = steps
        self.loads = loads

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, KvtrioWorkerMetadata):
            return KvtrioWorkerMetadata(self.steps + other.steps, self.loads + other.loads)
        return self


class KvtrioConnector(KVConnectorBase_V1):
    """The vLLM connector (see the module docstring). vLLM constructs it; users configure it
    with ``kvtrio.*`` keys of ``kv_connector_extra_config`` (see ``docs/vllm.md``)."""

    if _HOST is not None:
        _cache_hit_source = _HOST

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        transfer_config = vllm_config.kv_transfer_config
        self.options: ConnectorOptions = parse_options(
            transfer_config.kv_connector_extra_config or {}
        )
        self.block_size: int = vllm_config.cache_config.block_size
        parallel = vllm_config.parallel_config
        model = self.options.model or vllm_config.model_config.model
        common: dict[str, Any] = {
            "model_name": model,
            "world_size": parallel.world_size,
            "kv_rank": parallel.rank,
            "block_size": self.block_size,
            "tenant": self.options.tenant,
            "timeout": self.options.timeout,
            "server_key": "none" if self.options.insecure else self.options.server_key or None,
            "client_key": self.options.client_key or None,
            # Shared by this engine's scheduler and workers (vLLM hands them one config):
            # the server scopes request ids by it, so engines never touch each other's requests.
            "engine_id": str(getattr(transfer_config, "engine_id", None) or ""),
        }
        self._scheduler: SchedulerAdapter | None = None
        self._worker: WorkerAdapter | None = None
        # Scheduler side.
        self._plans: dict[str, RequestPlan] = {}
        self._requests: dict[str, Request] = {}
        self._step_waited = False  # a lookup was waited for in this scheduler step
        self._ready: list[Transfer] = []
        self._warned_chunk = False
        self._costs = CostModel(min_step_tokens=max(64, 2 * self.block_size))
        self._policy = LoadPolicy(self.options.load_policy, self._costs)
        # Worker side.
        self._async_loads: set[str] = set()
        self._stores: dict[str, list[concurrent.futures.Future[None]]] = {}
        self._measured = Measurements()
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = SchedulerAdapter(self.options.url, **common)
        else:
            self._worker = WorkerAdapter(self.options.url, **common)
        log.info("kvtrio connector (%s) for %s at %s", role.name, model, self.options.url)

    @property
    def requires_kv_delivery(self) -> bool:
        """A cache, not a hand-off: a store lost to a preemption is only a later miss."""
        return False

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """No: the workers' registration would point at KV memory that sleep mode remaps."""
        return False

    # ================================================================= scheduler side

    @property
    def _chunk_size(self) -> int:
        assert self._scheduler is not None
        return self._scheduler.chunk_size

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens kvtrio can add beyond the engine's ``num_computed_tokens``, and whether they
        load asynchronously; ``(None, False)`` while the lookup is still on its way."""
        assert self._scheduler is not None
        plan = self._plan(request)
        if not plan.load or request.status == RequestStatus.PREEMPTED:
            return 0, False
        tokens = request.all_token_ids
        # Deferred: the step's lookups go out together, one message at the end of the step
        # (build_connector_meta), or when one is waited for.
        self._scheduler.maybe_submit_lookup_request(
            request.request_id, token_ids=tokens, defer=True
        )
        hit = self._scheduler.check_lookup_result(request.request_id)
        if hit is None and not self._step_waited:
            # At most one wait per scheduler step: in a burst of new requests the others'
            # lookups go out at the end of the step and are collected at the next one, not
            # waited for one after another.
            self._step_waited = True
            hit = self._scheduler.check_lookup_result(
                request.request_id, wait=self.options.lookup_wait
            )
        if hit is None:
            return None, False
        chunk_size = self._chunk_size
        if chunk_size % self.block_size:
            if not self._warned_chunk:
                log.error(
                    "kvtrio's chunk size %d is not a multiple of vLLM's block size %d: "
                    "nothing is loaded or stored (start kvtrio with --chunk-size N*%d)",
                    chunk_size,
                    self.block_size,
                    self.block_size,
                )
                self._warned_chunk = True
            plan.load = plan.save = False
            plan.locked = hit > 0
            return 0, False
        plan.locked = hit > 0
        plan.hit_tokens = usable_hit(hit, len(tokens), self.block_size)
        plan.local_tokens = num_computed_tokens
        held_after_lookup(plan, hit, chunk_size)
        need = max(0, plan.hit_tokens - num_computed_tokens)
        if need > 0 and not self._policy.load(request.request_id, need):
            plan.hit_tokens = 0
            return 0, False
        return need, need > 0 and self.options.async_load

    def on_new_request(self, request: Request) -> None:
        """A request arrived: keep it (stores read its tokens and progress at every step)."""
        self._plan(request)

    def _plan(self, request: Request) -> RequestPlan:
        plan = self._plans.get(request.request_id)
        if plan is None:
            plan = self._plans[request.request_id] = self._new_plan(request)
            self._requests[request.request_id] = request
        return plan

    def _new_plan(self, request: Request) -> RequestPlan:
        load, save, problem = request_switches(request.kv_transfer_params)
        if problem:
            log.warning("request %s: ignored kv_transfer_params %s", request.request_id, problem)
        plan = RequestPlan(
            request.request_id,
            load=self.options.load if load is None else load,
            save=self.options.save if save is None else save,
        )
        reason = opted_out(request)
        if reason:
            # kvtrio keys chunks by token ids alone: such a request's KV differs from another
            # request's with the same tokens, so it must neither load nor store.
            log.debug("request %s bypasses kvtrio: %s", request.request_id, reason)
            plan.load = plan.save = False
        return plan

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """Blocks are allocated: plan the load of the ``num_external_tokens`` kvtrio tokens, or
        release the lookup's pins at once when nothing will be loaded."""
        assert self._scheduler is not None
        plan = self._plans.get(request.request_id)
        if plan is None or not plan.locked:
            return
        self._scheduler.cleanup_lookup_result(request.request_id)
        load = None
        if plan.load:
            (block_ids,) = blocks.get_block_ids()
            load = plan_load(
                plan,
                tokens=request.all_token_ids,
                block_ids=block_ids,
                external_tokens=num_external_tokens,
                block_size=self.block_size,
                chunk_size=self._chunk_size,
                sync=not self.options.async_load,
            )
        if load is not None:
            self._ready.append(load)
        else:
            self._scheduler.free_lookup_locks(request.request_id)
        plan.locked = False  # the lookup is used up: a second call plans nothing
        plan.hit_tokens = 0

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KvtrioConnectorMetadata:
        """This step's transfers: the loads planned at allocation, and a store for each
        scheduled request that completes whole chunks in this step."""
        transfers, self._ready = self._ready, []
        self._step_waited = False  # the step is scheduled: the next one may wait again
        if self._scheduler is not None:
            self._scheduler.flush_lookups()  # this step's deferred lookups, in one message
        preempted = frozenset(scheduler_output.preempted_req_ids or ())
        step_tokens = int(getattr(scheduler_output, "total_num_scheduled_tokens", 0) or 0)
        manager = self._kv_cache_manager
        if manager is None:
            return KvtrioConnectorMetadata(transfers, preempted, step_tokens)
        for request_id, num_new in scheduler_output.num_scheduled_tokens.items():
            plan = self._plans.get(request_id)
            request = self._requests.get(request_id)
            if plan is None or request is None or not plan.save:
                continue
            (block_ids,) = manager.get_block_ids(request_id)
            transfers += plan_store(
                plan,
                tokens=request.all_token_ids,
                block_ids=block_ids,
                computed_tokens=request.num_computed_tokens + num_new,
                prompt_tokens=request.num_prompt_tokens,
                block_size=self.block_size,
                chunk_size=self._chunk_size,
            )
        return KvtrioConnectorMetadata(transfers, preempted, step_tokens)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Learn from what the workers measured (``load_policy=auto``); the rest of their
        reports goes straight to vLLM's scheduler."""
        measured = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(measured, KvtrioWorkerMetadata):
            for tokens, seconds in measured.steps:
                self._costs.observe_step(tokens, seconds)
            for tokens, seconds in measured.loads:
                log.debug("a load of %d tokens took %.1f ms", tokens, seconds * 1e3)
                self._costs.observe_load(tokens, seconds)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """The request is done or aborted: release what it holds at kvtrio. Its blocks stay
        allocated until its stores are done (True) if it issued any."""
        assert self._scheduler is not None
        plan = self._plans.pop(request.request_id, None)
        self._requests.pop(request.request_id, None)
        self._ready = [t for t in self._ready if t.request_id != request.request_id]
        self._scheduler.end_session(request.request_id)
        return plan is not None and plan.stores > 0, None

    # ================================================================= worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Register this rank's KV cache with kvtrio (layers that share one tensor count once).

        CPU caches are copied through kvtrio's shared-memory L1, CUDA caches by the server over
        CUDA IPC (``docs/gpu.md``). Raises ``ValueError`` for KV tensors kvtrio cannot copy (CPU
        caches packed by attention kernels its layouts do not describe)."""
        assert self._worker is not None
        distinct: dict[tuple[int, tuple[int, ...]], tuple[str, torch.Tensor]] = {}
        for name, tensor in kv_caches.items():
            distinct.setdefault((tensor.data_ptr(), tuple(tensor.shape)), (name, tensor))
        if distinct:
            check_cpu_kernels(self._vllm_config, next(iter(distinct.values()))[1])
        self._worker.register_kv_caches(dict(distinct.values()))

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Before the step runs: wait for the stores still copying out of the blocks of the
        requests vLLM preempted, since those blocks are about to be reused."""
        if not isinstance(kv_connector_metadata, KvtrioConnectorMetadata):
            return
        futures = [
            future
            for request_id in kv_connector_metadata.preempted
            for future in self._stores.pop(request_id, ())
        ]
        concurrent.futures.wait(futures)  # each store ends within kvtrio.timeout

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Start this step's loads; a synchronous load is complete when this returns."""
        assert self._worker is not None
        sync: list[concurrent.futures.Future[None]] = []
        for transfer in self._transfers("load"):
            future = self._worker.submit_retrieve_request(transfer.request_id, transfer.op)
            if transfer.sync:
                sync.append(future)
            else:
                self._async_loads.add(transfer.request_id)
                op = transfer.op
                self._measured.time_load(op.end - op.start - op.skip_first_n_tokens, future)
        if sync:
            concurrent.futures.wait(sync)  # each retrieve ends within kvtrio.timeout
            # vLLM runs the forward after its synchronous loads: it starts now
            self._measured.step_started(getattr(self._get_connector_metadata(), "step_tokens", 0))

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Before the step's forward: this step's transfers, and its forward starts now."""
        super().bind_connector_metadata(connector_metadata)
        self._measured.step_started(getattr(connector_metadata, "step_tokens", 0))

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for: synchronous loads finished in :meth:`start_load_kv`."""

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        """Nothing per layer: stores copy every layer at once, after the forward."""

    def wait_for_save(self) -> None:
        """Queue this step's stores; they run after the forward, and vLLM keeps the blocks
        until :meth:`get_finished` reports the request's stores done (or, for a preempted
        request, until :meth:`handle_preemptions` has waited for them)."""
        assert self._worker is not None
        self._measured.step_done()  # (the forward is done)
        for transfer in self._transfers("store"):
            future = self._worker.submit_store_request(transfer.request_id, transfer.op)
            pending = [f for f in self._stores.get(transfer.request_id, ()) if not f.done()]
            self._stores[transfer.request_id] = [*pending, future]

    def _transfers(self, kind: str) -> list[Transfer]:
        if not self.has_connector_metadata():
            return []
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, KvtrioConnectorMetadata)
        return [t for t in metadata.transfers if t.kind == kind]

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Requests whose stores are done (among those vLLM finished), and whose asynchronous
        loads are done."""
        assert self._worker is not None
        stores, loads = self._worker.get_finished(finished_req_ids)
        for request_id in stores | (finished_req_ids or set()):
            futures = self._stores.get(request_id)
            if futures is not None and all(f.done() for f in futures):
                del self._stores[request_id]
        loads &= self._async_loads
        self._async_loads -= loads
        return stores or None, loads or None

    def build_connector_worker_meta(self) -> KvtrioWorkerMetadata | None:
        """This worker's measurements since the last report (to the scheduler side)."""
        report = self._measured.report()
        return None if report is None else KvtrioWorkerMetadata(*report)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks whose load failed since the last call: vLLM recomputes them."""
        assert self._worker is not None
        return self._worker.get_block_ids_with_load_errors()

    def shutdown(self) -> None:
        """Finish queued transfers, unregister, close the connections."""
        if self._scheduler is not None and self._policy.stats["skipped"]:
            log.info("kvtrio load policy: %s", dict(self._policy.stats))
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.close()
