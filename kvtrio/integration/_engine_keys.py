"""Which keys an engine's connector names its chunks by: vLLM's own block hashes (hash mode,
the default) or its token ids (token mode).

In hash mode the chunk hashes come from ``request.block_hashes``, which vLLM computes anyway
for its prefix cache: they already tell apart requests with a LoRA adapter, multimodal inputs,
prompt embeddings or a ``cache_salt`` (vLLM's *extra keys*), and the scheduler does not hash
the prompt a second time. Two engines share chunks only if their block hashes agree, which
takes the same algorithm (``prefix_caching_hash_algo``) and the same root hash (vLLM's
``NONE_HASH``, derived from ``PYTHONHASHSEED`` when it is set, else from a fixed seed for the
SHA-256 algorithms and from a *random* one for the xxhash ones). So a worker registers the
scheme ``blocks/<algo>/v1`` with a fingerprint of the root (a hash of ``NONE_HASH``, never the
seed), and the server refuses an engine whose scheme or fingerprint disagrees with the other
engines of its model and tenant.

An engine whose root is random (xxhash without ``PYTHONHASHSEED``) could only ever hit its own
chunks, and not even after a restart: it falls back to token mode, with a warning that says
what to set. Imports vLLM only inside :func:`key_scheme`.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Sequence
from typing import Any

import attrs

from ..protocol import HASH_SCHEME_TOKENS, block_hash_scheme

__all__ = ["KeyScheme", "engine_root", "key_scheme", "root_fingerprint"]

log = logging.getLogger("kvtrio.vllm")

_ROOT_PREFIX = b"kvtrio/engine-root/v1"


@attrs.frozen
class KeyScheme:
    """How one engine names its chunks (the same in its scheduler and in its workers)."""

    hash_scheme: str = HASH_SCHEME_TOKENS
    """What the workers register: ``tokens/sha256-128/v1`` or ``blocks/<algo>/v1``."""
    hash_seed: str = ""
    """Hash mode: the fingerprint of the engine's root hash (hex; '' in token mode)."""
    root: bytes = b""
    """Hash mode: the root hash (``NONE_HASH``) the engine is expected to use."""
    hashes_per_block: int = 1
    """vLLM block hashes per engine block (hybrid models may hash finer than they allocate)."""

    @property
    def engine_hashes(self) -> bool:
        """True in hash mode: chunks are named by the engine's block hashes."""
        return self.hash_scheme != HASH_SCHEME_TOKENS

    def block_hashes(self, request: Any) -> Sequence[bytes]:
        """The request's block hashes, one per engine block (hash mode)."""
        hashes: Sequence[bytes] = request.block_hashes
        step = self.hashes_per_block
        return hashes if step == 1 else hashes[step - 1 :: step]


def engine_root() -> bytes | None:
    """vLLM's root block hash in this process (None before vLLM has set it, or without vLLM)."""
    try:
        from vllm.v1.core import kv_cache_utils
    except ImportError:  # pragma: no cover - the connector runs inside vLLM
        return None
    root = getattr(kv_cache_utils, "NONE_HASH", None)
    return None if root is None else bytes(root)


def root_fingerprint(root: bytes) -> str:
    """The fingerprint of an engine's root hash: what a registration carries (hex), so that
    engines can be compared without the seed travelling."""
    return hashlib.sha256(_ROOT_PREFIX + root).hexdigest()[:32]


def key_scheme(mode: str, vllm_config: Any, kv_cache_config: Any) -> KeyScheme:
    """The keys of the engine ``vllm_config`` describes, for the connector option ``keys``
    (``engine`` or ``tokens``): hash mode where the engine's block hashes can be shared,
    else token mode (logged as a warning that says why and what to set)."""
    if mode == "tokens":
        return KeyScheme()
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils

    algo = str(vllm_config.cache_config.prefix_caching_hash_algo)
    hash_fn = get_hash_fn_by_name(algo)
    seed = os.environ.get("PYTHONHASHSEED")
    random_root = getattr(kv_cache_utils, "_NON_CRYPTO_HASH_FUNCTIONS", None)
    if seed is None and (random_root is None or hash_fn in random_root):
        log.warning(
            "kvtrio: vLLM's block hashes (%s) start from a random root in each process "
            "because PYTHONHASHSEED is not set: this engine names its chunks by token ids "
            "instead (requests with a LoRA adapter, multimodal inputs, prompt embeddings or "
            "a cache_salt are then not cached). Set the same PYTHONHASHSEED on every engine, "
            "or use prefix_caching_hash_algo sha256/sha256_cbor",
            algo,
        )
        return KeyScheme()
    if seed is None:
        seed = getattr(kv_cache_utils, "DEFAULT_NONE_HASH_SEED", "vllm-none-hash")
    per_block = _hashes_per_block(vllm_config, kv_cache_config)
    if per_block is None:
        return KeyScheme()
    root = bytes(hash_fn(seed))
    return KeyScheme(block_hash_scheme(algo), root_fingerprint(root), root, per_block)


def _hashes_per_block(vllm_config: Any, kv_cache_config: Any) -> int | None:
    """vLLM block hashes per engine block; None (logged) where they do not tile the blocks."""
    block_size = int(vllm_config.cache_config.block_size)
    hash_block_size = block_size
    if kv_cache_config is not None and len(kv_cache_config.kv_cache_groups) > 1:
        try:
            from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

            _, hash_block_size = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
        except (ImportError, ValueError, AttributeError, TypeError) as exc:
            log.warning("kvtrio: vLLM's block hash size is unknown (%s): token mode", exc)
            return None
    if hash_block_size <= 0 or block_size % hash_block_size:
        log.warning(
            "kvtrio: vLLM hashes blocks of %d tokens, which do not tile its blocks of %d: "
            "this engine names its chunks by token ids",
            hash_block_size, block_size,
        )  # fmt: skip
        return None
    return block_size // hash_block_size
