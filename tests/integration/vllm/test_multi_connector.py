"""Issue 35, item 5: kvtrio inside vLLM's ``MultiConnector`` (vLLM 0.33's real scheduler and
the connectors' worker sides in this process, ``harness.Engine``), first of two with vLLM's
``ExampleConnector`` beside it: the hits, the loads, the stores, ``kv_transfer_params``, the
events and ``request_finished`` are what kvtrio alone gives.

``ExampleConnector`` saves from the model's attention layers, which the harness's forward does
not run: it never has a hit here, so what the engine loads is kvtrio's, as in a P/D pair where
the other connector (``NixlConnector``) has nothing for a request.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvtrio.launch import ServerProcess

from ..._support.server_cache import assert_no_pins, cache, wait_chunks
from ..._support.waiting import wait_for
from .harness import Engine, make_config

CHUNK = 64
_random = random.Random(35)
PROMPT = [_random.randrange(3, 1000) for _ in range(5 * CHUNK + 10)]  # 5 whole chunks


@pytest.fixture
def kvtrio(server_process: Callable[..., ServerProcess], short_dir: Path) -> ServerProcess:
    return server_process(
        "--chunk-size", str(CHUNK), "--l1-size", "64MiB", "--heartbeat-timeout", "3",
        "--events", f"ipc://{short_dir}/kv-events",
    )  # fmt: skip


@pytest.fixture
def engines(
    model_dir: Path, kvtrio: ServerProcess, tmp_path: Path
) -> Iterator[Callable[..., Engine]]:
    """``engines(multi)``: a new scheduler with kvtrio alone, or first in a MultiConnector."""
    made: list[Engine] = []

    def make(multi: bool, **options: Any) -> Engine:
        for engine in made:
            engine.close()
        beside = {
            "kv_connector": "ExampleConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": str(tmp_path / "example")},
        }
        engine = Engine(
            make_config(model_dir, kvtrio.endpoint, beside=beside if multi else None, **options)
        )
        made.append(engine)
        wait_for(lambda: cache(kvtrio).registrations >= 1, what="the worker to register")
        return engine

    yield make
    for engine in made:
        engine.close()


def run(engine: Engine, name: str, prompt: list[int], **params: Any) -> tuple[int, int]:
    engine.add(name, prompt, **params)
    engine.run()
    result = engine.results[name]
    assert result.external_cached is not None
    assert not engine.failed_blocks, f"{name}: loads failed: {engine.load_failures()}"
    return result.external_cached, len(result.output)


@pytest.mark.parametrize("multi", [False, True], ids=["alone", "in-MultiConnector"])
def test_hits_loads_stores_and_finishes_as_alone(
    engines: Callable[..., Engine], kvtrio: ServerProcess, multi: bool
) -> None:
    engine = engines(multi)
    if multi:
        assert type(engine.scheduler.connector).__name__ == "MultiConnector"
    assert run(engine, "first", PROMPT) == (0, 4)  # a miss: computed, then stored
    wait_chunks(kvtrio, 5)
    engine = engines(multi)  # a restarted engine: its own cache is empty
    assert run(engine, "again", PROMPT) == (5 * CHUNK, 4)  # loaded from kvtrio
    assert run(engine, "part", PROMPT[: 2 * CHUNK + 5]) == (2 * CHUNK, 4)
    # kv_transfer_params reach kvtrio through the MultiConnector (kvtrio.save = false: the
    # request's new chunks are not stored).
    other = [_random.randrange(3, 1000) for _ in range(2 * CHUNK + 3)]
    assert run(engine, "nosave", other, **{"kvtrio.save": False}) == (0, 4)
    assert cache(kvtrio).l1_ready == 5
    # request_finished: every request's pins and blocks released, none held by vLLM.
    assert all(not engine.held(r) for r in ("first", "again", "part", "nosave"))
    assert_no_pins(kvtrio)


@pytest.mark.parametrize("multi", [False, True], ids=["alone", "in-MultiConnector"])
def test_kvtrios_events_are_relayed_through_the_multiconnector(
    engines: Callable[..., Engine], kvtrio: ServerProcess, short_dir: Path, multi: bool
) -> None:
    """``MultiConnector.take_events`` yields each connector's events in turn: kvtrio's (its
    tiers, ``kvtrio.events``) reach vLLM's scheduler, which takes them at every step, as they
    do with kvtrio alone: each chunk stored in kvtrio's L1 with its tokens."""
    from vllm.distributed.kv_events import BlockStored

    engine = engines(multi, events=f"ipc://{short_dir}/kv-events")
    connector = engine.scheduler.connector
    assert (type(connector).__name__ == "MultiConnector") == multi
    taken: list[object] = []
    take = connector.take_events

    def recorded() -> list[object]:  # (what vLLM's scheduler is given at each step)
        events = list(take())
        taken.extend(events)
        return events

    connector.take_events = recorded  # type: ignore[method-assign]
    assert run(engine, "first", PROMPT) == (0, 4)
    wait_chunks(kvtrio, 5)

    def stored() -> list[BlockStored]:
        recorded()
        return [e for e in taken if isinstance(e, BlockStored) and e.medium == "CPU"]

    relayed = wait_for(lambda: len(stored()) >= 5 and stored(), what="kvtrio's events")
    tokens = list(engine.requests["first"].prompt_token_ids)
    assert [e.token_ids for e in relayed] == [tokens[i * CHUNK : (i + 1) * CHUNK] for i in range(5)]
