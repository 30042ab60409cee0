"""kvtrio as a vLLM KV connector: ``KvtrioConnector``.

Enable it with::

    --kv-transfer-config '{"kv_connector": "KvtrioConnector",
                           "kv_connector_module_path": "kvtrio.integration.vllm",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"kvtrio.url": "tcp://127.0.0.1:5577"}}'

vLLM builds one connector in its scheduler (role ``SCHEDULER``) and one in each worker (role
``WORKER``). This class is a facade, as vLLM's own offloading connector is: each role's state and
decisions live in their own module, with no vLLM import — :mod:`._scheduler_side` looks prompts
up and plans, per step, which chunks to load and store (:mod:`._planner`), loading a hit only
where it pays (:mod:`._costs`); :mod:`._worker_side` moves the bytes
(:class:`~kvtrio.client.WorkerAdapter`) and times the forward and the loads.
The connector declares vLLM's ``SupportsHMA``: with vLLM's hybrid KV cache manager, each KV
cache group is kept under its own keys and a hit loads of each only what its layers read
(:mod:`._kv_groups`, :mod:`._hybrid`). A model whose KV cache kvtrio cannot keep (R-SWA,
layers of different KV shapes without the hybrid manager, groups of different block sizes)
turns the connector off for that engine, with one warning: vLLM then runs as without it. A
vLLM outside the supported range fails when it builds the connector (:mod:`._vllm_setup`).
Nothing here raises into vLLM's step loop: a kvtrio server that is away means misses and skipped
stores, and vLLM recomputes any block whose load failed. Bad options are refused when vLLM
starts, with a message naming them. This is the only kvtrio module that imports vLLM when it
is imported (:mod:`._cpu_kernels` asks vLLM's CPU backend which kernels it runs, when a worker
registers; :mod:`._cores` asks it which cores the engine computes on, when a worker starts,
to run kvtrio's threads on others).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

try:  # vLLM ≥ 0.32: hybrid KV cache manager support, failed loads per request
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorTransferResults,
        SupportsHMA,
    )
except ImportError:  # pragma: no cover - older vLLM (refused by check_vllm_version)
    SupportsHMA = object  # type: ignore[assignment,misc]

try:  # vLLM ≥ 0.32: workers report to the scheduler side
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata
except ImportError:  # pragma: no cover - older vLLM: `load_policy=auto` never learns
    KVConnectorWorkerMetadata = object  # type: ignore[assignment,misc]
from vllm.v1.request import RequestStatus

try:  # vLLM ≥ 0.32: a connector's scheduler-side stats reach vLLM's periodic log line
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
except ImportError:  # pragma: no cover - older vLLM: the counters are only in kvtrio's log
    KVConnectorStats = None  # type: ignore[assignment,misc]

from ..client import EngineIdentity, SchedulerAdapter, WorkerAdapter
from ._cores import affinity, engine_cpu_cores, frontend_advice, worker_placement
from ._engine_keys import key_scheme
from ._events import EngineEvents, event_hashes_of
from ._kv_groups import kv_groups, unsupported_kv_cache
from ._measurements import HookTime, hook
from ._options import parse_options
from ._planner import PlannedTransfer
from ._scheduler_side import SchedulerSide, StepPlan
from ._vllm_setup import check_vllm_version, int_block_hashes, set_failure_policy
from ._worker_side import WorkerSide

try:  # vLLM ≥ 0.32 labels external hits by tier in its metrics
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    _HOST: Any = CacheHitSource.HOST
except ImportError:  # pragma: no cover - older vLLM
    _HOST = None

if TYPE_CHECKING:
    from collections.abc import Iterable

    import torch
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = [
    "KvtrioConnector",
    "KvtrioConnectorMetadata",
    "KvtrioConnectorStats",
    "KvtrioWorkerMetadata",
]


log = logging.getLogger("kvtrio.vllm")


class KvtrioConnectorMetadata(KVConnectorMetadata, StepPlan):  # type: ignore[misc]
    """What the scheduler side hands to every worker for one step (a :class:`StepPlan`): loads
    and stores, the requests vLLM preempted (their blocks are about to be reused), and the
    tokens the step computes (workers time the forward per token)."""

    def __init__(
        self,
        transfers: list[PlannedTransfer],
        preempted: frozenset[str] = frozenset(),
        step_tokens: int = 0,
    ) -> None:
        StepPlan.__init__(self, transfers, preempted, step_tokens)

    def __repr__(self) -> str:
        return f"KvtrioConnectorMetadata({self.transfers!r}, preempted={set(self.preempted)})"


class KvtrioWorkerMetadata(KVConnectorWorkerMetadata):  # type: ignore[misc]
    """What workers measured since their last report: for ``load_policy=auto`` forward steps
    and finished loads, as ``(tokens, seconds)``; and the seconds their threads spent in the
    connector's hooks (summed over the ranks)."""

    def __init__(
        self,
        steps: list[tuple[int, float]],
        loads: list[tuple[int, float]],
        hook_seconds: float = 0.0,
    ) -> None:
        self.steps = steps
        self.loads = loads
        self.hook_seconds = hook_seconds

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, KvtrioWorkerMetadata):
            return KvtrioWorkerMetadata(
                self.steps + other.steps,
                self.loads + other.loads,
                self.hook_seconds + other.hook_seconds,
            )
        return self


class KvtrioConnectorStats(KVConnectorStats or object):  # type: ignore[misc]
    """The load policy's counters gained over an interval (``data``: counter → count), as
    vLLM's stats logger sums and prints them (``KV Transfer metrics: loads=…, skipped=…``)."""

    def __init__(self, data: dict[str, Any] | None = None) -> None:
        self.data = dict(data or {})

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: Any) -> KvtrioConnectorStats:
        for name, value in getattr(other, "data", {}).items():
            if isinstance(value, int | float):
                self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not self.data

    def to_dict(self) -> dict[str, Any]:
        return self.data


class KvtrioConnector(KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc]
    """The vLLM connector (see the module docstring). vLLM constructs it; users configure it
    with ``kvtrio.*`` keys of ``kv_connector_extra_config`` (see ``docs/vllm.md``)."""

    if _HOST is not None:
        _cache_hit_source = _HOST

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        check_vllm_version()
        super().__init__(vllm_config, role, kv_cache_config)
        transfer_config = vllm_config.kv_transfer_config
        options = parse_options(transfer_config.kv_connector_extra_config or {})
        self.options = options
        self.block_size: int = vllm_config.cache_config.block_size
        parallel = vllm_config.parallel_config
        model = options.model or vllm_config.model_config.model
        self._scheduler: SchedulerSide | None = None
        self.hook_time = HookTime()
        """This side's time in the connector's hooks (:func:`~._measurements.hook`): in the
        scheduler, reported in vLLM's stats line as ``hook_us``; in a worker, sent to the
        scheduler with its measurements (``worker_hook_us``)."""
        self._worker_hook_seconds = 0.0
        self._new_requests = 0
        self._worker: WorkerSide | None = None
        self._events: EngineEvents | None = None
        self.off_because = unsupported_kv_cache(kv_cache_config, self.block_size)
        """Why the connector is off for this engine (``None``: it is on)."""
        if self.off_because is not None:
            # vLLM then runs as without a connector: every lookup misses, nothing is stored.
            log.warning(
                "kvtrio connector (%s) is off for %s: %s; vLLM computes every prompt itself",
                role.name,
                model,
                self.off_because,
            )
            return
        # Hash mode (vLLM's block hashes name the chunks) unless told otherwise or unsafe; the
        # scheduler and every worker decide alike, from the same config and environment.
        keys = key_scheme(options.keys, vllm_config, kv_cache_config)
        identity = EngineIdentity(
            options.url,
            model,
            parallel.world_size,
            parallel.rank,
            self.block_size,
            tenant=options.tenant,
            # (vLLM hands this engine's scheduler and workers one config, so one engine id)
            engine_id=str(getattr(transfer_config, "engine_id", None) or ""),
            timeout=options.timeout,
            server_key="none" if options.insecure else options.server_key or None,
            client_key=options.client_key or None,
            hash_scheme=keys.hash_scheme,
            hash_seed=keys.hash_seed,
        )
        if role == KVConnectorRole.SCHEDULER:
            set_failure_policy(transfer_config, options.load_failure)
            adapter = SchedulerAdapter.from_identity(identity)
            self._scheduler = SchedulerSide(
                options,
                self.block_size,
                adapter,
                keys,
                groups=kv_groups(kv_cache_config),
                step_budget=getattr(vllm_config.scheduler_config, "max_num_batched_tokens", None),
            )
            self._scheduler.event_hashes = event_hashes_of(int_block_hashes(), self.block_size)
            if advice := frontend_advice(*engine_cpu_cores(vllm_config), own=affinity(0)):
                log.warning("kvtrio: %s (docs/vllm.md §8)", advice)
            if options.events:
                self._events = EngineEvents(options)
        else:
            placement, where = worker_placement(*engine_cpu_cores(vllm_config))
            log.log(logging.WARNING if placement.nice else logging.INFO, "kvtrio: %s", where)
            worker = WorkerAdapter.from_identity(identity, placement=placement)
            self._worker = WorkerSide(worker, vllm_config, kv_groups(kv_cache_config))
        log.info(
            "kvtrio connector (%s) for %s at %s, keys: %s",
            role.name, model, options.url, keys.hash_scheme,
        )  # fmt: skip

    @property
    def requires_kv_delivery(self) -> bool:
        """A cache, not a hand-off: a store lost to a preemption is only a later miss."""
        return False

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """No: the workers' registration would point at KV memory that sleep mode remaps."""
        return False

    @property
    def scheduler_side(self) -> SchedulerSide:
        assert self._scheduler is not None, "a scheduler-side call in a worker"
        return self._scheduler

    @property
    def worker_side(self) -> WorkerSide:
        assert self._worker is not None, "a worker-side call in the scheduler"
        return self._worker

    # ================================================================= scheduler side

    @hook
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens kvtrio can add beyond the engine's ``num_computed_tokens``, and whether they
        load asynchronously; ``(None, False)`` while the lookup is still on its way."""
        if self._scheduler is None:  # off for this engine
            return 0, False
        preempted = request.status == RequestStatus.PREEMPTED
        return self.scheduler_side.matched_tokens(request, num_computed_tokens, preempted=preempted)

    @hook
    def on_new_request(self, request: Request) -> None:
        """A request arrived: keep it (stores read its tokens and progress at every step)."""
        if self._scheduler is not None:
            self._new_requests += 1
            self._scheduler.new_request(request)

    @hook
    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """Blocks are allocated: plan the load of the ``num_external_tokens`` kvtrio tokens, or
        release the lookup's pins at once when nothing will be loaded."""
        if self._scheduler is None:
            return
        groups = blocks.get_block_ids()
        self.scheduler_side.allocated(request, groups[0], num_external_tokens, groups)

    @hook
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KvtrioConnectorMetadata:
        """This step's transfers: the loads planned at allocation, and the stores of what each
        scheduled request computes in this step."""
        if self._scheduler is None:
            return KvtrioConnectorMetadata([])
        manager = self._kv_cache_manager
        step = self.scheduler_side.build_step(
            scheduler_output.num_scheduled_tokens,
            scheduler_output.preempted_req_ids or (),
            int(getattr(scheduler_output, "total_num_scheduled_tokens", 0) or 0),
            None if manager is None else lambda rid: manager.get_block_ids(rid)[0],
            None if manager is None else manager.get_block_ids,
        )
        return KvtrioConnectorMetadata(step.transfers, step.preempted, step.step_tokens)

    @hook
    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Learn from what the workers measured and which loads they finished
        (``load_policy=auto``); the rest of their reports goes straight to vLLM's scheduler."""
        if self._scheduler is None:
            return
        measured = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(measured, KvtrioWorkerMetadata):
            self.scheduler_side.measured(measured.steps, measured.loads)
            self._worker_hook_seconds += measured.hook_seconds
        self.scheduler_side.loads_failed(getattr(connector_output, "failed_recving", None) or ())
        self.scheduler_side.loads_done(connector_output.finished_recving or ())

    def get_kv_connector_stats(self) -> KvtrioConnectorStats | None:
        """The scheduler side's load policy counters gained since the last call (vLLM's
        scheduler asks after every step; its stats logger prints them summed per interval)."""
        if self._scheduler is None or KVConnectorStats is None:
            return None
        gained = self._scheduler.policy.since_last()
        spread = self._scheduler.spread
        gained = {**gained, **self._scheduler.lookup_wait.since_last(), **self._hook_stats()}
        if spread is not None:  # bytes per hit (a hybrid model's KV cache groups)
            gained = {**gained, **spread.since_last()}
        return KvtrioConnectorStats(gained) if gained else None

    def _hook_stats(self) -> dict[str, int]:
        """The time the scheduler's and the workers' threads spent in the connector's hooks
        (µs) and the requests that arrived, since the last call (zeros left out): kvtrio's
        cost to the engine's step loop, per request (``bench/serve.py``)."""
        worker, self._worker_hook_seconds = self._worker_hook_seconds, 0.0
        requests, self._new_requests = self._new_requests, 0
        gained = {
            "hook_us": round(self.hook_time.take() * 1e6),
            "worker_hook_us": round(worker * 1e6),
            "requests": requests,
        }
        return {name: value for name, value in gained.items() if value}

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KvtrioConnectorStats | None:
        """vLLM's stats logger rebuilds the counters it received as a dict."""
        return None if KVConnectorStats is None else KvtrioConnectorStats(data)

    @hook
    def take_events(self) -> Iterable[KVCacheEvent]:
        """kvtrio's KV events since the last step (with ``kvtrio.events``), for vLLM's own
        publisher: what the engine can load from kvtrio, by tier (``docs/events.md``)."""
        return self._events.take() if self._events is not None else ()

    @hook
    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """The request is done or aborted: release what it holds at kvtrio. Its blocks stay
        allocated until its stores are done (True) if it issued any."""
        if self._scheduler is None:
            return False, None
        return self.scheduler_side.finished(request.request_id), None

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """:meth:`request_finished` with every KV cache group's blocks (vLLM's hybrid
        manager): the request's stores of every group hold all of its blocks until done."""
        return self.request_finished(request, block_ids[0] if block_ids else [])

    # ================================================================= worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Register this rank's KV cache with kvtrio (layers that share one tensor count once).

        CPU caches are copied through kvtrio's shared-memory L1, CUDA caches by the server over
        CUDA IPC (``docs/gpu.md``). Raises ``ValueError`` for KV tensors kvtrio cannot copy (CPU
        caches packed by attention kernels its layouts do not describe). Nothing when the
        connector is off for this engine."""
        if self._worker is not None:
            self._worker.register(kv_caches)

    @hook
    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Before the step's forward: this step's transfers (its forward starts now)."""
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None:
            plan = connector_metadata if isinstance(connector_metadata, StepPlan) else None
            self._worker.bind(plan)

    @hook
    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        if self._worker is not None:
            self._worker.clear()

    @hook
    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Before the step runs: wait for the stores still copying out of the blocks of the
        requests vLLM preempted, since those blocks are about to be reused."""
        if isinstance(kv_connector_metadata, KvtrioConnectorMetadata) and self._worker is not None:
            self.worker_side.preemptions(kv_connector_metadata)

    @hook
    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Start this step's loads; a synchronous load is complete when this returns."""
        if self._worker is not None:
            self._worker.start_loads()

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for: synchronous loads finished in :meth:`start_load_kv`."""

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        """Nothing per layer: stores copy every layer at once, after the forward."""

    @hook
    def wait_for_save(self) -> None:
        """Queue this step's stores; they run after the forward, and vLLM keeps the blocks
        until :meth:`get_finished` reports the request's stores done (or, for a preempted
        request, until :meth:`handle_preemptions` has waited for them)."""
        if self._worker is not None:
            self._worker.start_stores()

    @hook
    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Requests whose stores are done (among those vLLM finished), and whose asynchronous
        loads are done."""
        if self._worker is None:
            return None, None
        stores, loads = self.worker_side.finished(finished_req_ids)
        return stores or None, loads or None

    def build_connector_worker_meta(self) -> KvtrioWorkerMetadata | None:
        """This worker's measurements since the last report (to the scheduler side)."""
        if self._worker is None:
            return None
        report = self.worker_side.measured.report()
        spent = self.hook_time.take()
        if report is None and not spent:
            return None
        steps, loads = report or ([], [])
        return KvtrioWorkerMetadata(steps, loads, spent)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """:meth:`get_finished`, and with several KV cache groups the requests whose load
        failed (vLLM takes no failed blocks then: it recomputes those requests' prompts)."""
        stores, loads = self.get_finished(finished_req_ids)
        failed: set[str] = set()
        if self._worker is not None and self._worker.per_request_failures and loads:
            failed = self._worker.failed_loads(loads)
        return KVConnectorTransferResults(stores or set(), loads or set(), failed)

    @hook
    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks whose load failed since the last call: vLLM recomputes them."""
        return set() if self._worker is None else self._worker.failed_blocks()

    def shutdown(self) -> None:
        """Finish queued transfers, unregister, close the connections."""
        if self._worker is not None:
            self._worker.close()
        if self._scheduler is not None:
            self._scheduler.close()
        if self._events is not None:
            self._events.close()
