"""KV events, both ways, decoded with vLLM's own classes (``msgspec`` ``KVEventBatch``):

- the kvtrio server's stream (``kvtrio serve --events``): the chunks vLLM's stores made readable,
  named by vLLM's own block hashes, live and through the replay socket as vLLM's replay
  protocol asks it (``[b"", start_seq]``);
- vLLM's own stream (its ``ZmqEventPublisher``, with ``kvtrio.events`` set): its GPU blocks and
  kvtrio's tiers, relayed by the connector through vLLM's ``take_events`` hook, with kvtrio
  alone or first in vLLM's ``MultiConnector`` (whose ``take_events`` relays each child's).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec
import pytest
import zmq
from vllm.config.kv_events import KVEventsConfig
from vllm.distributed.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from kvtrio.launch import ServerProcess

from ..._support.waiting import wait_for
from .harness import BLOCK, Engine, make_config

CHUNK = 64
PER_CHUNK = CHUNK // BLOCK
_random = random.Random(25)
PROMPT = [_random.randrange(3, 1000) for _ in range(5 * CHUNK + 10)]  # 5 whole chunks
DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)
END_SEQ = (-1).to_bytes(8, "big", signed=True)


@pytest.fixture
def events(short_dir: Path) -> str:
    return f"ipc://{short_dir}/ev"


@pytest.fixture
def kvtrio(server_process: Callable[..., ServerProcess], events: str) -> ServerProcess:
    return server_process("--chunk-size", str(CHUNK), "--events", events)


TOPIC = b"kvtrio//"  # tenant ""


@pytest.fixture
def subscriber(kvtrio: ServerProcess, events: str) -> Iterator[zmq.Socket[bytes]]:
    """A SUB socket on the server's stream, subscribed before any engine connects: the
    server's first message on a new stream is AllBlocksCleared at seq 0 (which also tells that
    the subscription is in place)."""
    with zmq.Context.instance().socket(zmq.SUB) as sub:
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, TOPIC)
        sub.connect(events)
        assert sub.poll(5000)
        first_topic, seq, payload = sub.recv_multipart()
        assert (first_topic, int.from_bytes(seq, "big")) == (TOPIC, 0)
        assert DECODER.decode(payload).events == [AllBlocksCleared()]
        yield sub


@pytest.fixture(params=[False, True], ids=["alone", "in-MultiConnector"])
def engine(
    request: pytest.FixtureRequest,
    model_dir: Path,
    kvtrio: ServerProcess,
    events: str,
    short_dir: Path,
    tmp_path: Path,
    subscriber: zmq.Socket[bytes],
) -> Iterator[Engine]:
    """A scheduler publishing vLLM's own KV events, with kvtrio alone or first in vLLM's
    ``MultiConnector`` beside ``ExampleConnector`` (issue 35 item 5: its ``take_events``
    relays each connector's, so kvtrio's tiers reach vLLM's stream either way)."""
    beside = None
    if request.param:
        beside = {
            "kv_connector": "ExampleConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": str(tmp_path / "example")},
        }
    published = KVEventsConfig(
        enable_kv_cache_events=True,
        publisher="zmq",
        endpoint=f"ipc://{short_dir}/vllm-ev",
        replay_endpoint=f"ipc://{short_dir}/vllm-replay",
    )
    engine = Engine(
        make_config(
            model_dir,
            kvtrio.endpoint,
            prefix_caching=True,
            kv_events=published,
            events=events,
            beside=beside,
        ),
        num_blocks=64,
    )
    try:
        yield engine
    finally:
        engine.close()
        engine.scheduler.kv_event_publisher.shutdown()


def replay(endpoint: str, topic: bytes | None = None) -> list[tuple[bytes, int, KVEventBatch]]:
    """Everything a replay socket holds, asked as vLLM's replay protocol has it: ``[b"",
    start_seq]`` from a DEALER (the answer is many messages, which a REQ socket cannot take)."""
    with zmq.Context.instance().socket(zmq.DEALER) as req:
        req.setsockopt(zmq.LINGER, 0)
        req.connect(endpoint)
        req.send_multipart([b"", (0).to_bytes(8, "big"), *([topic] if topic else [])])
        got = []
        while req.poll(5000):
            frames = req.recv_multipart()
            got_topic, seq, payload = frames[-3:]
            if seq == END_SEQ:
                return got
            got.append((got_topic, int.from_bytes(seq, "big"), DECODER.decode(payload)))
    raise AssertionError("the replay socket did not answer")


def events_of(batches: list[tuple[bytes, int, KVEventBatch]]) -> list[object]:
    return [event for _, _, batch in batches for event in batch.events]


def test_both_streams_decode_with_vllms_classes(
    engine: Engine, subscriber: zmq.Socket[bytes], events: str
) -> None:
    sub, topic = subscriber, TOPIC
    multi = engine.config.kv_transfer_config.kv_connector == "MultiConnector"
    assert type(engine.scheduler.connector).__name__ == (
        "MultiConnector" if multi else "KvtrioConnector"
    )
    if True:
        engine.add("first", PROMPT)
        engine.run()
        request = engine.requests["first"]
        named = [maybe_convert_block_hash(h) for h in request.block_hashes]
        assert isinstance(named[0], int)  # vLLM's default: 64-bit ints

        stored: list[BlockStored] = []
        while len(stored) < 5:
            assert sub.poll(5000), f"only {len(stored)} chunks announced"
            got_topic, _, payload = sub.recv_multipart()
            assert got_topic == topic
            stored += [e for e in DECODER.decode(payload).events if isinstance(e, BlockStored)]

    # Each chunk once, readable in kvtrio's L1 (CPU), named by vLLM's own block hashes, with
    # its tokens (issue 35: a router that keys blocks itself, as llm-d's, needs them).
    tokens = list(request.prompt_token_ids)
    span = PER_CHUNK * BLOCK
    for i, event in enumerate(stored):
        assert event.medium == "CPU"
        assert event.locality == "LOCAL"
        assert event.token_ids == tokens[i * span : (i + 1) * span]
        assert event.block_size == BLOCK
        assert event.block_hashes == named[i * PER_CHUNK : (i + 1) * PER_CHUNK]
        assert event.parent_block_hash == (named[i * PER_CHUNK - 1] if i else None)

    # The replay socket, asked as vLLM's consumers ask: the same batches, in order.
    replayed = replay(events + ".replay")
    assert [s for _, s, _ in replayed] == list(range(len(replayed)))
    assert [e for e in events_of(replayed) if isinstance(e, BlockStored)] == stored

    # vLLM's own stream: its GPU blocks, and kvtrio's L1 through the connector's take_events.
    def relayed() -> list[BlockStored]:
        engine.step()  # (vLLM publishes what take_events returns at each step)
        return [
            e
            for e in events_of(replay(f"ipc://{engine_dir(engine)}/vllm-replay"))
            if isinstance(e, BlockStored) and e.medium == "CPU"
        ]

    relayed_events = wait_for(lambda: len(relayed()) >= 5 and relayed(), what="relayed events")
    assert [e.block_hashes for e in relayed_events] == [e.block_hashes for e in stored]
    gpu = [e for e in events_of(replay(f"ipc://{engine_dir(engine)}/vllm-replay"))
           if isinstance(e, BlockStored) and e.medium == "GPU"]  # fmt: skip
    assert [h for e in gpu for h in e.block_hashes][: len(named)] == named
    assert not any(
        isinstance(e, BlockRemoved)
        for e in events_of(replay(f"ipc://{engine_dir(engine)}/vllm-replay"))
        if getattr(e, "medium", None) == "CPU"
    )


def engine_dir(engine: Engine) -> str:
    endpoint = engine.config.kv_events_config.replay_endpoint
    assert endpoint is not None
    return endpoint[len("ipc://") :].rsplit("/", 1)[0]
