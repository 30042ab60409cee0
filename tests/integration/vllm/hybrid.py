""":class:`HybridEngine`: the harness's :class:`~.harness.Engine` with vLLM's hybrid KV cache
manager on, for a model whose layers mix attention kinds (``pattern``: one letter per layer,
``f`` full attention, ``s`` sliding window, ``c`` chunked local attention, ``m`` MLA,
``w`` sliding-window MLA, ``M`` Mamba in vLLM's ``align`` cache mode).

vLLM 0.33's own ``get_kv_cache_groups`` makes the KV cache groups (one per kind and group of
layers, all of one size) from the layers' specs; the KV tensors are shared as vLLM shares them:
tensor ``i`` holds the ``i``-th layer of every group, a block belongs to one group at a time.
The stand-in model's forward writes each layer's KV into its group's blocks, and checks of each
layer only what that layer reads (vLLM's ``get_num_skipped_tokens`` of the layer's group: the
window, or the attention chunk): a load that wrote the wrong bytes there, or the null block's,
fails the step. A Mamba layer's "state" fills a whole block, a function of every token before
it: a step reads it from the block holding the state at its start and writes the state at its
end into the block vLLM gives that position (as vLLM's ``align`` mode does); a state loaded
wrong fails the step.

vLLM's platform in this environment (no compiled kernels) says it cannot run the hybrid
manager; a real CPU or GPU engine can: the harness turns it on the way vLLM does for those.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.config import VllmConfig
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
)

try:  # vLLM 0.33
    from vllm.v1.core.kv_cache_planning import get_kv_cache_groups
except ImportError:  # vLLM 0.32
    from vllm.v1.core.kv_cache_utils import get_kv_cache_groups

from .harness import BLOCK, DTYPE, HEAD_DIM, HEADS, Engine, expected_kv, request_marks

WINDOW = 64
"""Tokens of the sliding window and of the local attention chunk."""


def spec(kind: str) -> KVCacheSpec:
    """The KV cache spec of a layer of kind ``kind`` (see the module docstring)."""
    common: dict[str, Any] = {
        "block_size": BLOCK,
        "num_kv_heads": HEADS,
        "head_size": HEAD_DIM,
        "dtype": DTYPE,
    }
    if kind == "f":
        return FullAttentionSpec(**common)
    if kind == "s":
        return SlidingWindowSpec(**common, sliding_window=WINDOW)
    if kind == "c":
        return ChunkedLocalAttentionSpec(**common, attention_chunk_size=WINDOW)
    if kind == "m":
        return MLAAttentionSpec(**common)
    if kind == "w":
        return SlidingWindowMLASpec(**common, sliding_window=WINDOW)
    if kind == "M":  # a state of half a page, padded to an attention layer's page
        page = FullAttentionSpec(**common).page_size_bytes
        return MambaSpec(
            block_size=BLOCK,
            shapes=((HEADS * BLOCK * HEAD_DIM,),),
            dtypes=(DTYPE,),
            page_size_padded=page,
            mamba_cache_mode="align",
        )
    raise ValueError(kind)


def expected_state(tokens: list[int], layer: int) -> torch.Tensor:
    """The stand-in Mamba layer's state after ``tokens``: a block's worth of values that
    depend on every token, their order and the layer."""
    digest = 0
    for token in tokens:
        digest = (digest * 131 + token) % 1_000_003
    base = (digest + len(tokens) * 17 + layer * 101) % 4093
    values = torch.arange(HEADS * BLOCK * 2 * HEAD_DIM, dtype=torch.int64) + base
    return (values % 251).to(DTYPE).view(HEADS, BLOCK, 2 * HEAD_DIM)


def hybrid_kv_cache_config(
    config: VllmConfig, pattern: str, num_blocks: int
) -> tuple[KVCacheConfig, list[str]]:
    """vLLM's KV cache config for layers of ``pattern`` with its hybrid manager on, and the
    layers' names."""
    config.scheduler_config.disable_hybrid_kv_cache_manager = False
    if "M" in pattern:
        config.cache_config.mamba_cache_mode = "align"
    if config.cache_config.kv_cache_layout is None:  # (what vLLM's engine core resolves)
        config.cache_config.kv_cache_layout = "NHD"
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(len(pattern))]
    groups = get_kv_cache_groups(config, {n: spec(k) for n, k in zip(layers, pattern, strict=True)})
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups), layers


class HybridEngine(Engine):
    """vLLM's scheduler with its hybrid KV cache manager on (see the module docstring)."""

    def __init__(self, config: VllmConfig, pattern: str, *, num_blocks: int = 128) -> None:
        self.pattern = pattern
        self.kv_cache_config, self.layers = hybrid_kv_cache_config(config, pattern, num_blocks)
        groups = self.kv_cache_config.kv_cache_groups
        slots = max(len(g.layer_names) for g in groups)
        shared = [
            torch.zeros(num_blocks, HEADS, BLOCK, 2 * HEAD_DIM, dtype=DTYPE) for _ in range(slots)
        ]
        # (vLLM hands a Mamba layer its state tensors as a list, views of the shared tensor)
        self.shared_kv = {
            name: [shared[i]] if isinstance(group.kv_cache_spec, MambaSpec) else shared[i]
            for group in groups
            for i, name in enumerate(group.layer_names)
        }
        super().__init__(config, num_blocks=num_blocks)

    def _kv_cache_config(self, num_blocks: int) -> KVCacheConfig:
        return self.kv_cache_config

    def _kv_tensors(self, num_blocks: int) -> dict[str, torch.Tensor]:
        return self.shared_kv

    def group_of(self, group: int) -> Any:
        return self.scheduler.kv_cache_manager.coordinator.single_type_managers[group]

    def read_layer(self, block_ids: list[int], start: int, end: int, layer: str) -> torch.Tensor:
        """The KV of positions ``[start, end)`` of layer ``layer`` (``[n, heads, 2, dim]``)."""
        return _read(self.kv[layer], block_ids, start, end)

    def _forward(self, output: SchedulerOutput) -> tuple[dict[str, list[int]], dict[str, set[int]]]:
        """Per group: check what its layers read of the request's computed tokens, write the
        KV of the tokens computed now; then sample as the harness does."""
        sampled: dict[str, list[int]] = {}
        bad: dict[str, set[int]] = {}
        groups = self.kv_cache_config.kv_cache_groups
        for request_id, num_new in output.num_scheduled_tokens.items():
            request = self.scheduler.requests[request_id]
            all_ids = self.scheduler.kv_cache_manager.get_block_ids(request_id)
            end = request.num_computed_tokens
            start = end - num_new
            tokens = list(request.all_token_ids)
            marks = request_marks(request, end)
            for index, group in enumerate(groups):
                block_ids = list(all_ids[index])
                if isinstance(group.kv_cache_spec, MambaSpec):
                    for name in group.layer_names:
                        wrong = self._step_state(name, block_ids, tokens, start, end)
                        if wrong is not None:
                            bad.setdefault(request_id, set()).add(wrong)
                    continue
                first = self.group_of(index).get_num_skipped_tokens(start)
                for name in group.layer_names:
                    layer = self.layers.index(name)
                    have = self.read_layer(block_ids, first, start, name)
                    want = expected_kv(tokens[first:start], first, layer, marks[first:start])
                    wrong = (have != want).flatten(1).any(1).nonzero().flatten().tolist()
                    if wrong:
                        bad.setdefault(request_id, set()).update(
                            block_ids[(first + p) // BLOCK] for p in wrong
                        )
                    _write(
                        self.kv[name], block_ids, tokens[start:end], start, layer, marks[start:end]
                    )
            done_prefill = end >= request.num_tokens
            sampled[request_id] = [100 + sum(tokens[-3:]) % 800] if done_prefill else []
        return sampled, bad

    def _step_state(
        self, name: str, block_ids: list[int], tokens: list[int], start: int, end: int
    ) -> int | None:
        """A Mamba layer's step ``[start, end)``: check the state it starts from, write the
        one it ends with; the block of a wrong state, if it was."""
        layer = self.layers.index(name)
        cache = self.kv[name][0]
        wrong = None
        if start > 0:
            source = block_ids[-(-start // BLOCK) - 1]
            assert source != 0, "a Mamba step starts from the null block"
            if not torch.equal(cache[source], expected_state(tokens[:start], layer)):
                wrong = source
        target = block_ids[-(-end // BLOCK) - 1]
        assert target != 0, "a Mamba step writes into the null block"
        cache[target] = expected_state(tokens[:end], layer)
        return wrong


def _views(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    blocks, heads, size, _ = cache.shape
    key = cache.view(blocks, heads, 2, HEAD_DIM, size)[:, :, 0]
    value = cache.view(blocks, heads, 2, size, HEAD_DIM)[:, :, 1]
    return key, value


def _read(cache: torch.Tensor, block_ids: list[int], start: int, end: int) -> torch.Tensor:
    key, value = _views(cache)
    positions = torch.arange(start, end)
    blocks = torch.tensor(block_ids, dtype=torch.int64)[positions // BLOCK]
    offsets = positions % BLOCK
    return torch.stack([key[blocks, :, :, offsets], value[blocks, :, offsets]], dim=2)


def _write(
    cache: torch.Tensor,
    block_ids: list[int],
    tokens: list[int],
    start: int,
    layer: int,
    marks: torch.Tensor,
) -> None:
    key, value = _views(cache)
    positions = torch.arange(start, start + len(tokens))
    blocks = torch.tensor(block_ids, dtype=torch.int64)[positions // BLOCK]
    assert not (blocks == 0).any(), "the forward writes into the null block"
    offsets = positions % BLOCK
    kv = expected_kv(tokens, start, layer, marks)
    key[blocks, :, :, offsets] = kv[:, :, 0]
    value[blocks, :, offsets] = kv[:, :, 1]
