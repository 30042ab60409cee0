"""The engine worker's side: register the KV cache, store and retrieve through the L1 arena.

CPU engines own their KV tensors; the server only assigns arena slots. This adapter copies
between the tensors and the slots in its own transfer thread (numpy, single-threaded: the engine
owns the other cores), so the engine's step loop only queues work and polls
:meth:`WorkerAdapter.get_finished`. It never raises into the step loop and never needs the engine
to restart: when it meets a new server instance it registers again by itself, and a refused or
failed registration is retried with backoff (logged once per reason, counted in
:meth:`WorkerAdapter.metrics`); while the server is away, stores fail and retrieves report every
block failed, promptly. A store or retrieve submitted while a registration is under way waits
for it (at most ``timeout``). A store that could not be done is still reported finished (the
engine must free its blocks) but counted in ``store_failures`` by cause and logged once per
cause.

CPU copies overlap the protocol (:mod:`._arena_worker`): an operation of many chunks is sent
as a few requests at once and each batch is copied as soon as its reply is in. A store is
reported finished once the server has answered its commits (its chunks are visible to
lookups, or their failure is counted), but the transfer thread does not wait for those
answers: it copies the next operation meanwhile.

The chunk keys of every operation are computed here from that operation's own prompt
(:func:`~kvtrio.client.chunk_hashes`); the server keeps no prompts.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import attrs
import numpy as np

from ..errors import KvtrioError, NotRegistered
from ..protocol import (
    HelloReply,
    LayoutSpec,
    Register,
    Registered,
    Reply,
    RetrieveReply,
    Store,
    StoreReply,
    Unregister,
)
from ..shm import SharedArena
from ..storage import HASH_SCHEME_TOKENS
from ..transfer import KVLayout
from ..transfer.cuda import CudaRuntime, torch_runtime
from ._arena_worker import (
    ArenaWorker,
    Span,
    count_failed_slots,
    failure_cause,
    reply_of,
    when_all,
)
from ._cuda_worker import CudaWorker, is_cuda_cache
from ._failures import Failures
from ._scheduler import chunk_hashes
from ._sync import Client
from ._tensors import describe_kv_caches

__all__ = ["LoadStoreOp", "WorkerAdapter"]

log = logging.getLogger("kvtrio.client")

_RETRY_FIRST = 0.5
_RETRY_MAX = 30.0
"""Backoff of registration retries: first delay, doubling up to this."""


def _ints(values: Iterable[int]) -> tuple[int, ...]:
    return tuple(int(v) for v in values)


@attrs.frozen
class LoadStoreOp:
    """One store or retrieve of a request (vLLM's LMCache adapter ``LoadStoreOp``).

    ``block_ids`` are the request's engine blocks from its first token on; ``[start, end)`` is
    the token range to move (only its full chunks are moved). Give ``token_ids`` or
    ``block_hashes`` (hash mode) at least on the first operation of a request. A retrieve leaves
    the first ``skip_first_n_tokens`` tokens of the range alone (a whole number of blocks): the
    engine has them already, in blocks other requests may be reading.
    """

    block_ids: tuple[int, ...] = attrs.field(converter=_ints)
    token_ids: Sequence[int] | None = None
    block_hashes: Sequence[bytes | int] | None = None
    start: int = 0
    end: int = 0
    skip_first_n_tokens: int = 0


@attrs.define
class _Mapped:
    registered: Registered
    arena: SharedArena | None
    """None for CUDA workers (the server copies; the arena is not mapped here)."""
    generation: int
    instance_id: str | None
    """The server instance the registration was made with."""


class WorkerAdapter:
    """What an engine's worker (one per rank) calls. See the module docstring."""

    def __init__(
        self,
        server_url: str,
        model_name: str,
        world_size: int,
        kv_rank: int,
        block_size: int,
        *,
        tenant: str = "",
        hash_scheme: str = HASH_SCHEME_TOKENS,
        engine_id: str = "",
        timeout: float = 5.0,
        cuda_runtime: CudaRuntime | None = None,
        server_key: str | None = None,
        client_key: str | None = None,
    ) -> None:
        self.model_name = model_name
        self.world_size = world_size
        self.kv_rank = kv_rank
        self.block_size = block_size
        self.tenant = tenant
        self.hash_scheme = hash_scheme
        self.engine_id = engine_id
        self.timeout = timeout
        self._layout: KVLayout | None = None
        self._arrays: list[np.ndarray[Any, Any]] = []
        self._cuda_runtime = cuda_runtime
        self._cuda: CudaWorker | None = None
        self._arena: ArenaWorker | None = None
        self._mapped: _Mapped | None = None
        self._generation = 0
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._registering = False  # a registration is under way (sent, or reply not attached)
        self._register_target: str | None = None  # server instance the last Register went to
        self._attach_queue: tuple[Registered, int, str | None] | None = None
        self._retry_delay = _RETRY_FIRST
        self._retry: threading.Timer | None = None
        self._closed = False
        self.failures = Failures()
        self._transfers = ThreadPoolExecutor(1, thread_name_prefix=f"kvtrio-transfer-{kv_rank}")
        self._pending_stores: collections.Counter[str] = collections.Counter()
        self._open_stores: set[Future[None]] = set()  # submitted, commits not answered yet
        self._pending_retrieves: collections.Counter[str] = collections.Counter()
        self._stored: set[str] = set()
        self._engine_finished: set[str] = set()
        self._retrieves_done: set[str] = set()
        self._failed_blocks: set[int] = set()
        self.client = Client(
            server_url,
            timeout=timeout,
            client_name=f"kvtrio-worker/{model_name}/{kv_rank}",
            on_server_change=self._on_server_change,
            server_key=server_key,
            client_key=client_key,
        )

    # ----------------------------------------------------------------- registration

    def register_kv_caches(
        self, kv_caches: Mapping[str, Any], *, layout: str | None = None
    ) -> None:
        """Register the engine's KV tensors (one per layer, in layer order), as allocated.

        ``layout`` (``flash_attn``, ``flash_infer``, ``mla``, ``cpu``, ``vllm_cpu``) is inferred
        from the shapes when not given. CUDA tensors are exported by CUDA IPC and the server
        copies them (``docs/gpu.md``); CPU tensors are copied here, through the L1 arena. Raises
        ``ValueError`` for tensors it cannot serve; a server that is away is not an error
        (registration happens when it appears).
        """
        if is_cuda_cache(kv_caches):
            runtime = self._cuda_runtime or torch_runtime()
            if runtime is None:
                raise ValueError("CUDA KV tensors, but torch sees no usable CUDA GPU")
            self._cuda = CudaWorker(runtime, kv_caches, self.block_size, layout)
            self._layout, self._arrays = self._cuda.layout, []
        else:
            self._layout, self._arrays = describe_kv_caches(kv_caches, self.block_size, layout)
            self._arena = ArenaWorker(
                self.client, self._layout, self._arrays, self.failures, self._reregister
            )
        self._register()
        self._await_registration(time.monotonic() + self.timeout, attach=False)

    def _register(self) -> Future[Reply]:
        assert self._layout is not None
        layout = self._layout
        info = self.client.server_info
        with self._lock:
            self._generation += 1
            generation = self._generation
            self._registering = True
            # None: sent before any hello, so it reaches the first server the client meets.
            self._register_target = info.instance_id if info is not None else None
        request = Register(
            engine=self.engine_id,
            model=self.model_name,
            world_size=self.world_size,
            rank=self.kv_rank,
            layout=LayoutSpec(
                kind=layout.kind,
                num_layers=layout.num_layers,
                num_blocks=layout.num_blocks,
                block_size=layout.block_size,
                num_heads=layout.num_heads,
                head_dim=layout.head_dim,
                dtype=layout.dtype,
            ),
            hash_scheme=self.hash_scheme,
            tenant=self.tenant,
            device="cpu" if self._cuda is None else "cuda",
            cuda=None if self._cuda is None else self._cuda.cache,
        )
        future = self.client.submit(request, timeout=self.timeout)
        future.add_done_callback(lambda f: self._registered(f, generation))
        return future

    def _registered(self, future: Future[Reply], generation: int) -> None:
        # In the client's I/O thread: mapping the arena takes a while, do it in the transfer
        # thread (which also orders it before any transfer submitted after it).
        if future.cancelled() or future.exception() is not None:
            self._registration_failed(generation, str(future.exception() or "cancelled"))
            return
        reply = future.result()
        assert isinstance(reply, Registered)
        info = self.client.server_info
        instance = info.instance_id if info is not None else None
        with self._lock:
            if generation != self._generation:
                return
            self._attach_queue = (reply, generation, instance)
            self._changed.notify_all()
        with contextlib.suppress(RuntimeError):  # the adapter shut down meanwhile
            self._transfers.submit(self._attach_queued)

    def _registration_failed(self, generation: int, reason: str) -> None:
        """Count, say once per reason why this rank is not caching, retry with backoff."""
        with self._lock:
            if generation != self._generation or self._closed:
                return
            self._registering = False
            self.failures.registration()
            delay, self._retry_delay = self._retry_delay, min(_RETRY_MAX, self._retry_delay * 2)
            self._changed.notify_all()
            self._retry = threading.Timer(delay, self._retry_registration)
            self._retry.daemon = True
            self._retry.start()
        self.failures.warn_once(
            f"registration:{reason}",
            logging.ERROR,
            "kvtrio: rank %d is not caching: registration at %s failed (%s); retrying with backoff",
            self.kv_rank,
            self.client.endpoint,
            reason,
        )

    def _retry_registration(self) -> None:
        with self._lock:
            if self._closed or self._registering or self._current() is not None:
                return
        self._register()

    def _attach_queued(self) -> None:
        """Attach a registration reply that arrived (transfer thread: ordered with copies)."""
        with self._lock:
            queued, self._attach_queue = self._attach_queue, None
        if queued is not None:
            self._attach(*queued)

    def _await_registration(self, deadline: float, *, attach: bool = True) -> _Mapped | None:
        """The current registration, waiting until ``deadline`` while one is under way.

        With ``attach`` (in the transfer thread) a reply that arrived is attached here, so a
        copy queued before the reply never waits for itself."""
        while True:
            if attach:
                self._attach_queued()
            mapped = self._current()
            if mapped is not None:
                return mapped
            with self._lock:
                remaining = deadline - time.monotonic()
                if not self._registering or remaining <= 0:
                    return None
                if self._attach_queue is None or not attach:
                    self._changed.wait(remaining)

    def metrics(self) -> dict[str, Any]:
        """What this rank could not do: ``store_failures`` and ``retrieve_failures`` by cause
        (chunks), ``registration_failures``, and whether it is ``registered`` now."""
        return {"registered": self._current() is not None, **self.failures.snapshot()}

    def _attach(self, reply: Registered, generation: int, instance: str | None) -> None:
        with self._lock:
            if generation != self._generation:
                return
            old = self._mapped
        if self._cuda is not None:  # the server copies: no arena to map
            with self._lock:
                if generation == self._generation:
                    self._mapped = _Mapped(reply, None, generation, instance)
                    self._registered_now()
            return
        reuse = old is not None and old.arena is not None and old.arena.path == reply.arena_path
        arena = old.arena if reuse and old is not None else None
        if arena is None:
            try:
                arena = SharedArena.attach(reply.arena_path, reply.arena_size)
            except OSError as exc:
                self._registration_failed(generation, f"cannot map the L1 arena: {exc}")
                return
        with self._lock:
            if generation != self._generation:
                if old is None or arena is not old.arena:
                    arena.close()
                return  # a newer registration is under way
            if old is not None and old.arena is not None and old.arena is not arena:
                old.arena.close()
            self._mapped = _Mapped(reply, arena, generation, instance)
            self._registered_now()
        log.info("kvtrio: rank %d registered at %s", self.kv_rank, self.client.endpoint)

    def _registered_now(self) -> None:
        """(Under the lock.) The registration is attached: wake waiters, reset the backoff."""
        self._registering = False
        self._retry_delay = _RETRY_FIRST
        self.failures.forget("registration:")
        self._changed.notify_all()

    def _on_server_change(self, info: HelloReply) -> None:
        # In the client's I/O thread: only queue the registration, never wait here. Registering
        # bumps the generation, so the old arena (meaningless to the new server) stops being
        # used at once. The registration already made for this very server (register_kv_caches
        # before the first hello) is not repeated: that made the server see register →
        # unregister → register within milliseconds.
        if self._layout is None:
            return
        with self._lock:
            if (self._registering or self._current() is not None) and (
                self._register_target in (None, info.instance_id)
            ):
                self._register_target = info.instance_id
                return
        self._register()

    def _current(self) -> _Mapped | None:
        """The arena of the current registration, if it is attached."""
        mapped = self._mapped
        return mapped if mapped is not None and mapped.generation == self._generation else None

    @property
    def registered(self) -> bool:
        """Registered with the server this adapter is connected to right now."""
        mapped = self._current()
        info = self.client.server_info
        return (
            mapped is not None
            and self.client.connected
            and info is not None
            and info.instance_id == mapped.instance_id
        )

    @property
    def chunk_size(self) -> int:
        mapped = self._current()
        return mapped.registered.chunk_size if mapped is not None else 256

    # ----------------------------------------------------------------- submitting

    def submit_store_request(
        self, request_id: str, op: LoadStoreOp, event: object = None
    ) -> Future[None]:
        """Queue a store; the request counts as stored in :meth:`get_finished` once done.

        The future is done when the store is: the server has made its chunks visible, or the
        chunks that could not be stored are counted and logged (it never raises)."""
        engine_event = self._cuda.record() if self._cuda is not None else b""
        done: Future[None] = Future()
        with self._lock:
            self._pending_stores[request_id] += 1
            self._stored.add(request_id)
            self._open_stores.add(done)
        try:
            self._transfers.submit(self._run_store, request_id, op, engine_event, done)
        except RuntimeError:  # shut down: nothing will run it
            self._store_done(request_id, done)
            raise
        return done

    def submit_retrieve_request(
        self, request_id: str, op: LoadStoreOp, event: object = None
    ) -> Future[None]:
        """Queue a retrieve; :meth:`get_finished` reports it, :meth:`get_block_ids_with_load_errors`
        names the blocks that could not be loaded.

        The future is done when the blocks are in place or reported failed (it never raises)."""
        engine_event = self._cuda.record() if self._cuda is not None else b""
        done: Future[None] = Future()
        with self._lock:
            self._pending_retrieves[request_id] += 1
        try:
            self._transfers.submit(self._run_retrieve, request_id, op, engine_event, done)
        except RuntimeError:  # shut down: nothing will run it
            with self._lock:
                self._pending_retrieves[request_id] -= 1
            raise
        return done

    def batched_submit_store_requests(
        self, request_ids: Sequence[str], ops: Sequence[LoadStoreOp], event: object = None
    ) -> None:
        for request_id, op in zip(request_ids, ops, strict=True):
            self.submit_store_request(request_id, op, event)

    def batched_submit_retrieve_requests(
        self, request_ids: Sequence[str], ops: Sequence[LoadStoreOp], event: object = None
    ) -> None:
        for request_id, op in zip(request_ids, ops, strict=True):
            self.submit_retrieve_request(request_id, op, event)

    def num_blocks_per_chunk(self) -> int:
        """Engine blocks per cached chunk (a method, as in vLLM's adapter)."""
        return max(1, self.chunk_size // self.block_size)

    def get_finished(
        self, finished_req_ids_from_engine: Iterable[str]
    ) -> tuple[set[str], set[str]]:
        """``(stores done, retrieves done)`` since the last call.

        vLLM's rule: a request's stores are reported done only once the engine has also reported
        the request finished (its blocks are held until then).
        """
        with self._lock:
            self._engine_finished.update(
                r for r in finished_req_ids_from_engine if r in self._stored
            )
            stores = {r for r in self._engine_finished if not self._pending_stores[r]}
            for request_id in stores:
                self._engine_finished.discard(request_id)
                self._stored.discard(request_id)
                del self._pending_stores[request_id]
            retrieves, self._retrieves_done = self._retrieves_done, set()
        return stores, retrieves

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Engine blocks whose retrieve failed since the last call (the engine recomputes them)."""
        with self._lock:
            failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    # ----------------------------------------------------------------- transfers (own thread)

    def _span(self, mapped: _Mapped, request_id: str, op: LoadStoreOp) -> Span:
        """The full chunks of ``[op.start, op.end)`` and their hashes, from the operation's
        own prompt (``ValueError`` if it carries none)."""
        size = self.chunk_size
        hashes = chunk_hashes(
            size,
            self.block_size,
            token_ids=op.token_ids,
            block_hashes=op.block_hashes,
            end=op.end,
        )
        first, last = op.start // size, op.end // size
        if len(hashes) < last:
            raise ValueError(f"the operation's prompt covers {len(hashes)} chunks, not {last}")
        return Span(
            request_id,
            first,
            tuple(hashes[first:last]),
            hashes[first - 1] if first else b"",
            size,
            mapped.registered.chunk_bytes,
            size // self.block_size,
            op.block_ids,
        )

    def _blocks_of(self, op: LoadStoreOp, chunk: int) -> Sequence[int]:
        per_chunk = self.chunk_size // self.block_size
        return op.block_ids[chunk * per_chunk : (chunk + 1) * per_chunk]

    def _run_store(
        self, request_id: str, op: LoadStoreOp, engine_event: bytes, done: Future[None]
    ) -> None:
        chunks = max(0, op.end // self.chunk_size - op.start // self.chunk_size)
        commits: list[Future[Reply]] = []
        try:
            mapped = self._await_registration(time.monotonic() + self.timeout)
            if mapped is None:
                self.failures.store(request_id, "not_registered", chunks, "no registration")
            elif self._cuda is not None:
                self._cuda_store(self._cuda, mapped, request_id, op, engine_event)
            else:
                commits = self._store(mapped, request_id, op)
        except NotRegistered as exc:
            self.failures.store(request_id, "not_registered", chunks, exc)
            self._reregister()
        except KvtrioError as exc:
            self.failures.store(request_id, "server", chunks, exc)
        except (ValueError, TypeError, OverflowError) as exc:
            self.failures.store(request_id, "bad_prompt", chunks, exc)
        except Exception as exc:
            log.exception("store of %s failed", request_id)
            self.failures.store(request_id, "internal", chunks, exc)
        finally:
            when_all(commits, lambda: self._store_done(request_id, done))

    def _store_done(self, request_id: str, done: Future[None]) -> None:
        """The store is finished: its commits are answered (any thread)."""
        with self._lock:
            self._pending_stores[request_id] -= 1
            self._open_stores.discard(done)
        done.set_result(None)

    def _cuda_store(
        self, cuda: CudaWorker, mapped: _Mapped, request_id: str, op: LoadStoreOp, event: bytes
    ) -> None:
        """The server copies: send the blocks and the engine's event, wait for its event."""
        blocks = cuda.block_ids(op.block_ids, op.start, op.end, self.chunk_size, 0)
        span = self._span(mapped, request_id, op)
        request = Store(
            request_id,
            op.start,
            op.end,
            span.hashes,
            block_ids=blocks,
            event=event,
            parent_hash=span.parent,
        )
        reply = self.client.call(request, StoreReply, fail_fast=True)
        count_failed_slots(self.failures, request_id, reply)
        if reply.done_event:
            cuda.wait(reply.done_event)

    def _store(self, mapped: _Mapped, request_id: str, op: LoadStoreOp) -> list[Future[Reply]]:
        """Copy the chunks into L1 through the arena; the commits, not waited for."""
        assert self._arena is not None
        assert mapped.arena is not None
        return self._arena.store(mapped.arena, self._span(mapped, request_id, op))

    def _run_retrieve(
        self, request_id: str, op: LoadStoreOp, engine_event: bytes, done: Future[None]
    ) -> None:
        first, last = op.start // self.chunk_size, op.end // self.chunk_size
        loaded: set[int] = set()
        causes: dict[int, str] = {}  # chunks of batches the server refused
        cause = ""

        def finished() -> None:
            """Report the retrieve (once): which blocks failed, and that it is done."""
            if done.done():
                return
            kept = set(op.block_ids[: (op.start + op.skip_first_n_tokens) // self.block_size])
            missing = [c for c in range(first, last) if c not in loaded]
            failed = {b for c in missing for b in self._blocks_of(op, c) if b not in kept}
            for reason, count in collections.Counter(
                causes.get(c, cause or "missing") for c in missing
            ).items():
                self.failures.retrieve(reason, count)
            with self._lock:
                self._failed_blocks.update(failed)
                self._pending_retrieves[request_id] -= 1
                if not self._pending_retrieves[request_id]:
                    del self._pending_retrieves[request_id]
                    self._retrieves_done.add(request_id)
            done.set_result(None)

        try:
            mapped = self._await_registration(time.monotonic() + self.timeout)
            if mapped is None:
                cause = "not_registered"
            else:
                span = self._span(mapped, request_id, op)
                keep_before = op.start + op.skip_first_n_tokens  # the engine has these tokens
                if self._cuda is not None:
                    blocks = self._cuda.block_ids(
                        op.block_ids, op.start, op.end, self.chunk_size, keep_before
                    )
                    self._cuda_retrieve(self._cuda, span, blocks, engine_event, loaded, causes)
                else:
                    assert self._arena is not None
                    assert mapped.arena is not None
                    # (reported before its release is sent: the engine need not wait for that)
                    self._arena.retrieve(
                        mapped.arena, span, keep_before, loaded, causes, copied=finished
                    )
        except NotRegistered:
            cause = "not_registered"
            self._reregister()
        except KvtrioError as exc:
            cause = "server"
            log.debug("retrieve of %s failed: %s", request_id, exc)
        except (ValueError, TypeError, OverflowError) as exc:
            cause = "bad_prompt"
            log.debug("retrieve of %s failed: %s", request_id, exc)
        except Exception:
            cause = "internal"
            log.exception("retrieve of %s failed", request_id)
        finally:
            finished()

    def _cuda_retrieve(
        self,
        cuda: CudaWorker,
        span: Span,
        blocks: Sequence[int],
        engine_event: bytes,
        loaded: set[int],
        causes: dict[int, str],
    ) -> None:
        """The server copies into the engine's ``blocks`` (-1: a block it leaves alone). In
        partial retrieves, as the CPU path (:meth:`ArenaWorker.retrieve`): the server queues
        the copies of the chunks in L1 while later ones still load; each part's chunks count
        as loaded once its event has completed."""
        per = span.blocks_per_chunk

        def part(start: int) -> Future[Reply]:
            request = span.retrieve(
                start, block_ids=tuple(blocks[start * per :]), event=engine_event
            )
            return self.client.submit(request, fail_fast=True)

        start = 0
        future: Future[Reply] | None = part(0)
        while future is not None:
            try:
                reply = reply_of(future, RetrieveReply)
            except Exception as exc:
                cause = failure_cause(exc)
                causes.update((span.first + i, cause) for i in range(start, span.chunks))
                if isinstance(exc, NotRegistered):
                    self._reregister()
                return
            future, rest = None, span.loading(reply)
            if rest is not None:  # asked for before waiting for this part's copies
                start, future = rest, part(rest)
            read = {slot.chunk for slot in reply.slots if slot.status == "read"}
            if read and reply.done_event:
                cuda.wait(reply.done_event)
                loaded |= read

    def _reregister(self) -> None:
        if self._layout is not None:
            log.info("kvtrio: server lost this worker's registration; registering again")
            self._register()

    # ----------------------------------------------------------------- shutdown

    def shutdown(self) -> None:
        """Finish queued transfers, unregister (best effort), close the connection."""
        with self._lock:
            self._closed = True
            if self._retry is not None:
                self._retry.cancel()
        self._transfers.shutdown(wait=True)
        with self._lock:
            stores = list(self._open_stores)
        concurrent.futures.wait(stores, timeout=self.timeout)  # commits still being answered
        if self._current() is not None:
            with contextlib.suppress(KvtrioError):
                self.client.request(Unregister(), timeout=1.0, fail_fast=True)
        self.client.close()
        with self._lock:
            if self._mapped is not None:
                if self._mapped.arena is not None:
                    self._mapped.arena.close()
                self._mapped = None
