"""Who is registered, with which model profile, in which engine. No prompts: since protocol
version 2 every operation carries its own chunk hashes."""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs

from ...errors import ErrorCode, RequestError
from ...protocol import HASH_SCHEME_TOKENS, LayoutSpec, Register
from ...storage import ModelProfile, namespace
from ...transfer import KVLayout

if TYPE_CHECKING:
    from ._copy import CopyPath

__all__ = ["ModelEntry", "Registration", "Registry", "layout_of"]

ModelKey = tuple[str, str, bytes, int]
"""``(model, tenant, profile digest, world size)``: engines that share cached chunks."""
EngineKey = tuple[str, str, str]
"""``(engine, model, tenant)``: the workers of one engine for one model."""


@attrs.define(eq=False)
class Registration:
    """A worker's registered KV cache (one per session)."""

    session_id: str
    engine: str
    model: str
    tenant: str
    world_size: int
    rank: int
    layout: KVLayout
    profile: ModelProfile
    fingerprint: bytes
    """``profile.digest()``, computed once (every committed chunk's L2 frame carries it)."""
    space: bytes
    """Namespace of this rank's objects."""
    chunk_bytes: int
    copy: CopyPath
    """How this worker's chunks move between its engine and L1 (see ``_copy``): chosen when it
    registers, used by every store and retrieve."""
    device: str = "cpu"


@attrs.define(eq=False)
class ModelEntry:
    """A model as its registered workers describe it; gone when its last worker is."""

    model: str
    tenant: str
    profile: ModelProfile
    world_size: int
    fingerprint: bytes
    """``profile.digest()``, computed once."""
    spaces: tuple[bytes, ...]
    """Namespaces a lookup must find a chunk in: one per rank, or one shared by all ranks."""
    chunk_bytes: int
    """Bytes of one chunk in L1 (the canonical format: the same for every worker)."""
    workers: int = 0
    hash_seed: str = ""
    """Hash mode: the fingerprint of its engines' root block hash (they all agree on it)."""

    @property
    def key(self) -> ModelKey:
        return (self.model, self.tenant, self.fingerprint, self.world_size)


@attrs.define(eq=False)
class EngineEntry:
    """The registered workers of one engine for one model (they agree on one profile)."""

    model: ModelEntry
    workers: int = 0


class Registry:
    """Registrations by session, models by :data:`ModelKey`, engines by :data:`EngineKey`.

    Engines of one model with different profiles (KV format, world size, …) coexist: their
    objects live in different namespaces. Only the workers of *one* engine must agree. No I/O.
    """

    def __init__(self, chunk_size: int) -> None:
        self.chunk_size = chunk_size
        self.by_session: dict[str, Registration] = {}
        self.models: dict[ModelKey, ModelEntry] = {}
        self.engines: dict[EngineKey, EngineEntry] = {}

    def engine_model(self, engine: str, model: str, tenant: str) -> ModelEntry | None:
        """The model entry the workers of ``engine`` registered for ``model``, if any."""
        entry = self.engines.get((engine, model, tenant))
        return entry.model if entry is not None else None

    # ----------------------------------------------------------------- registrations

    def check(self, register: Register) -> tuple[KVLayout, ModelProfile, int]:
        """Validate a registration without recording it: its layout, profile and chunk bytes.
        Raises :class:`RequestError` (``bad_request`` or ``incompatible``) with a message that
        says what is wrong (:meth:`register` checks the same again)."""
        layout = layout_of(register.layout)
        if register.device not in ("cpu", "cuda"):
            raise RequestError(
                ErrorCode.BAD_REQUEST,
                f"device {register.device!r}: expected 'cpu' (the worker copies through the L1 "
                "arena) or 'cuda' (the server copies through CUDA IPC)",
            )
        if register.device == "cpu" and register.cuda is not None:
            raise RequestError(ErrorCode.BAD_REQUEST, "the 'cuda' field needs device 'cuda'")
        if self.chunk_size % layout.block_size:
            raise RequestError(
                ErrorCode.BAD_REQUEST,
                f"the engine block size {layout.block_size} does not divide the server's chunk "
                f"size {self.chunk_size}: use a block size that does, or start kvtrio with "
                "--chunk-size a multiple of it",
            )
        if not 0 <= register.rank < register.world_size:
            raise RequestError(
                ErrorCode.BAD_REQUEST,
                f"rank {register.rank} is outside world size {register.world_size}",
            )
        hash_mode = register.hash_scheme != HASH_SCHEME_TOKENS
        if hash_mode and not register.hash_scheme.startswith("blocks/"):
            raise RequestError(
                ErrorCode.BAD_REQUEST,
                f"unknown hash scheme {register.hash_scheme!r}: use {HASH_SCHEME_TOKENS!r} or "
                "'blocks/<engine hash>/v1'",
            )
        profile = ModelProfile(
            hash_scheme=register.hash_scheme,
            block_size=layout.block_size if hash_mode else 0,
            num_layers=layout.num_layers,
            kv=layout.kv,
            row_elements=layout.row_elements,
            dtype=layout.dtype,
            shared_across_ranks=layout.kind == "mla",
        )
        if hash_mode:
            self._check_hash_agreement(register)
        self._check_engine_agreement(register, profile)
        return layout, profile, layout.chunk_nbytes(self.chunk_size)

    def register(self, session_id: str, register: Register, copy: CopyPath) -> Registration:
        """Validate (:meth:`check`) and record a registration with its copy path (the caller
        removed the session's previous one)."""
        layout, profile, chunk_bytes = self.check(register)
        entry = self._model_for(register, profile, chunk_bytes)
        rank_space = entry.spaces[0] if profile.shared_across_ranks else entry.spaces[register.rank]
        registration = Registration(
            session_id=session_id,
            engine=register.engine,
            model=register.model,
            tenant=register.tenant,
            world_size=register.world_size,
            rank=register.rank,
            layout=layout,
            profile=profile,
            fingerprint=entry.fingerprint,
            space=rank_space,
            chunk_bytes=chunk_bytes,
            copy=copy,
            device=register.device,
        )
        engine = self.engines.setdefault(
            (register.engine, register.model, register.tenant), EngineEntry(entry)
        )
        engine.workers += 1
        entry.workers += 1
        self.by_session[session_id] = registration
        return registration

    def _check_hash_agreement(self, register: Register) -> None:
        """Refuse a hash-mode registration whose block hash algorithm or root (its fingerprint)
        differs from those of the engines registered for the same model and tenant: their
        block hashes would never match, so they would share nothing, silently. (Token-mode
        engines of the model are left alone: they share nothing with hash-mode ones either,
        by design, as other clients do.)"""
        for entry in self.models.values():
            scheme = entry.profile.hash_scheme
            if (entry.model, entry.tenant) != (register.model, register.tenant) or not (
                scheme.startswith("blocks/")
            ):
                continue
            if scheme != register.hash_scheme:
                differs = f"hash scheme {scheme!r}, not {register.hash_scheme!r}"
            elif entry.hash_seed != register.hash_seed:
                differs = "another root hash (seed)"
            else:
                continue
            raise RequestError(
                ErrorCode.INCOMPATIBLE,
                f"other engines of model {register.model!r} (tenant {register.tenant!r}) use "
                f"{differs}: their block hashes would never match; give every engine the same "
                "PYTHONHASHSEED and prefix_caching_hash_algo",
            )

    def _check_engine_agreement(self, register: Register, profile: ModelProfile) -> None:
        """Refuse a worker that disagrees with the other workers of its own engine (and say
        only what differs, never another engine's settings)."""
        mine = self.engines.get((register.engine, register.model, register.tenant))
        if mine is None:
            return
        problems = [d.split(":")[0] for d in mine.model.profile.differences(profile)]
        if mine.model.world_size != register.world_size:
            problems.append("world_size")
        if problems:
            raise RequestError(
                ErrorCode.INCOMPATIBLE,
                f"the other workers of engine {register.engine!r} registered model "
                f"{register.model!r} with another {', '.join(problems)}; all workers of one "
                "engine must agree",
            )

    def _model_for(self, register: Register, profile: ModelProfile, chunk_bytes: int) -> ModelEntry:
        """The model entry of this profile (:meth:`check` found the worker agrees with the
        other workers of its own engine)."""
        mine = self.engines.get((register.engine, register.model, register.tenant))
        if mine is not None:
            return mine.model
        fingerprint = profile.digest()
        key = (register.model, register.tenant, fingerprint, register.world_size)
        entry = self.models.get(key)
        if entry is None:
            ranks = 1 if profile.shared_across_ranks else register.world_size
            spaces = tuple(
                namespace(register.model, register.tenant, profile, register.world_size, rank)
                for rank in range(ranks)
            )
            entry = ModelEntry(
                register.model,
                register.tenant,
                profile,
                register.world_size,
                fingerprint,
                spaces,
                chunk_bytes,
                hash_seed=register.hash_seed,
            )
            self.models[key] = entry
        return entry

    def unregister(self, session_id: str) -> Registration | None:
        registration = self.by_session.pop(session_id, None)
        if registration is not None:
            engine_key = (registration.engine, registration.model, registration.tenant)
            engine = self.engines[engine_key]
            engine.workers -= 1
            if engine.workers == 0:
                del self.engines[engine_key]
            entry = engine.model
            entry.workers -= 1
            if entry.workers == 0:
                del self.models[entry.key]
        return registration


def layout_of(spec: LayoutSpec) -> KVLayout:
    """The layout a registration describes, or ``bad_request`` saying what is wrong."""
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
