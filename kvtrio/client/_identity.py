"""Who an engine's adapters speak for, and how they reach the server: one frozen object for an
engine's scheduler adapter and each of its workers' adapters (vLLM hands them one config)."""

from __future__ import annotations

import attrs

from ..protocol import HASH_SCHEME_TOKENS

__all__ = ["EngineIdentity"]


@attrs.frozen
class EngineIdentity:
    """An engine as kvtrio knows it (the adapters' constructor arguments, once).

    ``engine_id`` must be the same for the engine's scheduler and all its workers: the server
    scopes request ids by it, so engines never touch each other's requests. ``server_key`` /
    ``client_key``: CURVE keys for ``tcp://`` (None: the defaults; ``"none"``: no CURVE).
    ``hash_scheme`` and ``hash_seed`` (the fingerprint of the engine's root block hash, hash
    mode) are what its workers register: engines sharing a model must agree on them."""

    server_url: str
    model_name: str
    world_size: int
    kv_rank: int
    block_size: int
    tenant: str = ""
    engine_id: str = ""
    timeout: float = 5.0
    server_key: str | None = None
    client_key: str | None = None
    hash_scheme: str = HASH_SCHEME_TOKENS
    hash_seed: str = ""
