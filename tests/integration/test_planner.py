"""Which chunks a connector loads and stores, and how its options are read (no engine needed)."""

from __future__ import annotations

import pytest

from kvtrio.integration._options import (
    OPTION_HELP,
    ConnectorOptions,
    parse_options,
    request_switches,
)
from kvtrio.integration._planner import RequestPlan, plan_load, plan_store, usable_hit

CHUNK, BLOCK = 64, 16
TOKENS = list(range(1000, 1000 + 5 * CHUNK + 10))
BLOCKS = list(range(100, 100 + 21))  # 5 chunks + 10 tokens: 21 blocks


@pytest.mark.parametrize(
    ("hit", "num_tokens", "usable"),
    [
        (0, 330, 0),
        (128, 330, 128),
        (320, 320, 256),  # the whole prompt: keep the last chunk for the engine to compute
        (320, 321, 320),
        (64, 0, 0),
    ],
)
def test_usable_hit_leaves_the_engine_a_token_to_compute(
    hit: int, num_tokens: int, usable: int
) -> None:
    assert usable_hit(hit, num_tokens, CHUNK) == usable


def load(plan: RequestPlan, external: int) -> tuple[int, int, int, tuple[int, ...]] | None:
    transfer = plan_load(
        plan,
        tokens=TOKENS,
        block_ids=BLOCKS,
        external_tokens=external,
        block_size=BLOCK,
        chunk_size=CHUNK,
        sync=False,
    )
    if transfer is None:
        return None
    op = transfer.op
    assert transfer.kind == "load"
    assert op.token_ids == tuple(TOKENS[: op.end])
    return op.start, op.end, op.skip_first_n_tokens, op.block_ids


def test_a_load_starts_at_the_chunk_of_the_first_missing_token_and_skips_what_the_engine_has() -> (
    None
):
    plan = RequestPlan("r", hit_tokens=4 * CHUNK, local_tokens=CHUNK + 2 * BLOCK)
    start, end, skip, blocks = load(plan, 4 * CHUNK - (CHUNK + 2 * BLOCK)) or (0, 0, 0, ())
    assert (start, end, skip) == (CHUNK, 4 * CHUNK, 2 * BLOCK)
    assert blocks == tuple(BLOCKS[:16])


def test_nothing_to_load() -> None:
    assert load(RequestPlan("r", hit_tokens=2 * CHUNK, local_tokens=2 * CHUNK), 0) is None
    assert load(RequestPlan("r", hit_tokens=0), 0) is None
    # The engine asked for less than one whole chunk beyond its own: nothing is loadable.
    assert load(RequestPlan("r", hit_tokens=2 * CHUNK, local_tokens=CHUNK), BLOCK) is None


def store(plan: RequestPlan, computed: int, blocks: int = len(BLOCKS)) -> tuple[int, int] | None:
    transfer = plan_store(
        plan,
        tokens=TOKENS,
        block_ids=BLOCKS[:blocks],
        computed_tokens=computed,
        block_size=BLOCK,
        chunk_size=CHUNK,
    )
    if transfer is None:
        return None
    assert transfer.op.block_ids == tuple(BLOCKS[: transfer.op.end // BLOCK])
    return transfer.op.start, transfer.op.end


def test_stores_cover_each_whole_chunk_once_as_the_engine_computes_them() -> None:
    plan = RequestPlan("r")
    assert store(plan, CHUNK - 1) is None
    assert store(plan, CHUNK + 5) == (0, CHUNK)
    assert store(plan, CHUNK + 6) is None
    assert store(plan, 3 * CHUNK) == (CHUNK, 3 * CHUNK)
    assert store(plan, 10 * CHUNK) == (3 * CHUNK, 5 * CHUNK)  # only the tokens that exist
    assert plan.stores == 3


def test_stores_skip_what_kvtrio_holds_and_wait_for_blocks() -> None:
    plan = RequestPlan("r", held_tokens=2 * CHUNK)
    assert store(plan, 2 * CHUNK) is None
    assert store(plan, 4 * CHUNK, blocks=12) == (2 * CHUNK, 3 * CHUNK)  # 12 blocks: 3 chunks
    plan = RequestPlan("r", save=False)
    assert store(plan, 4 * CHUNK) is None
    assert plan.stores == 0


# --------------------------------------------------------------------------- options


def test_options_defaults_and_spellings() -> None:
    assert parse_options({}) == ConnectorOptions()
    options = parse_options(
        {
            "kvtrio.url": "ipc:///tmp/k.sock",
            "kvtrio.save": "false",
            "kvtrio.async_load": 0,
            "kvtrio.timeout": "2.5",
            "other.key": object(),  # another connector's option: not ours
        }
    )
    assert (options.url, options.save, options.async_load, options.timeout) == (
        "ipc:///tmp/k.sock",
        False,
        False,
        2.5,
    )
    assert set(OPTION_HELP) == {
        "kvtrio.url", "kvtrio.model", "kvtrio.tenant", "kvtrio.server_key", "kvtrio.client_key",
        "kvtrio.insecure", "kvtrio.load", "kvtrio.save",
        "kvtrio.async_load", "kvtrio.timeout", "kvtrio.lookup_wait",
    }  # fmt: skip


def test_bad_options_are_all_named_in_one_message() -> None:
    with pytest.raises(ValueError, match="kvtrio connector options") as info:
        parse_options(
            {
                "kvtrio.urll": "x",
                "kvtrio.url": "http://h",
                "kvtrio.load": "maybe",
                "kvtrio.timeout": -1,
            }
        )
    message = str(info.value)
    for part in (
        "unknown option kvtrio.urll (known: kvtrio.async_load",
        "kvtrio.url: expected tcp://HOST:PORT or ipc://PATH, got 'http://h'",
        "kvtrio.load: expected true or false, got 'maybe'",
        "kvtrio.timeout: expected 0 ≤ seconds < 3600, got -1",
    ):
        assert part in message


def test_request_switches() -> None:
    assert request_switches(None) == (None, None, "")
    assert request_switches({"kvtrio.load": False}) == (False, None, "")
    assert request_switches({"kvtrio.save": "no", "do_remote_prefill": True}) == (None, False, "")
    assert request_switches({"kvtrio.load": "perhaps"}) == (
        None,
        None,
        "kvtrio.load: expected true or false, got 'perhaps'",
    )
