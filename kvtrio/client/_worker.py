"""The engine worker's side: register the KV cache, store and retrieve through the L1 arena.

CPU engines own their KV tensors; the server only assigns arena slots. This adapter copies
between the tensors and the slots in its own transfer thread (numpy, single-threaded: the engine
owns the other cores), so the engine's step loop only queues work and polls
:meth:`WorkerAdapter.get_finished`. That thread and the client's I/O thread run where the
adapter's :class:`~._placement.ThreadPlacement` says: off the engine's compute cores.
It never raises into the step loop and never needs the engine
to restart: when it meets a new server instance it registers again by itself, and a refused or
failed registration is retried with backoff (logged once per reason, counted in
:meth:`WorkerAdapter.metrics`); while the server is away, stores fail and retrieves report every
block failed, promptly. A store or retrieve submitted while a registration is under way waits
for it (at most ``timeout``). A store that could not be done is still reported finished (the
engine must free its blocks) but counted in ``store_failures`` by cause and logged once per
cause.

How the bytes move is chosen once, when the engine registers its tensors: a copy path
(:mod:`._copies`) that every store and retrieve runs on, in the adapter's transfer thread. CPU
tensors are copied here through the L1 arena (:mod:`._arena_worker`), overlapping the
protocol: an operation of many chunks is sent as a few requests at once and each batch is
copied as soon as its reply is in. CUDA tensors are copied by the server over CUDA IPC
(:mod:`._cuda_worker`). A store is reported finished once the server has answered its commits
(its chunks are visible to lookups, or their failure is counted), but the transfer thread does
not wait for those answers: it copies the next operation meanwhile.

The chunk keys of every operation are computed here from that operation's own prompt
(:func:`kvtrio.protocol.prompt_chunks`); the server keeps no prompts.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any

from ..errors import KvtrioError, NotRegistered
from ..protocol import (
    DEFAULT_CHUNK_SIZE,
    HASH_SCHEME_TOKENS,
    HelloReply,
    LayoutSpec,
    Register,
    Registered,
    Reply,
    Unregister,
    prompt_chunks,
)
from ..transfer import KVLayout
from ..transfer.cuda import CudaRuntime, torch_runtime
from ._arena_worker import ArenaCopies
from ._completions import Completions
from ._copies import LoadStoreOp, Retrieved, Span, WorkerCopies, when_all
from ._cuda_worker import CudaCopies, is_cuda_cache
from ._failures import Failures
from ._identity import EngineIdentity
from ._lanes import TransferLanes
from ._placement import INHERITED, ThreadPlacement
from ._registration import Current, Registrar
from ._sync import Client
from ._tensors import describe_kv_caches

__all__ = ["LoadStoreOp", "WorkerAdapter"]

log = logging.getLogger("kvtrio.client")


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
        hash_seed: str = "",
        engine_id: str = "",
        timeout: float = 5.0,
        cuda_runtime: CudaRuntime | None = None,
        server_key: str | None = None,
        client_key: str | None = None,
        placement: ThreadPlacement = INHERITED,
    ) -> None:
        self.model_name = model_name
        self.placement = placement
        self.world_size = world_size
        self.kv_rank = kv_rank
        self.block_size = block_size
        self.tenant = tenant
        self.hash_scheme = hash_scheme
        self.hash_seed = hash_seed
        self.engine_id = engine_id
        self.timeout = timeout
        self._cuda_runtime = cuda_runtime
        self._path: WorkerCopies | None = None
        """How this rank's bytes move: chosen by :meth:`register_kv_caches`."""
        self.failures = Failures()
        self._transfers = TransferLanes(f"kvtrio-transfer-{kv_rank}_0", placement.apply)
        """Loads (and registration) before stores, each in order (see :mod:`._lanes`)."""
        self._completions = Completions()
        """What is reported to the engine as done (:meth:`get_finished`), or failed."""
        self.client = Client(
            server_url,
            timeout=timeout,
            client_name=f"kvtrio-worker/{model_name}/{kv_rank}",
            on_server_change=self._on_server_change,
            server_key=server_key,
            client_key=client_key,
            placement=placement,
        )
        self._registration = Registrar(
            self.client, self._register_request, self._attach, self._transfers, self.failures,
            kv_rank, timeout,
        )  # fmt: skip

    @classmethod
    def from_identity(
        cls,
        identity: EngineIdentity,
        *,
        cuda_runtime: CudaRuntime | None = None,
        placement: ThreadPlacement = INHERITED,
    ) -> WorkerAdapter:
        """The worker adapter of rank ``identity.kv_rank`` of the engine ``identity`` names;
        its threads run where ``placement`` says."""
        i = identity
        return cls(i.server_url, i.model_name, i.world_size, i.kv_rank, i.block_size,
                   tenant=i.tenant, engine_id=i.engine_id, timeout=i.timeout,
                   cuda_runtime=cuda_runtime, server_key=i.server_key,
                   client_key=i.client_key, hash_scheme=i.hash_scheme,
                   hash_seed=i.hash_seed, placement=placement)  # fmt: skip

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
        self._path = self._copy_path(kv_caches, layout)
        self._registration.register()
        self._registration.wait(time.monotonic() + self.timeout, attach=False)

    def _copy_path(self, kv_caches: Mapping[str, Any], layout: str | None) -> WorkerCopies:
        """The copy path of these tensors: the server's CUDA copies for CUDA tensors, the
        arena's host copies for CPU tensors (``ValueError`` for tensors it cannot serve)."""
        lost = self._lost
        if is_cuda_cache(kv_caches, self._cuda_runtime):
            runtime = self._cuda_runtime or torch_runtime()
            if runtime is None:
                raise ValueError("CUDA KV tensors, but torch sees no usable CUDA GPU")
            return CudaCopies(
                self.client, runtime, kv_caches, self.block_size, layout, self.failures, lost
            )
        kv_layout, arrays = describe_kv_caches(kv_caches, self.block_size, layout)
        return ArenaCopies(self.client, kv_layout, arrays, self.failures, lost)

    @property
    def layout(self) -> KVLayout | None:
        """The layout of the registered KV tensors (None before :meth:`register_kv_caches`)."""
        return self._path.layout if self._path is not None else None

    def _register_request(self) -> Register:
        assert self._path is not None
        path, layout = self._path, self._path.layout
        return Register(
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
            hash_seed=self.hash_seed,
            device=path.device,
            cuda=path.cuda,
        )

    def _attach(self, reply: Registered) -> None:
        assert self._path is not None
        self._path.attach(reply)

    def _on_server_change(self, info: HelloReply) -> None:
        # In the client's I/O thread: only queue the registration, never wait here.
        if self._path is not None:
            self._registration.server_changed(info)

    def _lost(self) -> None:
        """The server has no registration of this connection (any thread)."""
        self._registration.lost()

    def metrics(self) -> dict[str, Any]:
        """What this rank could not do: ``store_failures`` and ``retrieve_failures`` by cause
        (chunks), ``registration_failures``, and whether it is ``registered`` now."""
        registered = self._registration.current() is not None
        return {"registered": registered, **self.failures.snapshot()}

    @property
    def registered(self) -> bool:
        """Registered with the server this adapter is connected to right now."""
        return self._registration.registered

    @property
    def chunk_size(self) -> int:
        current = self._registration.current()
        return current.registered.chunk_size if current is not None else DEFAULT_CHUNK_SIZE

    # ----------------------------------------------------------------- submitting

    def submit_store_request(
        self, request_id: str, op: LoadStoreOp, event: object = None
    ) -> Future[None]:
        """Queue a store; the request counts as stored in :meth:`get_finished` once done.

        The future is done when the store is: the server has made its chunks visible, or the
        chunks that could not be stored are counted and logged (it never raises)."""
        engine_event = self._path.engine_event() if self._path is not None else b""
        done: Future[None] = Future()
        self._completions.store_submitted(request_id, done)
        try:
            self._transfers.submit_later(self._run_store, request_id, op, engine_event, done)
        except RuntimeError:  # shut down: nothing will run it
            self._completions.store_ended(request_id, done)
            raise
        return done

    def submit_retrieve_request(
        self, request_id: str, op: LoadStoreOp, event: object = None
    ) -> Future[None]:
        """Queue a retrieve; :meth:`get_finished` reports it, :meth:`get_block_ids_with_load_errors`
        names the blocks that could not be loaded.

        The future is done when the blocks are in place or reported failed (it never raises)."""
        engine_event = self._path.engine_event() if self._path is not None else b""
        done: Future[None] = Future()
        self._completions.retrieve_submitted(request_id)
        try:
            self._transfers.submit(self._run_retrieve, request_id, op, engine_event, done)
        except RuntimeError:  # shut down: nothing will run it
            self._completions.retrieve_not_run(request_id)
            raise
        return done

    def num_blocks_per_chunk(self) -> int:
        """Engine blocks per cached chunk (a method, as in vLLM's adapter)."""
        return max(1, self.chunk_size // self.block_size)

    def get_finished(
        self, finished_req_ids_from_engine: Iterable[str]
    ) -> tuple[set[str], set[str]]:
        """``(stores done, retrieves done)`` since the last call.

        vLLM's rule: a request's stores are reported done only once the engine has also reported
        the request finished (its blocks are held until then); see :mod:`._completions`.
        """
        return self._completions.finished(finished_req_ids_from_engine)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Engine blocks whose retrieve failed since the last call (the engine recomputes them)."""
        return self._completions.failed_blocks()

    # ----------------------------------------------------------------- transfers (own thread)

    def _span(self, current: Current, request_id: str, op: LoadStoreOp, *, store: bool) -> Span:
        """The chunks the operation moves and their hashes, from its own prompt (``ValueError``
        if it carries none, or too little of it).

        A store names the chunks of the prompt's first ``end`` tokens: its full chunks, then
        the whole blocks after them as its partial chunk. A retrieve names them from the whole
        prompt, as its lookup did, and moves the blocks before ``end`` only."""
        size, block = self.chunk_size, self.block_size
        end = op.end - op.end % block
        tokens, block_hashes = op.token_ids, op.block_hashes
        if store:
            tokens = None if tokens is None else tokens[:end]
            block_hashes = None if block_hashes is None else block_hashes[: end // block]
        chunks = prompt_chunks(size, block, token_ids=tokens, block_hashes=block_hashes)
        if chunks.tokens < end:
            raise ValueError(f"the operation's prompt covers {chunks.tokens} tokens, not {end}")
        first, last = op.start // size, self._chunks_to(end)
        return Span(
            request_id,
            first,
            chunks.hashes[first:last],
            chunks.hashes[first - 1] if first else b"",
            size,
            current.registered.chunk_bytes,
            size // block,
            op.block_ids,
            stop_block=end // block,
            partial=bool(chunks.tail_blocks) and last > chunks.full,
            event_hashes=tuple(op.event_hashes or ()),
            event_first=op.start // block,
            event_extra_keys=tuple(op.event_extra_keys or ()),
            lora_name=op.lora_name,
            group=op.group,
            prompt_tokens=() if tokens is None else tokens,
        )

    def _chunks_to(self, end: int) -> int:
        """The number of chunks that hold the whole blocks before token ``end``."""
        whole = end - end % self.block_size
        return -(-whole // self.chunk_size)

    def _blocks_of(self, op: LoadStoreOp, chunk: int) -> Sequence[int]:
        per_chunk = self.chunk_size // self.block_size
        stop = min((chunk + 1) * per_chunk, op.end // self.block_size)
        return op.block_ids[chunk * per_chunk : stop]

    def _run_store(
        self, request_id: str, op: LoadStoreOp, engine_event: bytes, done: Future[None]
    ) -> None:
        chunks = max(0, self._chunks_to(op.end) - op.start // self.chunk_size)
        commits: list[Future[Reply]] = []
        try:
            current = self._registration.wait(time.monotonic() + self.timeout)
            if current is None:
                self.failures.store(request_id, "not_registered", chunks, "no registration")
            else:
                assert self._path is not None
                span = self._span(current, request_id, op, store=True)
                commits = self._path.store(span, engine_event)
        except NotRegistered as exc:
            self.failures.store(request_id, "not_registered", chunks, exc)
            self._lost()
        except KvtrioError as exc:
            self.failures.store(request_id, "server", chunks, exc)
        except (ValueError, TypeError, OverflowError) as exc:
            self.failures.store(request_id, "bad_prompt", chunks, exc)
        except Exception as exc:
            log.exception("store of %s failed", request_id)
            self.failures.store(request_id, "internal", chunks, exc)
        finally:
            when_all(commits, lambda: self._completions.store_ended(request_id, done))

    def _run_retrieve(
        self, request_id: str, op: LoadStoreOp, engine_event: bytes, done: Future[None]
    ) -> None:
        first, last = op.start // self.chunk_size, self._chunks_to(op.end)
        result = Retrieved()  # (nothing loaded, if the whole retrieve fails)
        cause = ""
        detail: object = ""

        def finished() -> None:
            """Report the retrieve: which blocks failed, and that it is done."""
            loaded, causes = result.loaded, result.causes
            kept = set(op.block_ids[: (op.start + op.skip_first_n_tokens) // self.block_size])
            missing = [c for c in range(first, last) if c not in loaded]
            failed = {b for c in missing for b in self._blocks_of(op, c) if b not in kept}
            for reason, count in collections.Counter(
                causes.get(c, cause or "missing") for c in missing
            ).items():
                self.failures.retrieve(request_id, reason, count, detail)
            self._completions.retrieve_ended(request_id, failed)
            done.set_result(None)

        try:
            current = self._registration.wait(time.monotonic() + self.timeout)
            if current is None:
                cause = "not_registered"
            else:
                assert self._path is not None
                span = self._span(current, request_id, op, store=False)
                keep_before = op.start + op.skip_first_n_tokens  # the engine has these tokens
                result = self._path.retrieve(span, keep_before, engine_event)
        except NotRegistered:
            cause = "not_registered"
            self._lost()
        except KvtrioError as exc:
            cause, detail = "server", exc
        except (ValueError, TypeError, OverflowError) as exc:
            cause, detail = "bad_prompt", exc
        except Exception:
            cause = "internal"
            log.exception("retrieve of %s failed", request_id)
        finally:
            finished()

    # ----------------------------------------------------------------- shutdown

    def shutdown(self) -> None:
        """Finish queued transfers, unregister (best effort), close the connection."""
        self._registration.close()
        self._transfers.shutdown(wait=True)
        stores = self._completions.open_stores()
        concurrent.futures.wait(stores, timeout=self.timeout)  # commits still being answered
        if self._registration.current() is not None:
            with contextlib.suppress(KvtrioError):
                self.client.request(Unregister(), timeout=1.0, fail_fast=True)
        self.client.close()
        if self._path is not None:
            self._path.close()
