"""The connector's scheduler side: lookups, which chunks each step loads and stores, and
whether a hit is worth loading. No vLLM import: vLLM's requests, blocks and scheduler output
are read by their attributes (``request_id``, ``all_token_ids``, ``num_prompt_tokens``,
``num_computed_tokens``, ``kv_transfer_params``, ``get_block_ids()``, …), so this runs, and is
tested, without vLLM.

Nothing here raises into the engine's step loop: a kvtrio server that is away means misses and
skipped stores (the adapter fails fast and logs).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import partial
from typing import Any

from ..client import SchedulerAdapter
from ._costs import CostModel, LoadPolicy, Tier
from ._engine_keys import KeyScheme, engine_root
from ._hybrid import GroupSpread
from ._kv_groups import KvGroup
from ._lookup_wait import LookupWait
from ._options import ConnectorOptions, opted_out, request_switches
from ._planner import (
    PlannedTransfer,
    RequestPlan,
    held_after_lookup,
    may_store,
    plan_load,
    plan_store,
    usable_hit,
)

__all__ = ["SchedulerSide", "StepPlan"]

log = logging.getLogger("kvtrio.vllm")

REPORT_EVERY = 60.0
"""Seconds between two INFO lines of the load policy's counters (while it decides)."""


class StepPlan:
    """What one step hands to the workers: its transfers, the requests vLLM preempted, and
    the tokens it computes."""

    __slots__ = ("preempted", "step_tokens", "transfers")

    def __init__(
        self, transfers: list[PlannedTransfer], preempted: frozenset[str], step_tokens: int
    ) -> None:
        self.transfers = transfers
        self.preempted = preempted
        self.step_tokens = step_tokens


class SchedulerSide:
    """The state and decisions of the connector in vLLM's scheduler (one per engine)."""

    def __init__(
        self,
        options: ConnectorOptions,
        block_size: int,
        adapter: SchedulerAdapter,
        keys: KeyScheme | None = None,
        clock: Callable[[], float] = time.perf_counter,
        groups: Sequence[KvGroup] = (),
        step_budget: int | None = None,
    ) -> None:
        self.options = options
        hybrid = len(groups) > 1 or any(g.kind != "full" for g in groups)
        self.spread = GroupSpread(groups, block_size) if hybrid else None
        """Several KV cache groups, or a windowed one (vLLM's hybrid manager): per-group keys
        and transfers. (One full-attention group keeps the keys it always had.)"""
        self.async_load = options.async_load or len(groups) > 1
        """Loads run between steps: always with several groups, whose failed loads vLLM takes
        only per request, and only for a request waiting for an asynchronous load."""
        self._in_step_allowed = len(groups) <= 1
        """The load policy may load a hit inside its request's first step (one group only)."""
        self.keys = keys if keys is not None else KeyScheme()
        """Token mode, or hash mode: chunks named by the engine's block hashes."""
        self._root_checked = not self.keys.engine_hashes
        self._root_wrong = False
        self.block_size = block_size
        self.adapter = adapter
        self._plans: dict[str, RequestPlan] = {}
        self._requests: dict[str, Any] = {}
        self._step_waited = False  # a lookup was waited for in this scheduler step
        self.lookup_wait = LookupWait(options.lookup_wait)
        """How long a scheduling pass waits for a lookup's answer."""
        self._ready: list[PlannedTransfer] = []
        self._warned_chunk = False
        self.policy = LoadPolicy(
            options.load_policy,
            CostModel(min_step_tokens=max(64, 2 * block_size), step_budget=step_budget),
        )
        self._clock = clock
        self._loading: dict[str, tuple[float, int, Tier, int]] = {}
        """Asynchronous loads in flight: request → (handed to the workers at, tokens, tier,
        tokens of the tier's loads in flight before it)."""
        self._queued: dict[str, int] = {"l1": 0, "l2": 0}
        """Tokens of the loads in flight, per tier."""
        self._skipped: dict[str, tuple[float, int]] = {}
        """Hits judged when their tokens are in the engine (skipped, or loaded inside the
        step), waiting for their blocks: request → (decided at, the token the hit ends at)."""
        self._computing: dict[str, tuple[float, int]] = {}
        """Such hits being computed or loaded: request → (decided at, tokens to reach)."""
        self._backlog = 0
        """Prefill tokens the engine has yet to compute for the requests it runs (as of the
        last step, plus the prefills decided since)."""
        self._next_report = clock() + REPORT_EVERY
        self._reported: dict[str, int] = {}
        self.event_hashes: Any = None
        """``event_hashes(request, first, stop)``: its block hashes of blocks ``[first, stop)``
        as the engine's KV events name them
        (set by the engine's connector; stores carry them for the server's KV events)."""

    def matched_tokens(
        self, request: Any, num_computed_tokens: int, *, preempted: bool
    ) -> tuple[int | None, bool]:
        """Tokens kvtrio can add beyond the engine's ``num_computed_tokens``, and whether they
        load asynchronously; ``(None, False)`` while the lookup is still on its way. A
        preempted request (resumed) loads nothing, nor one whose load went out already: vLLM
        asks again after a load only when it failed from its first block (the request is back
        to 0 computed tokens), and the same load would fail alike (was: offered again at every
        step, the request never computed while the failure lasted)."""
        plan = self._plan(request)
        if plan.load_issued:
            plan.load = False
        if not plan.load or preempted:
            return 0, False
        tokens = request.all_token_ids
        self._submit_lookup(request)  # (no-op if it went out at the request's arrival)
        hit = self.adapter.check_lookup_result(request.request_id)
        if hit is None and not self._step_waited:
            # At most one wait per scheduler step: in a burst of new requests the others'
            # lookups go out at the end of the step and are collected at the next one, not
            # waited for one after another.
            self._step_waited = True
            wait = self.lookup_wait.seconds(
                self.policy.model.step_seconds(), others=max(0, len(self._plans) - 1)
            )
            started = self._clock()
            hit = self.adapter.check_lookup_result(request.request_id, wait=wait)
            self.lookup_wait.waited(self._clock() - started, answered=hit is not None)
        if hit is None:
            return None, False
        if self.spread is not None:  # what every group serves (or ask again, for less)
            hit = self.spread.hit(request.request_id, hit, len(tokens))
            if hit is None:
                self.adapter.cleanup_lookup_result(request.request_id)
                self._submit_lookup(request)
                return None, False
        plan.locked = hit > 0
        chunk_size = self.adapter.chunk_size
        if chunk_size % self.block_size:
            self._refuse_chunk_size(chunk_size)
            plan.load = plan.save = False
            return 0, False
        plan.hit_tokens = usable_hit(hit, len(tokens), self.block_size)
        plan.local_tokens = num_computed_tokens
        held_after_lookup(plan, hit, chunk_size)
        need = max(0, plan.hit_tokens - num_computed_tokens)
        if need > 0 and plan.load_end is None:
            self._decide(request, plan, need)
        if plan.load_end is not None:
            plan.hit_tokens = min(plan.hit_tokens, plan.load_end)
            need = max(0, plan.hit_tokens - num_computed_tokens)
        # The requests after this one in the same scheduling pass queue behind its prefill.
        self._backlog += max(0, len(tokens) - num_computed_tokens - need)
        if need <= 0:
            plan.hit_tokens = 0
            return 0, False
        return need, self.async_load and not plan.load_in_step

    def _decide(self, request: Any, plan: RequestPlan, need: int) -> None:
        """Judge the hit of ``need`` tokens beyond the engine's own prefix (once per request),
        with the loads in flight and the engine's backlog as they are now."""
        l1 = self.adapter.lookup_l1_tokens(request.request_id)
        l1_need = need if l1 is None else max(0, min(l1, plan.hit_tokens) - plan.local_tokens)
        decision = self.policy.decide(
            request.request_id,
            need,
            l1_need,
            queued_l1=self._queued["l1"],
            queued_l2=self._queued["l2"],
            backlog=self._backlog,
            rest=max(0, len(request.all_token_ids) - plan.local_tokens - need),
            others=max(0, len(self._plans) - 1),
        )
        plan.load_end = plan.local_tokens + decision.tokens
        plan.load_tier = "l2" if decision.tokens > l1_need else "l1"
        plan.load_in_step = decision.in_step and self._in_step_allowed
        judged_at_prefill = not decision.load or decision.in_step
        if judged_at_prefill and self.policy.pending(request.request_id) is not None:
            self._skipped[request.request_id] = (self._clock(), plan.local_tokens + need)

    def _refuse_chunk_size(self, chunk_size: int) -> None:
        if not self._warned_chunk:
            log.error(
                "kvtrio's chunk size %d is not a multiple of vLLM's block size %d: nothing is "
                "loaded or stored (start kvtrio with --chunk-size N*%d)",
                chunk_size, self.block_size, self.block_size,
            )  # fmt: skip
            self._warned_chunk = True

    def _plan(self, request: Any) -> RequestPlan:
        """The request's plan (made, and the request kept, at its first sight)."""
        plan = self._plans.get(request.request_id)
        if plan is None:
            plan = self._plans[request.request_id] = self._new_plan(request)
            self._requests[request.request_id] = request
        return plan

    def _new_plan(self, request: Any) -> RequestPlan:
        if not self._root_checked:
            self._check_root()
        load, save, problem = request_switches(request.kv_transfer_params)
        if problem:
            log.warning("request %s: ignored kv_transfer_params %s", request.request_id, problem)
        plan = RequestPlan(
            request.request_id,
            load=self.options.load if load is None else load,
            save=self.options.save if save is None else save,
        )
        if self._root_wrong or (self.spread is not None and not self.spread.keeps_state):
            plan.load = plan.save = False
        if self.keys.engine_hashes:
            return plan  # vLLM's block hashes tell apart what tokens alone cannot
        reason = opted_out(request)
        if reason:
            # Token mode keys chunks by token ids alone: such a request's KV differs from
            # another request's with the same tokens, so it must neither load nor store.
            log.debug("request %s bypasses kvtrio: %s", request.request_id, reason)
            plan.load = plan.save = False
        return plan

    def _check_root(self) -> None:
        """Once, at the first request (vLLM sets its root hash after building the connector):
        the engine's root block hash must be the one the workers registered a fingerprint of;
        if not, nothing is loaded or stored (its chunks would be named unlike the fleet's)."""
        self._root_checked = True
        root = engine_root()
        if root is not None and root != self.keys.root:
            log.error(
                "kvtrio: vLLM's root block hash is not the one derived from PYTHONHASHSEED "
                "and %s: nothing is loaded or stored (set PYTHONHASHSEED before vLLM starts)",
                self.keys.hash_scheme,
            )
            self._root_wrong = True

    def new_request(self, request: Any) -> None:
        """A request arrived: keep it (stores read its tokens and progress at every step), and
        queue its lookup, so that the first lookup the next scheduling pass waits for takes the
        others that arrived with it along (one message, one reply) instead of each one waiting
        for a step of its own."""
        plan = self._plan(request)
        if plan.load:
            self._submit_lookup(request)

    def _submit_lookup(self, request: Any) -> None:
        """Queue the request's lookup (deferred: the queued lookups go out together, one message
        at the end of the step (build_step), or when one is waited for)."""
        if self.spread is not None:  # every group's chunks, in one lookup
            groups, state = self.spread.lookup_hashes(
                request.request_id, self._group_hashes(request), len(request.all_token_ids)
            )
            self.adapter.maybe_submit_lookup_request(
                request.request_id, groups=groups, state=state, defer=True
            )
        elif self.keys.engine_hashes:
            self.adapter.maybe_submit_lookup_request(
                request.request_id, block_hashes=self.keys.block_hashes(request), defer=True
            )
        else:
            self.adapter.maybe_submit_lookup_request(
                request.request_id, token_ids=request.all_token_ids, defer=True
            )

    def allocated(
        self,
        request: Any,
        block_ids: Sequence[int],
        external_tokens: int,
        groups: Sequence[Sequence[int]] | None = None,
    ) -> None:
        """Blocks are allocated: plan the load of the ``external_tokens`` kvtrio tokens, or
        release the lookup's pins at once when nothing will be loaded. ``groups``: every KV
        cache group's blocks (``block_ids`` are the first group's)."""
        plan = self._plans.get(request.request_id)
        if plan is None or not plan.locked:
            return
        self.adapter.cleanup_lookup_result(request.request_id)
        load = None
        if plan.load:
            load_of = partial(
                plan_load,
                plan,
                tokens=request.all_token_ids,
                external_tokens=external_tokens,
                block_size=self.block_size,
                chunk_size=self.adapter.chunk_size,
                sync=not self.async_load or plan.load_in_step,
                event_hashes=(  # (the engine's event names are the first group's)
                    None
                    if self.event_hashes is None or self.spread is not None
                    else partial(self.event_hashes, request)
                ),
            )
            if self.spread is not None and groups is not None:
                hashes = self._group_hashes(request)
                loads = self.spread.loads(load_of, groups, hashes, plan, self.adapter.chunk_size)
                self._ready += loads[:-1]
                load = loads[-1] if loads else None
            else:
                load = load_of(block_ids=block_ids, block_hashes=self._hashes(request))
        if load is not None:
            self._ready.append(load)
            plan.load_issued = True
        else:
            self.adapter.free_lookup_locks(request.request_id)
        skipped = self._skipped.pop(request.request_id, None)
        if skipped is not None:  # timed from the decision until its tokens are in
            self._computing[request.request_id] = skipped
        plan.locked = False  # the lookup is used up: a second call plans nothing
        plan.hit_tokens = 0

    def build_step(
        self,
        scheduled: Mapping[str, int],
        preempted: Iterable[str],
        step_tokens: int,
        block_ids_of: Any,
        group_block_ids_of: Any = None,
    ) -> StepPlan:
        """This step's transfers: the loads planned at allocation, and the stores of what each
        scheduled request (``scheduled``: id → new tokens) computes in this step.
        ``block_ids_of(request_id)`` gives a request's blocks (None: no stores planned), and
        ``group_block_ids_of(request_id)`` those of every KV cache group."""
        transfers, self._ready = self._ready, []
        self._step_waited = False  # the step is scheduled: the next one may wait again
        self.adapter.flush_lookups()  # this step's deferred lookups, in one message
        step = StepPlan(transfers, frozenset(preempted), step_tokens)
        if self.policy.policy == "auto":
            self._watch(transfers, scheduled)
        if block_ids_of is None:
            return step
        chunk_size = self.adapter.chunk_size
        for request_id, num_new in scheduled.items():
            plan = self._plans.get(request_id)
            request = self._requests.get(request_id)
            if plan is None or request is None:
                continue
            computed = request.num_computed_tokens + num_new
            if not may_store(
                plan, computed, request.num_prompt_tokens, self.block_size, chunk_size
            ):
                continue  # (most decode steps: no chunk completed, no block or hash looked at)
            store_of = partial(
                plan_store,
                plan,
                tokens=request.all_token_ids,
                computed_tokens=computed,
                prompt_tokens=request.num_prompt_tokens,
                block_size=self.block_size,
                chunk_size=chunk_size,
                event_hashes=(
                    None if self.event_hashes is None else partial(self.event_hashes, request)
                ),
            )
            if self.spread is not None and group_block_ids_of is not None:
                groups = group_block_ids_of(request_id)
                transfers += self.spread.stores(
                    store_of, groups, self._group_hashes(request), plan, chunk_size
                )
            else:
                transfers += store_of(
                    block_ids=block_ids_of(request_id), block_hashes=self._hashes(request)
                )
        return step

    def _group_hashes(self, request: Any) -> list[tuple[bytes, ...]]:
        """Every KV cache group's block hashes of the request (several groups only)."""
        assert self.spread is not None
        return self.spread.hashes(request, self._hashes(request))

    def _watch(self, transfers: Sequence[PlannedTransfer], scheduled: Mapping[str, int]) -> None:
        """What ``load_policy=auto`` sees at each step: the asynchronous loads handed to the
        workers now (timed until they are reported done), the skipped hits computed by now
        (judged), the engine's prefill backlog after this step; now and then, the counters."""
        now = self._clock()
        for transfer in transfers:
            if transfer.kind != "load" or transfer.sync:
                continue
            if self.spread is not None and transfer.group != self.spread.primary:
                continue  # (a hit's load is timed once, on its primary group)
            plan = self._plans.get(transfer.request_id)
            op = transfer.op
            tokens = op.end - op.start - op.skip_first_n_tokens
            tier: Tier = "l2" if plan is not None and plan.load_tier == "l2" else "l1"
            self._unqueue(transfer.request_id)  # (one load per request in flight)
            self._loading[transfer.request_id] = (now, tokens, tier, self._queued[tier])
            self._queued[tier] += tokens
        for request_id, (started, end) in list(self._computing.items()):
            request = self._requests.get(request_id)
            if request is not None and request.num_computed_tokens >= end:
                del self._computing[request_id]
                self.policy.compute_measured(request_id, now - started)
        backlog = 0
        for request_id, num_new in scheduled.items():
            request = self._requests.get(request_id)
            if request is not None:
                left = request.num_prompt_tokens - request.num_computed_tokens - num_new
                backlog += left if left > 0 else 0
        self._backlog = backlog
        if now >= self._next_report:
            self._next_report = now + REPORT_EVERY
            self._report()

    def _report(self) -> None:
        """One INFO line of the load policy's counters, if they changed since the last."""
        stats = dict(self.policy.stats)
        if stats and stats != self._reported:
            self._reported = stats
            log.info("kvtrio load policy: %s", self.policy.summary())

    def loads_done(self, request_ids: Iterable[str]) -> None:
        """The workers reported these requests' asynchronous loads done (or failed): each
        load's time teaches its tier's line and judges its decision."""
        now = self._clock()
        for request_id in request_ids:
            started = self._unqueue(request_id)
            if started is None:
                continue
            began, tokens, tier, queued = started
            log.debug("a load of %d tokens (%s) took %.1f ms", tokens, tier, (now - began) * 1e3)
            self.policy.model.observe_load(tokens, now - began, tier, queued)
            self.policy.load_measured(request_id, now - began)

    def loads_failed(self, request_ids: Iterable[str]) -> None:
        """These requests' loads failed as a whole (several KV cache groups: vLLM recomputes
        their prompts and asks again): they load nothing more, or they would fail alike."""
        for request_id in request_ids:
            plan = self._plans.get(request_id)
            if plan is not None:
                plan.load = False
                plan.hit_tokens = 0

    def _unqueue(self, request_id: str) -> tuple[float, int, Tier, int] | None:
        """Take the request's load out of the loads in flight (None: it had none)."""
        loading = self._loading.pop(request_id, None)
        if loading is not None:
            self._queued[loading[2]] -= loading[1]
        return loading

    def _hashes(self, request: Any) -> Sequence[bytes] | None:
        """The request's engine block hashes in hash mode (None in token mode)."""
        return self.keys.block_hashes(request) if self.keys.engine_hashes else None

    def measured(
        self, steps: Iterable[tuple[int, float]], loads: Iterable[tuple[int, float]]
    ) -> None:
        """What the workers measured: forward steps and L1 loads' copies, as ``(tokens,
        seconds)``."""
        for tokens, seconds in steps:
            self.policy.model.observe_step(tokens, seconds)
        for tokens, seconds in loads:  # (L1 copies' own time; the policy times the wait too)
            log.debug("a worker's load of %d tokens took %.1f ms", tokens, seconds * 1e3)
            self.policy.model.observe_copy(tokens, seconds)

    def finished(self, request_id: str) -> bool:
        """The request is done or aborted: release what it holds at kvtrio; True if it issued
        stores (its blocks must stay until they are done)."""
        plan = self._plans.pop(request_id, None)
        self._requests.pop(request_id, None)
        self._ready = [t for t in self._ready if t.request_id != request_id]
        self._unqueue(request_id)
        self._skipped.pop(request_id, None)
        self._computing.pop(request_id, None)
        self.policy.forget(request_id)
        if self.spread is not None:
            self.spread.forget(request_id)
        self.adapter.end_session(request_id)
        return plan is not None and plan.stores > 0

    def close(self) -> None:
        """Say what the load policy did (its counters, if it decided anything); close the
        adapter."""
        if self.policy.stats:
            log.info("kvtrio load policy: %s", self.policy.summary())
        if self.spread is not None:
            log.info("kvtrio KV cache groups: %s", self.spread.summary())
        self.adapter.close()

    @property
    def costs(self) -> CostModel:
        """The load policy's cost model."""
        return self.policy.model
