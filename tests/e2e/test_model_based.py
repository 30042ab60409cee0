"""A model-based test of integrity: a seeded random driver against a real server process (small
L1 that evicts, a disk L2) and real worker processes of several engines.

Engines ``e0`` and ``e1`` share the model and tenant, ``e2`` has another tenant. Prompts are
made of chunks drawn from a small alphabet, so they share prefixes; request ids come from a
pool of three, so they collide within and across engines. Steps: lookups followed by a retrieve
or an abort, stores, ``end_session``, server restarts (the L2 on disk survives them) and a
worker killed in the middle of a store. The KV of every block is derived from its prompt's
tokens (``engine_worker.py compute``), so the oracle knows the right bytes.

Invariants, after every step:

* every retrieved block holds the KV of its own prompt (blocks reported failed excepted);
* a hit never exceeds the longest prefix any engine of that model and tenant stored (whole
  chunks, then the prompt's partial chunk: its whole blocks after them);

and at quiescence (every ``QUIESCE`` steps and at the end): no pins and no leases are left.

``KVTRIO_STATEFUL_STEPS`` (default 300) sets the number of steps (5000 for the long profile),
``KVTRIO_STATEFUL_SEED`` the seed (default 10), ``KVTRIO_STATEFUL_EVICTION`` the server's
eviction policy (default: the server's).
"""

from __future__ import annotations

import os
import random
import time
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvtrio.client import SchedulerAdapter
from kvtrio.launch import ServerProcess

from .._support.e2e import Worker, cache
from .._support.waiting import wait_for
from .engine_worker import engine_kwargs

CHUNK, BLOCK = 64, 16
PER_CHUNK = CHUNK // BLOCK
MAX_CHUNKS = 5
SOURCE = list(range(MAX_CHUNKS * PER_CHUNK + PER_CHUNK))  # blocks a prompt is stored from
TARGET = list(range(255, 255 - len(SOURCE), -1))  # other blocks, reversed, to retrieve into
ENGINES = (("e0", ""), ("e1", ""), ("e2", "t2"))
REQUEST_IDS = ("r0", "r1", "r2")
STEPS = int(os.environ.get("KVTRIO_STATEFUL_STEPS", "300"))
SEED = int(os.environ.get("KVTRIO_STATEFUL_SEED", "10"))
EVICTION = os.environ.get("KVTRIO_STATEFUL_EVICTION", "")
QUIESCE = 50

Prompt = tuple[int, ...]  # chunk values; the tokens follow from them


def tokens_of(prompt: Prompt, tail: int) -> list[int]:
    """Chunk ``i`` of value ``v`` is tokens ``v * 10_000 + i * CHUNK + j``; ``tail`` more tokens
    make a partial chunk (its whole blocks are cached)."""
    tokens = [v * 10_000 + i * CHUNK + j for i, v in enumerate(prompt) for j in range(CHUNK)]
    return tokens + [7] * tail


def lookup(adapter: SchedulerAdapter, request: str, tokens: list[int]) -> int:
    adapter.maybe_submit_lookup_request(request, token_ids=tokens)
    hits = adapter.check_lookup_result(request, wait=10.0)
    adapter.cleanup_lookup_result(request)
    assert hits is not None, "the lookup did not finish"
    return hits


class Engine:
    """One engine: a worker process and a scheduler adapter sharing an engine id."""

    def __init__(self, server: ServerProcess, engine_id: str, tenant: str) -> None:
        self.server, self.id, self.tenant = server, engine_id, tenant
        self.worker = self._start_worker()
        self.scheduler = SchedulerAdapter(
            server.endpoint,
            "m",
            1,
            0,
            BLOCK,
            tenant=tenant,
            timeout=3.0,
            **engine_kwargs(engine_id),
        )

    def _start_worker(self) -> Worker:
        flags = ("--engine", self.id, "--tenant", self.tenant)
        return Worker(self.server.endpoint, "m", 1, 0, "flash_attn", flags)

    def replace_worker(self) -> None:
        self.worker.proc.kill()
        self.worker.close()
        self.worker = self._start_worker()

    def close(self) -> None:
        self.worker.close()
        self.scheduler.close()


class Driver:
    def __init__(self, server: ServerProcess, rng: random.Random) -> None:
        self.server, self.rng = server, rng
        self.engines = [Engine(server, e, t) for e, t in ENGINES]
        self.stored: dict[str, set[Prompt]] = {t: {()} for _, t in ENGINES}
        self.tails: dict[str, set[tuple[Prompt, int]]] = {t: set() for _, t in ENGINES}
        """Partial chunks stored: the prompt's full chunks and the tail's whole blocks."""
        self.history: deque[str] = deque(maxlen=25)
        self.counts: dict[str, int] = {}
        self.seconds: dict[str, float] = {}
        self.hit_chunks = 0
        self.checked_blocks = 0
        self.wait_ready()

    def note(self, text: str) -> None:
        self.history.append(text)
        kind = text.split()[0]
        self.counts[kind] = self.counts.get(kind, 0) + 1

    def fail(self, message: str) -> None:
        pytest.fail(f"{message}\nseed {SEED}, last steps:\n  " + "\n  ".join(self.history))

    def wait_ready(self) -> None:
        for engine in self.engines:
            engine.worker.wait_registered()
            wait_for(lambda e=engine: e.scheduler.client.server_info, what="the scheduler")

    def prompt(self) -> tuple[Prompt, int]:
        length = self.rng.randint(1, MAX_CHUNKS)
        return tuple(self.rng.choice((0, 1, 2)) for _ in range(length)), self.rng.randrange(CHUNK)

    def bound(self, tenant: str, prompt: Prompt, tail: int) -> int:
        """The longest prefix of ``prompt`` and ``tail`` (in tokens) an engine of this tenant
        stored."""
        chunks = max(i for i in range(len(prompt) + 1) if prompt[:i] in self.stored[tenant])
        if chunks == len(prompt) and (prompt, tail // BLOCK) in self.tails[tenant]:
            return chunks * CHUNK + tail // BLOCK * BLOCK
        return chunks * CHUNK

    def stores(self, tenant: str, prompt: Prompt, tail: int) -> None:
        """Record what a store of ``prompt`` and ``tail`` may make visible."""
        for i in range(1, len(prompt) + 1):
            self.stored[tenant].add(prompt[:i])
        if tail >= BLOCK:
            self.tails[tenant].add((prompt, tail // BLOCK))

    # ----------------------------------------------------------------- steps

    def step(self) -> None:
        started = time.monotonic()
        self._step()
        kind = self.history[-1].split()[0] if self.history else "?"
        self.seconds[kind] = self.seconds.get(kind, 0.0) + time.monotonic() - started

    def _step(self) -> None:
        roll = self.rng.random()
        engine = self.rng.choice(self.engines)
        request = self.rng.choice(REQUEST_IDS)
        if roll < 0.45:
            self.lookup_and_retrieve(engine, request)
        elif roll < 0.80:
            self.store(engine, request)
        elif roll < 0.98:
            self.note(f"end_session {engine.id}/{request}")
            engine.scheduler.end_session(request)
        elif roll < 0.99:
            self.restart_server()  # ~5 s each on a loaded machine: keep them rare
        else:
            self.kill_worker_mid_store(engine, request)

    def lookup_and_retrieve(self, engine: Engine, request: str) -> None:
        prompt, tail = self.prompt()
        tokens = tokens_of(prompt, tail)
        hit = lookup(engine.scheduler, request, tokens)
        bound = self.bound(engine.tenant, prompt, tail)
        self.note(f"lookup {engine.id}/{request} {prompt}+{tail}: {hit} (bound {bound})")
        if hit % BLOCK or hit > bound or (hit % CHUNK and hit != bound):
            self.fail(f"lookup hit {hit} tokens, but at most {bound} tokens were ever stored")
        if hit and self.rng.random() < 0.8:
            blocks = TARGET[: hit // BLOCK]
            engine.worker("scramble", blocks=blocks)
            failed = set(engine.worker.retrieve(request, tokens, TARGET, end=hit))
            loaded = [(i, b) for i, b in enumerate(blocks) if b not in failed]
            wrong = engine.worker(
                "check",
                tokens=tokens,
                blocks=[b for _, b in loaded],
                indices=[i for i, _ in loaded],
            )["wrong"]
            self.note(f"retrieve {engine.id}/{request}: {len(loaded)} blocks, {len(failed)} failed")
            if wrong:
                self.fail(f"retrieved blocks {wrong} do not hold the KV of their own prompt")
            self.hit_chunks += -(-hit // CHUNK)
            self.checked_blocks += len(loaded)
        elif self.rng.random() < 0.5:
            self.note(f"abort {engine.id}/{request}")
            engine.scheduler.free_lookup_locks(request)
        engine.scheduler.end_session(request)

    def store(self, engine: Engine, request: str) -> None:
        prompt, tail = self.prompt()
        tokens = tokens_of(prompt, tail)
        engine.worker("compute", tokens=tokens, blocks=SOURCE)
        self.note(f"store {engine.id}/{request} {prompt}+{tail}")
        self.stores(engine.tenant, prompt, tail)
        engine.worker.store(request, tokens, SOURCE)

    def restart_server(self) -> None:
        self.note("restart")
        self.server.kill()
        self.server.start(timeout=60)  # starting Python takes long on a loaded machine
        self.wait_ready()

    def kill_worker_mid_store(self, engine: Engine, request: str) -> None:
        prompt, tail = self.prompt()
        tokens = tokens_of(prompt, tail)
        engine.worker("compute", tokens=tokens, blocks=SOURCE)
        self.stores(engine.tenant, prompt, tail)  # may be stored in part: still an upper bound
        engine.worker("store", request=request, tokens=tokens, blocks=SOURCE, end=len(tokens))
        self.note(f"kill {engine.id} storing {request} {prompt}")
        engine.replace_worker()
        engine.worker.wait_registered()

    def quiesce(self) -> None:
        """End every request of every engine: then no pin and no lease may be left (a killed
        worker's are released when its session expires)."""
        for engine in self.engines:
            for request in REQUEST_IDS:
                engine.scheduler.end_session(request)
        self.note("quiesce")

        def clean() -> bool:
            state = cache(self.server)
            return bool(state.l1_pins == 0 and state.leases == 0 and state.l1_writing == 0)

        deadline = time.monotonic() + 15
        while not clean():
            if time.monotonic() > deadline:
                self.fail(f"pins or leases left at quiescence: {cache(self.server)}")
            time.sleep(0.05)

    def close(self) -> None:
        for engine in self.engines:
            engine.close()


@pytest.fixture
def driver(server_process: Callable[..., ServerProcess], short_dir: Path) -> Iterator[Driver]:
    server = server_process(
        "--chunk-size", str(CHUNK),
        "--l1-size", "2MiB", "--l1-tenants", "2",  # 16 chunks per tenant: evicts
        "--l2", f"disk:path={short_dir / 'l2'}",
        "--heartbeat-timeout", "1",
        "--pin-ttl", "30",
        *(("--eviction", EVICTION) if EVICTION else ()),
    )  # fmt: skip
    driver = Driver(server, random.Random(SEED))
    yield driver
    driver.close()


def test_retrieves_return_their_own_prompts_kv_under_a_random_workload(driver: Driver) -> None:
    started = time.monotonic()
    for number in range(1, STEPS + 1):
        driver.step()
        if number % QUIESCE == 0:
            driver.quiesce()
    driver.quiesce()
    print(
        f"{STEPS} steps (seed {SEED}) in {time.monotonic() - started:.1f} s: {driver.counts}; "
        f"{driver.hit_chunks} chunks hit and retrieved, {driver.checked_blocks} blocks checked; "
        f"seconds by step: { {k: round(v, 1) for k, v in driver.seconds.items()} }"
    )
    assert driver.checked_blocks > 0  # the workload did exercise hits
