"""vLLM's KV cache groups as kvtrio keeps them, read from its ``KVCacheConfig``.

vLLM splits a model's layers into KV cache groups, each with a spec saying how its blocks are
allocated. kvtrio declares vLLM's ``SupportsHMA``, so with vLLM's hybrid KV cache manager on a
hybrid model comes as one group per attention kind, every group of the same size, the groups'
layers sharing the KV tensors (tensor ``i`` holds layer ``i`` of every group, a block belongs
to one group at a time). kvtrio keeps each group under its own chunk keys
(:func:`group_block_hashes`), so groups never share bytes, and a hit needs of each group only
what its layers read (:meth:`KvGroup.first_needed`):

* full attention (``FullAttentionSpec``, ``MLAAttentionSpec``, ``SinkFullAttentionSpec``):
  every token before the hit's end;
* sliding window (``SlidingWindowSpec``, ``SlidingWindowMLASpec``): the last ``window - 1``
  tokens; vLLM gives the blocks before them the null block (id 0);
* chunked local attention (``ChunkedLocalAttentionSpec``): the tokens of the hit's last
  attention chunk;
* Mamba (``MambaSpec``): its state at the hit's end, one block. vLLM keeps states at block
  boundaries only in its ``align`` cache mode (its prefix caching of Mamba hybrids): there
  kvtrio keeps the state at the end of a chunk it stores when vLLM has it (``KvGroup.aligned``);
  in other modes the engine stays on (vLLM keeps its hybrid manager) but every lookup misses.

Refused (the connector stays off for that engine, which runs as without it): R-SWA (gap
blocks evicted during decode), layers of different KV shapes without the hybrid manager
(vLLM's ``UniformTypeKVCacheSpecs``), groups whose blocks hold different numbers of tokens
(vLLM gives a group of smaller pages larger blocks), encoder-only and cross attention, no KV
cache at all.

No vLLM import: specs are told apart by their class names (exactly: R-SWA and hidden-state
specs subclass vLLM's full-attention spec but are not kept).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any, Literal

import attrs

__all__ = [
    "KEPT_SPECS",
    "KvGroup",
    "group_block_hashes",
    "kv_groups",
    "unsupported_kv_cache",
]

Kind = Literal["full", "window", "chunked", "mamba"]

_KINDS: dict[str, Kind] = {
    "FullAttentionSpec": "full",
    "MLAAttentionSpec": "full",
    "SinkFullAttentionSpec": "full",
    "SlidingWindowSpec": "window",
    "SlidingWindowMLASpec": "window",
    "ChunkedLocalAttentionSpec": "chunked",
    "MambaSpec": "mamba",
}

KEPT_SPECS = tuple(_KINDS)
"""vLLM KV cache specs (by class name) whose groups keep the connector on."""

_GROUP_PREFIX = b"kvtrio/group/v1"


@attrs.frozen
class KvGroup:
    """One of vLLM's KV cache groups, as the connector sees it."""

    index: int
    kind: Kind
    spec_kind: str
    """vLLM's name of the spec's kind (``KVCacheSpecKind``: ``full_attention``,
    ``sliding_window``, …), as its KV events carry it."""
    layers: int
    window: int = 0
    """Sliding window (tokens) or attention chunk (tokens) of ``window``/``chunked`` groups."""
    block_bytes: int = 0
    """Bytes of one block of the group, all its layers (what a load of a block moves)."""
    aligned: bool = False
    """A Mamba group in vLLM's ``align`` cache mode: its blocks hold the state at their ends."""

    def first_needed(self, end: int) -> int:
        """The first token this group's layers read to compute the token at ``end``: what a
        hit ending at ``end`` must load of this group (vLLM's ``get_num_skipped_tokens``)."""
        if self.kind == "window":
            return max(0, end - self.window + 1)
        if self.kind == "chunked":
            return end // self.window * self.window
        if self.kind == "mamba":
            return end - 1  # (its state at the end: the one block holding it)
        return 0


def _spec_kind(kind: Kind, spec_name: str) -> str:
    if spec_name == "MLAAttentionSpec":
        return "mla_attention"
    if spec_name == "SlidingWindowMLASpec":
        return "sliding_window_mla"
    if spec_name == "SinkFullAttentionSpec":
        return "sink_full_attention"
    return {"full": "full_attention", "window": "sliding_window", "mamba": "mamba"}.get(
        kind, "chunked_local_attention"
    )


def kv_groups(kv_cache_config: Any) -> tuple[KvGroup, ...]:
    """The groups of vLLM's ``KVCacheConfig`` (``()`` when vLLM gave none, or one it cannot
    keep: see :func:`unsupported_kv_cache`)."""
    groups = []
    for index, group in enumerate(getattr(kv_cache_config, "kv_cache_groups", None) or ()):
        spec = group.kv_cache_spec
        name = type(spec).__name__
        kind = _KINDS.get(name)
        if kind is None:
            return ()
        window = 0
        if kind == "window":
            window = int(spec.sliding_window)
        elif kind == "chunked":
            window = int(spec.attention_chunk_size)
        page = int(getattr(spec, "page_size_bytes", 0) or 0)
        groups.append(
            KvGroup(
                index,
                kind,
                _spec_kind(kind, name),
                len(group.layer_names),
                window,
                page * len(group.layer_names),
                kind == "mamba" and _aligned(spec),
            )
        )
    return tuple(groups)


def _aligned(spec: Any) -> bool:
    """A Mamba spec in vLLM's ``align`` cache mode (its blocks hold the state at their ends)."""
    return getattr(spec, "mamba_cache_mode", "none") == "align"


def group_block_hashes(hashes: Sequence[bytes], group: int) -> tuple[bytes, ...]:
    """A group's block hashes for kvtrio's keys, from the engine's (one per block): vLLM hashes
    a block's tokens alike for every group, and kvtrio keeps each group's bytes apart, so each
    group's keys are its own (``SHA-256(prefix ‖ group ‖ hash)[:16]``; still prefix-chained,
    since the engine's hashes are)."""
    tag = _GROUP_PREFIX + group.to_bytes(2, "little")
    sha256 = hashlib.sha256
    return tuple(
        sha256(
            tag + (h if isinstance(h, bytes) else int(h).to_bytes(16, "little", signed=True))
        ).digest()[:16]
        for h in hashes
    )


def token_block_hashes(tokens: Sequence[int], block_size: int) -> tuple[bytes, ...]:
    """Prefix-chained hashes of the prompt's whole blocks from its token ids (token mode of an
    engine with several groups: its groups' keys are derived from these)."""
    from array import array

    data = memoryview(array("I", tokens[: len(tokens) - len(tokens) % block_size]))
    previous = hashlib.sha256(b"kvtrio/group-tokens/v1").digest()[:16]
    hashes = []
    for start in range(0, len(data), block_size):
        digest = hashlib.sha256(previous)
        digest.update(data[start : start + block_size])
        previous = digest.digest()[:16]
        hashes.append(previous)
    return tuple(hashes)


def _describe(groups: list[Any]) -> str:
    return ", ".join(
        f"{type(group.kv_cache_spec).__name__} for {len(group.layer_names)} layer(s)"
        for group in groups
    )


def unsupported_kv_cache(kv_cache_config: Any, block_size: int | None = None) -> str | None:
    """Why kvtrio cannot keep the KV cache vLLM configured (``kv_cache_config``, vLLM's
    ``KVCacheConfig``; ``block_size``, its ``cache_config.block_size``, if known), as a phrase
    for a log line; ``None`` when it can (or when vLLM gave no configuration, as versions
    before the connector API's third argument did)."""
    if kv_cache_config is None:
        return None
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or ())
    if not groups:
        return "the model has no KV cache (attention-free)"
    for group in groups:
        spec_name = type(group.kv_cache_spec).__name__
        if spec_name == "UniformTypeKVCacheSpecs":
            return (
                "the model's layers have KV caches of different shapes (vLLM's "
                "UniformTypeKVCacheSpecs) and kvtrio's layouts describe one shape for all layers"
            )
        if spec_name not in _KINDS:
            return (
                f"its KV cache groups are {_describe(groups)}; kvtrio keeps {', '.join(KEPT_SPECS)}"
            )
    if all(_KINDS[type(g.kv_cache_spec).__name__] == "mamba" for g in groups):
        return "the model has only Mamba state, which kvtrio does not keep"
    # (a Mamba group outside ``align`` mode, of blocks of ``max_model_len`` tokens, is never
    # moved: its block size does not matter)
    moved = [
        g
        for g in groups
        if _KINDS[type(g.kv_cache_spec).__name__] != "mamba" or _aligned(g.kv_cache_spec)
    ]
    sizes = {int(g.kv_cache_spec.block_size) for g in moved}
    if block_size is not None:
        sizes.add(block_size)
    if len(sizes) > 1:
        held = ", ".join(
            f"{type(g.kv_cache_spec).__name__} {g.kv_cache_spec.block_size}" for g in moved
        )
        if block_size is not None:
            held += f"; cache_config.block_size {block_size}"
        return (
            f"its KV cache groups' blocks hold different numbers of tokens ({held}) and "
            "kvtrio moves every group's blocks as blocks of one size"
        )
    return None
