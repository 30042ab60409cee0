"""Messages of a worker's registration: its KV cache's layout (and CUDA IPC exports), the
engine it belongs to, its hash scheme; and its withdrawal.

A worker registers once per session (a new registration replaces the old one); the reply tells
it where the L1 arena is and how long reservations and pins last. The hash scheme and seed
fingerprint let the server refuse an engine that would never name a chunk as its model's other
engines do.
"""

from __future__ import annotations

from typing import ClassVar

from attrs import field, frozen

from ._messages import Reply, Request
from ._tenant import check_tenant_name

__all__ = [
    "CudaCache",
    "CudaLayer",
    "LayoutSpec",
    "Register",
    "Registered",
    "Released",
    "Unregister",
]

IntTuple = tuple[int, ...]


@frozen
class LayoutSpec:
    """The shape of a worker's paged KV cache (see ``kvtrio.transfer.KVLayout``)."""

    kind: str
    """``flash_attn``, ``flash_infer``, ``mla``, ``cpu`` or ``vllm_cpu`` (vLLM's CPU backend up
    to 0.31, and from 0.32)."""
    num_layers: int
    num_blocks: int
    block_size: int
    num_heads: int
    head_dim: int
    dtype: str


@frozen
class CudaLayer:
    """One layer's KV tensor, shared by CUDA IPC: torch's export of its storage
    (``UntypedStorage._share_cuda_()``) and the tensor's view of that storage."""

    handle: bytes
    """The IPC memory handle of the allocation holding the storage."""
    storage_size: int
    """Bytes of the storage."""
    storage_offset: int
    """Where the storage starts in the allocation, in bytes."""
    ref_counter_handle: bytes
    """torch's shared reference counter (a shared-memory file) that keeps the engine from
    freeing the storage while the server has it open."""
    ref_counter_offset: int
    event_handle: bytes
    """An IPC event torch recorded when it exported the storage (may be empty)."""
    event_sync_required: bool
    shape: IntTuple
    stride: IntTuple
    """In elements."""
    offset: int
    """The tensor's offset into the storage, in elements."""
    dtype: str


@frozen
class CudaCache:
    """A CUDA worker's KV cache: where its layers are, on which GPU."""

    device_uuid: str
    """The GPU's UUID (as torch prints it); the server finds its own ordinal of that GPU, so the
    two processes may see different ``CUDA_VISIBLE_DEVICES`` orders."""
    layers: tuple[CudaLayer, ...]
    """One per layer, in layer order; their shapes are ``layout``'s layer shape."""


# --------------------------------------------------------------------------- register


@frozen
class Registered(Reply):
    chunk_size: int
    arena_path: str
    """Path of the shared-memory file to map read-write (the L1 arena)."""
    arena_size: int
    chunk_bytes: int
    """Bytes of one chunk of this worker's model in the canonical format."""
    reservation_ttl: float
    """Seconds a store's slots stay reserved; never write into a slot after that."""
    pin_ttl: float


@frozen
class Register(Request):
    """A worker registers its KV cache; replaces an earlier registration of the same session."""

    op: ClassVar[str] = "register"
    reply_type: ClassVar[type[Reply]] = Registered

    engine: str
    """The engine's id, shared by its scheduler and all its workers: request ids are scoped by
    it (with model and tenant), so two engines never touch each other's requests."""
    model: str
    world_size: int
    rank: int
    layout: LayoutSpec
    hash_scheme: str
    """``tokens/sha256-128/v1`` (token mode) or ``blocks/<engine hash>/v1`` (hash mode)."""
    device: str = "cpu"
    """``cpu`` (the worker copies through the L1 arena) or ``cuda`` (give ``cuda``)."""
    tenant: str = field(default="", validator=check_tenant_name)
    """Its tenant's name (``protocol._tenant``: ``[A-Za-z0-9._-]{0,64}``)."""
    cuda: CudaCache | None = None
    hash_seed: str = ""  # hash mode: a fingerprint of the engine's root block hash, not its seed


@frozen
class Released(Reply):
    released: int
    """Pins and reservations released."""


@frozen
class Unregister(Request):
    """A worker withdraws its registration; everything it held is released."""

    op: ClassVar[str] = "unregister"
    reply_type: ClassVar[type[Reply]] = Released
