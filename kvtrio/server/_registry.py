"""Who is registered, with which model profile, and what each request's prompt hashes are."""

from __future__ import annotations

from typing import Any

import attrs

from ..errors import ErrorCode, RequestError
from ..protocol import LayoutSpec, Register
from ..storage import HASH_SCHEME_TOKENS, ChunkChain, ModelProfile, namespace
from ..transfer import KVLayout

__all__ = ["ModelEntry", "Registration", "Registry", "RequestState", "request_key"]


def request_key(model: str, tenant: str, request: str) -> str:
    """Requests are named per model and tenant: two engines of different models may reuse ids."""
    return f"{model}\x00{tenant}\x00{request}"


@attrs.define(eq=False)
class Registration:
    """A worker's registered KV cache (one per session)."""

    session_id: str
    instance_id: str
    model: str
    tenant: str
    world_size: int
    rank: int
    layout: KVLayout
    profile: ModelProfile
    space: bytes
    """Namespace of this rank's objects."""
    chunk_bytes: int
    device: str = "cpu"
    cuda: Any = None
    """The opened CUDA registration (``server._cuda.CudaRegistration``) of a CUDA worker."""


@attrs.define(eq=False)
class ModelEntry:
    """A model as its registered workers describe it; gone when its last worker is."""

    model: str
    tenant: str
    profile: ModelProfile
    world_size: int
    spaces: tuple[bytes, ...]
    """Namespaces a lookup must find a chunk in: one per rank, or one shared by all ranks."""
    workers: int = 0


@attrs.define(eq=False)
class RequestState:
    chain: ChunkChain
    last_used: float


class Registry:
    """Registrations by session, models by (name, tenant), requests by key. No I/O."""

    def __init__(self, chunk_size: int) -> None:
        self.chunk_size = chunk_size
        self.by_session: dict[str, Registration] = {}
        self.models: dict[tuple[str, str], ModelEntry] = {}
        self.requests: dict[str, RequestState] = {}

    # ----------------------------------------------------------------- registrations

    def register(self, session_id: str, request: Register) -> Registration:
        """Validate and record a registration (the caller removed the session's previous one).

        Raises :class:`RequestError` (``bad_request`` or ``incompatible``) with a message that
        says what is wrong.
        """
        layout = _layout(request.layout)
        if request.device not in ("cpu", "cuda"):
            raise RequestError(
                ErrorCode.BAD_REQUEST,
                f"device {request.device!r}: expected 'cpu' (the worker copies through the L1 "
                "arena) or 'cuda' (the server copies through CUDA IPC)",
            )
        if request.device == "cpu" and request.cuda is not None:
            raise RequestError(ErrorCode.BAD_REQUEST, "the 'cuda' field needs device 'cuda'")
        if self.chunk_size % layout.block_size:
            raise RequestError(
                ErrorCode.BAD_REQUEST,
                f"the engine block size {layout.block_size} does not divide the server's chunk "
                f"size {self.chunk_size}: use a block size that does, or start kvtrio with "
                "--chunk-size a multiple of it",
            )
        if not 0 <= request.rank < request.world_size:
            raise RequestError(
                ErrorCode.BAD_REQUEST,
                f"rank {request.rank} is outside world size {request.world_size}",
            )
        hash_mode = request.hash_scheme != HASH_SCHEME_TOKENS
        if hash_mode and not request.hash_scheme.startswith("blocks/"):
            raise RequestError(
                ErrorCode.BAD_REQUEST,
                f"unknown hash scheme {request.hash_scheme!r}: use {HASH_SCHEME_TOKENS!r} or "
                "'blocks/<engine hash>/v1'",
            )
        profile = ModelProfile(
            hash_scheme=request.hash_scheme,
            block_size=layout.block_size if hash_mode else 0,
            num_layers=layout.num_layers,
            kv=layout.kv,
            row_elements=layout.row_elements,
            dtype=layout.dtype,
            shared_across_ranks=layout.kind == "mla",
        )
        entry = self._model_for(request, profile)
        rank_space = entry.spaces[0] if profile.shared_across_ranks else entry.spaces[request.rank]
        registration = Registration(
            session_id=session_id,
            instance_id=request.instance_id,
            model=request.model,
            tenant=request.tenant,
            world_size=request.world_size,
            rank=request.rank,
            layout=layout,
            profile=profile,
            space=rank_space,
            chunk_bytes=layout.chunk_nbytes(self.chunk_size),
            device=request.device,
        )
        entry.workers += 1
        self.by_session[session_id] = registration
        return registration

    def _model_for(self, request: Register, profile: ModelProfile) -> ModelEntry:
        key = (request.model, request.tenant)
        entry = self.models.get(key)
        if entry is None:
            ranks = 1 if profile.shared_across_ranks else request.world_size
            spaces = tuple(
                namespace(request.model, request.tenant, profile, request.world_size, rank)
                for rank in range(ranks)
            )
            entry = ModelEntry(request.model, request.tenant, profile, request.world_size, spaces)
            self.models[key] = entry
            return entry
        problems = entry.profile.differences(profile)
        if entry.world_size != request.world_size:
            problems.append(f"world_size: {entry.world_size} vs {request.world_size}")
        if problems:
            raise RequestError(
                ErrorCode.INCOMPATIBLE,
                f"model {request.model!r} is already registered by engines that differ from this "
                f"one ({'; '.join(problems)}); they would not share cached chunks. Give this "
                "engine another model name or tenant, or stop the others first",
            )
        return entry

    def unregister(self, session_id: str) -> Registration | None:
        registration = self.by_session.pop(session_id, None)
        if registration is not None:
            key = (registration.model, registration.tenant)
            entry = self.models[key]
            entry.workers -= 1
            if entry.workers == 0:
                del self.models[key]
        return registration

    # ----------------------------------------------------------------- requests

    def chain(self, key: str, now: float) -> ChunkChain:
        state = self.requests.get(key)
        if state is None:
            state = self.requests[key] = RequestState(ChunkChain(self.chunk_size), now)
        state.last_used = now
        return state.chain

    def forget_request(self, key: str) -> bool:
        return self.requests.pop(key, None) is not None

    def forget_idle_requests(self, older_than: float) -> int:
        idle = [key for key, state in self.requests.items() if state.last_used < older_than]
        for key in idle:
            del self.requests[key]
        return len(idle)


def _layout(spec: LayoutSpec) -> KVLayout:
    try:
        return KVLayout(
            kind=spec.kind,
            num_layers=spec.num_layers,
            num_blocks=spec.num_blocks,
            block_size=spec.block_size,
            num_heads=spec.num_heads,
            head_dim=spec.head_dim,
            dtype=spec.dtype,
        )
    except (ValueError, TypeError) as exc:
        raise RequestError(ErrorCode.BAD_REQUEST, f"invalid layout: {exc}") from None
