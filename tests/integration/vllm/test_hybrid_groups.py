"""kvtrio with vLLM's hybrid KV cache manager on (``SupportsHMA``), inside vLLM 0.33's own
scheduler and KV cache manager: every combination of attention kinds vLLM groups apart keeps the
connector on, a second engine loads what the first stored, and a hit moves of each group only
what its layers read (see :mod:`.hybrid`: every load is checked byte for byte where the layers
read it, and the null block is never written)."""

from __future__ import annotations

import functools
import random
from collections.abc import Callable
from pathlib import Path

import pytest
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import supports_hma

from kvtrio.integration.vllm import KvtrioConnector
from kvtrio.launch import ServerProcess

from ..._support.server_cache import assert_no_pins, wait_chunks
from .harness import BLOCK, make_config
from .hybrid import WINDOW, HybridEngine

CHUNK = 64
SERVER_ARGS = ("--chunk-size", str(CHUNK), "--l1-size", "64MiB", "--heartbeat-timeout", "3")
_random = random.Random(34)
PROMPT = [_random.randrange(3, 1000) for _ in range(5 * CHUNK + 10)]  # 5 whole chunks
HIT = 5 * CHUNK  # the prompt's whole blocks before its last token

PATTERNS = {
    "gpt-oss (sliding, full alternating)": "sfsf",
    "Gemma 3 (5 sliding : 1 full)": "sssssf",
    "Mistral (sliding only)": "ss",
    "Llama 4 (chunked local, full)": "cccf",
    "DeepSeek V4 style (MLA, sliding MLA)": "mw",
}


@pytest.fixture
def kvtrio(server_process: Callable[..., ServerProcess]) -> ServerProcess:
    return server_process(*SERVER_ARGS)


@pytest.fixture
def engines(
    hybrid_engines: Callable[..., HybridEngine], kvtrio: ServerProcess
) -> Callable[..., HybridEngine]:
    """``engines(pattern, **options)``: ``hybrid_engines`` on this module's server."""
    return functools.partial(hybrid_engines, kvtrio)


def test_vllm_keeps_its_hybrid_manager_for_kvtrio(model_dir: Path) -> None:
    assert supports_hma(KvtrioConnector)
    config = make_config(model_dir, "tcp://127.0.0.1:9")
    assert KVConnectorFactory.supports_hma_config(config.kv_transfer_config)


def loaded_bytes(engine: HybridEngine) -> tuple[int, int]:
    """(bytes loaded, bytes a load of every group's every block would have moved)."""
    stats = engine.connector_stats
    return (
        sum(s.get("loaded_bytes", 0) for s in stats),
        sum(s.get("hit_bytes_full", 0) for s in stats),
    )


@pytest.mark.parametrize("pattern", list(PATTERNS.values()), ids=list(PATTERNS))
def test_a_second_engine_loads_every_group_of_a_hybrid_model(
    engines: Callable[..., HybridEngine], kvtrio: ServerProcess, pattern: str
) -> None:
    first = engines(pattern)
    groups = first.kv_cache_config.kv_cache_groups
    assert first.connector.off_because is None
    assert first.worker is not None
    assert first.worker.off_because is None
    first.add("first", PROMPT)
    first.run()
    assert first.results["first"].external_cached == 0
    # each group's chunks under its own keys: a group of windowed layers as well
    wait_chunks(kvtrio, 5 * len(groups))
    second = engines(pattern)  # a restarted vLLM: nothing in its own memory
    second.add("again", PROMPT)
    second.run()
    result = second.results["again"]
    assert result.external_cached == HIT
    assert result.output == first.results["first"].output
    assert not second.failed_blocks
    moved, everything = loaded_bytes(second)
    block_bytes = groups[0].kv_cache_spec.page_size_bytes * len(groups[0].layer_names)
    blocks = 0
    for group in groups:
        window = getattr(group.kv_cache_spec, "sliding_window", None) or getattr(
            group.kv_cache_spec, "attention_chunk_size", None
        )
        if window is None:
            blocks += HIT // BLOCK
        elif hasattr(group.kv_cache_spec, "attention_chunk_size"):
            blocks += (HIT - HIT // window * window) // BLOCK or 0
        else:  # the blocks holding the last window - 1 tokens
            blocks += HIT // BLOCK - (HIT - window + 1) // BLOCK
    assert (moved, everything) == (blocks * block_bytes, len(groups) * HIT // BLOCK * block_bytes)
    print(f"\n{pattern}: a hit of {HIT} tokens moved {moved} of {everything} bytes")
    assert_no_pins(kvtrio)


def test_a_sliding_group_loads_at_most_its_window_and_one_chunk(
    engines: Callable[..., HybridEngine], kvtrio: ServerProcess
) -> None:
    """The issue's target: a hit on a sliding-window model moves at most window / prompt + one
    chunk of the sliding layers' bytes."""
    first = engines("ss")
    first.add("first", PROMPT)
    first.run()
    wait_chunks(kvtrio, 5)
    second = engines("ss")
    second.add("again", PROMPT)
    second.run()
    moved, everything = loaded_bytes(second)
    assert second.results["again"].external_cached == HIT
    assert moved / everything <= WINDOW / len(PROMPT) + CHUNK / HIT
    assert moved < everything


def test_a_windowed_group_never_stores_the_null_block(
    engines: Callable[..., HybridEngine], kvtrio: ServerProcess
) -> None:
    """A chunked prefill (steps of 48 tokens, less than a chunk): vLLM frees the sliding
    layers' blocks behind the window before their chunk is whole; those chunks are not stored
    for the sliding group, and a later hit recomputes rather than load the null block."""
    first = engines("sf", max_batched_tokens=48)
    first.add("first", PROMPT)
    first.run()
    assert first.results["first"].external_cached == 0
    second = engines("sf", max_batched_tokens=48)
    second.add("again", PROMPT)
    second.run()  # any wrong KV a load left where a layer reads fails the step
    assert second.results["again"].output == first.results["first"].output
    assert_no_pins(kvtrio)


def test_a_failed_load_of_a_hybrid_model_is_recomputed_per_request(
    engines: Callable[..., HybridEngine], kvtrio: ServerProcess
) -> None:
    """kvtrio dies between the lookup and the load. With several KV cache groups vLLM takes
    no failed blocks (vLLM 0.32 stops the engine on them): the connector loads asynchronously
    and reports the request's load failed (``failed_recving``), and vLLM recomputes it."""
    first = engines("sf")
    first.add("first", PROMPT)
    first.run()
    wait_chunks(kvtrio, 10)
    engine = engines("sf", async_load=False)
    engine.add("b", PROMPT)
    while True:
        output = engine.schedule()
        metadata = output.kv_connector_metadata
        if any(t.kind == "load" for t in getattr(metadata, "transfers", ())):
            break
        engine.execute(output)
    assert not any(t.sync for t in metadata.transfers)  # asynchronous all the same
    kvtrio.kill()
    engine.execute(output)
    engine.run()
    assert not engine.failed_blocks  # none reported per block
    assert engine.results["b"].output == first.results["first"].output
    computed = sum(s.num_scheduled_tokens.get("b", 0) for s in engine.steps)
    assert computed >= len(PROMPT) + 3  # everything was computed after all
