"""Which of vLLM's KV cache configurations kvtrio can keep, read from its ``KVCacheConfig``.

vLLM splits a model's layers into KV cache groups, each with a spec saying how its blocks are
allocated. kvtrio keeps every layer of a request's blocks under keys of the prompt's tokens, so
it needs every block of the prompt to hold that prompt's KV for as long as it copies: one group
whose blocks are allocated for every token (full attention, MLA, full attention with sinks),
every layer with the same KV shape (kvtrio's layouts describe one shape for all layers).

kvtrio does not declare vLLM's ``SupportsHMA``, so vLLM turns its hybrid KV cache manager off
for it, and a sliding-window + full-attention model comes to kvtrio as one full-attention group
(sliding layers keep every token's KV; their compute still uses the window): kvtrio keeps it.
What stays is refused here: a model whose every attention layer is windowed (vLLM frees its
blocks outside the window, and allocates the null block for those of a hit), chunked local
attention, R-SWA (gap blocks evicted during decode), several groups (state-space layers
cannot run without the hybrid manager anyway), layers of different KV shapes (vLLM's
``UniformTypeKVCacheSpecs``), no KV cache at all. The connector then stays off for that
engine, which runs as without it (see :mod:`kvtrio.integration.vllm`).

No vLLM import: specs are told apart by their class names (exactly: R-SWA and hidden-state
specs subclass vLLM's full-attention spec but are not kept).
"""

from __future__ import annotations

from typing import Any

__all__ = ["KEPT_SPECS", "unsupported_kv_cache"]

KEPT_SPECS = ("FullAttentionSpec", "MLAAttentionSpec", "SinkFullAttentionSpec")
"""vLLM KV cache specs (by class name) whose blocks hold every token of a request."""


def _describe(groups: list[Any]) -> str:
    return ", ".join(
        f"{type(group.kv_cache_spec).__name__} for {len(group.layer_names)} layer(s)"
        for group in groups
    )


def unsupported_kv_cache(kv_cache_config: Any) -> str | None:
    """Why kvtrio cannot keep the KV cache vLLM configured (``kv_cache_config``, vLLM's
    ``KVCacheConfig``), as a phrase for a log line; ``None`` when it can (or when vLLM gave
    no configuration, as versions before the connector API's third argument did)."""
    if kv_cache_config is None:
        return None
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or ())
    if not groups:
        return "the model has no KV cache (attention-free)"
    if len(groups) > 1:
        return (
            f"the model has {len(groups)} KV cache groups ({_describe(groups)}) and kvtrio "
            "keeps a single one"
        )
    spec_name = type(groups[0].kv_cache_spec).__name__
    if spec_name == "UniformTypeKVCacheSpecs":
        return (
            "the model's layers have KV caches of different shapes (vLLM's "
            "UniformTypeKVCacheSpecs) and kvtrio's layouts describe one shape for all layers"
        )
    if spec_name not in KEPT_SPECS:
        return (
            f"its KV cache group is {spec_name} for {len(groups[0].layer_names)} layer(s), "
            "whose blocks do not hold every token of a request (kvtrio keeps "
            f"{', '.join(KEPT_SPECS)})"
        )
    return None
