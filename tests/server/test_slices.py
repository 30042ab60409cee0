"""Big legal messages yield to the event loop between slices of their work (issue 22, item 6).

A store, commit or release of more than ``SLICE`` chunks, and a lookup of more than
``SLICE_KEYS`` keys, runs in slices with a yield in between: no task step of the server does
more than one slice of the work (on 04cca5e each ran whole in one step: a commit of 900k
hashes held the loop 3.4 s, a release 1.3 s, a lookup 1.4 s).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import trio
import trio.lowlevel

from kvtrio.client import open_client
from kvtrio.config import ServerConfig
from kvtrio.protocol import (
    HASH_SCHEME_TOKENS,
    Commit,
    CommitReply,
    LayoutSpec,
    Lookup,
    LookupReply,
    Register,
    Release,
    Released,
    Retrieve,
    RetrieveReply,
    Store,
    StoreReply,
)
from kvtrio.server import open_server

CHUNK = 256
LAYOUT = LayoutSpec("flash_attn", 2, 64, 16, 1, 16, "float16")  # 32 KiB chunks
COUNT = 3 * 1024 + 5  # (three slices of SLICE and a bit)
HASHES = tuple(i.to_bytes(16, "little") for i in range(COUNT))


class _PerStep(trio.abc.Instrument):
    """The most units of work counted within one task step (of any task)."""

    def __init__(self) -> None:
        self.count = 0
        self.before = 0
        self.most = 0

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self.before = self.count

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        self.most = max(self.most, self.count - self.before)

    def counting(self, function: Callable[..., Any], weight: int = 0) -> Callable[..., Any]:
        """``function``, counting one unit per call (or ``len`` of its argument ``weight``)."""

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.count += len(args[weight]) if weight else 1
            return function(*args, **kwargs)

        return counted


async def test_big_stores_commits_lookups_and_releases_yield_between_slices(
    server_config: ServerConfig,
) -> None:
    from kvtrio.server.cache._batch import SLICE_KEYS
    from kvtrio.server.cache._writes import SLICE

    config = attrs.evolve(server_config, l1_size=128 << 20)  # (COUNT chunks of 32 KiB)
    async with open_server(config) as server, open_client(server.endpoint, timeout=60) as worker:
        await worker.request(Register("", "m", 1, 0, LAYOUT, HASH_SCHEME_TOKENS))
        core = server.state.cache.core  # type: ignore[union-attr]
        l1 = core.l1
        steps = {name: _PerStep() for name in ("store", "commit", "lookup", "release")}
        l1.reserve = steps["store"].counting(l1.reserve)
        core.end_write = steps["commit"].counting(core.end_write)
        core.pin_for_lookup = steps["lookup"].counting(core.pin_for_lookup)
        core.end_reads = steps["release"].counting(core.end_reads, weight=2)

        async def measured(name: str, request: Any, reply_type: type[Any]) -> Any:
            trio.lowlevel.add_instrument(steps[name])
            try:
                return await worker.call(request, reply_type)
            finally:
                trio.lowlevel.remove_instrument(steps[name])

        stored = await measured("store", Store("r", 0, COUNT * CHUNK, HASHES), StoreReply)
        assert [slot.status for slot in stored.slots] == ["write"] * COUNT
        committed = await measured("commit", Commit("r", written=HASHES), CommitReply)
        assert committed == CommitReply(COUNT, ())
        found = await measured("lookup", Lookup("q", "m", 1, HASHES), LookupReply)
        assert found == LookupReply(COUNT * CHUNK, COUNT)
        read = await worker.call(Retrieve("q", 0, COUNT * CHUNK, HASHES), RetrieveReply)
        assert {slot.status for slot in read.slots} == {"read"}
        released = await measured("release", Release("q", HASHES), Released)
        assert released == Released(COUNT)
        server.stop()
    limits = {"store": SLICE, "commit": SLICE, "lookup": SLICE_KEYS, "release": SLICE}
    assert {name: step.count for name, step in steps.items()} == dict.fromkeys(steps, COUNT)
    for name, step in steps.items():
        assert 0 < step.most <= limits[name], (name, step.most)
