"""Issue 35, item 1: the connector's stores carry what vLLM's own ``BlockStored`` says of their
blocks besides hashes and tokens: ``lora_name`` and ``extra_keys`` (the LoRA name, multimodal
identifiers, the cache salt on the prompt's first block), so that the server's events key a
LoRA or salted request's blocks as vLLM's GPU events do (a router keying blocks itself, as
llm-d's does, tells them from the same tokens without adapter or salt).

Checked against vLLM's own stream: for every block the server announced, the same
``extra_keys`` and ``lora_name`` as vLLM's ``BlockStored`` of that block hash.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
from vllm.config.kv_events import KVEventsConfig
from vllm.distributed.kv_events import BlockStored, KVEventBatch

from kvtrio.launch import ServerProcess

from .harness import BLOCK, Engine, make_config

CHUNK = 64
_random = random.Random(35)
DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)
END_SEQ = (-1).to_bytes(8, "big", signed=True)


def prompt() -> list[int]:
    return [_random.randrange(3, 1000) for _ in range(3 * CHUNK + 10)]  # 3 whole chunks


@pytest.fixture
def events(short_dir: Path) -> str:
    return f"ipc://{short_dir}/ev"


@pytest.fixture
def kvtrio(server_process: Callable[..., ServerProcess], events: str) -> ServerProcess:
    return server_process("--chunk-size", str(CHUNK), "--events", events)


@pytest.fixture
def engine(
    model_dir: Path, kvtrio: ServerProcess, events: str, short_dir: Path
) -> Iterator[Engine]:
    published = KVEventsConfig(
        enable_kv_cache_events=True,
        publisher="zmq",
        endpoint=f"ipc://{short_dir}/vllm-ev",
        replay_endpoint=f"ipc://{short_dir}/vllm-replay",
    )
    config = make_config(
        model_dir, kvtrio.endpoint, prefix_caching=True, kv_events=published, events=events
    )
    engine = Engine(config, num_blocks=64)
    try:
        yield engine
    finally:
        engine.close()
        engine.scheduler.kv_event_publisher.shutdown()


def replay(endpoint: str, topic: bytes | None = None) -> list[Any]:
    """Every event a replay socket holds (vLLM's replay protocol, from a DEALER)."""
    with zmq.Context.instance().socket(zmq.DEALER) as req:
        req.setsockopt(zmq.LINGER, 0)
        req.connect(endpoint)
        req.send_multipart([b"", (0).to_bytes(8, "big"), *([topic] if topic else [])])
        got: list[Any] = []
        while req.poll(5000):
            *_, seq, payload = req.recv_multipart()
            if seq == END_SEQ:
                return got
            got += DECODER.decode(payload).events
    raise AssertionError("the replay socket did not answer")


def per_block(stored: list[Any]) -> dict[Any, tuple[Any, str | None]]:
    """Block hash → (its extra keys, its LoRA name) as the events say."""
    blocks: dict[Any, tuple[Any, str | None]] = {}
    for event in stored:
        for i, block in enumerate(event.block_hashes):
            extra = event.extra_keys[i] if event.extra_keys else None
            blocks[block] = (None if extra is None else tuple(extra), event.lora_name)
    return blocks


def test_stores_carry_the_lora_name_and_extra_keys_vllm_publishes(
    engine: Engine, kvtrio: ServerProcess, events: str, short_dir: Path
) -> None:
    engine.add("lora", prompt(), lora="adapter-a")
    engine.add("salted", prompt(), cache_salt="tenant-b")
    engine.add("plain", prompt())
    engine.run()
    per = CHUNK // BLOCK
    whole = sum(len(engine.requests[r].block_hashes) // per * per for r in engine.requests)

    def announced() -> list[Any]:
        return [e for e in replay(events + ".replay") if isinstance(e, BlockStored)]

    from ..._support.waiting import wait_for

    wait_for(
        lambda: sum(len(e.block_hashes) for e in announced()) >= whole,
        what="every chunk announced",
    )
    server = per_block(announced())
    vllm = per_block([e for e in replay(f"ipc://{short_dir}/vllm-replay")
                      if isinstance(e, BlockStored) and e.medium == "GPU"])  # fmt: skip
    assert server.keys() <= vllm.keys()
    assert {server[b] for b in server} == {vllm[b] for b in server}
    assert all(server[b] == vllm[b] for b in server), [
        (server[b], vllm[b]) for b in server if server[b] != vllm[b]
    ][:3]
    # What each request's blocks say: the adapter on every block, the salt on the first only.
    lora = [server[b] for b in server if b in _named(engine, "lora")]
    assert lora
    assert all(name == "adapter-a" and keys == ("adapter-a",) for keys, name in lora)
    salted = _named(engine, "salted")
    assert server[salted[0]] == (("tenant-b",), None)
    assert all(server[b] == (None, None) for b in salted[1:] if b in server)
    assert all(server[b] == (None, None) for b in _named(engine, "plain") if b in server)


def _named(engine: Engine, request_id: str) -> list[Any]:
    """The request's block hashes as the events name them (vLLM's default: 64-bit ints)."""
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    return [maybe_convert_block_hash(h) for h in engine.requests[request_id].block_hashes]
