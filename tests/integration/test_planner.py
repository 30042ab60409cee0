"""Which chunks a connector loads and stores, and how its options are read (no engine needed)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtrio.integration._options import (
    OPTION_HELP,
    ConnectorOptions,
    parse_options,
    request_switches,
)
from kvtrio.integration._planner import (
    RequestPlan,
    held_after_lookup,
    may_store,
    plan_load,
    plan_store,
    usable_hit,
)

CHUNK, BLOCK = 64, 16
TOKENS = list(range(1000, 1000 + 5 * CHUNK + 10))
BLOCKS = list(range(100, 100 + 21))  # 5 chunks + 10 tokens: 21 blocks


@pytest.mark.parametrize(
    ("hit", "num_tokens", "usable"),
    [
        (0, 330, 0),
        (128, 330, 128),
        (320, 320, 304),  # the whole prompt: the engine computes its last block
        (320, 321, 320),
        (304, 310, 304),  # a hit with the partial chunk (4 chunks + 3 blocks)
        (64, 0, 0),
    ],
)
def test_usable_hit_leaves_the_engine_a_token_to_compute(
    hit: int, num_tokens: int, usable: int
) -> None:
    assert usable_hit(hit, num_tokens, BLOCK) == usable


def test_a_lookup_hit_counts_as_held_full_chunks_and_tail() -> None:
    plan = RequestPlan("r")
    held_after_lookup(plan, 2 * CHUNK, CHUNK)
    assert (plan.held_tokens, plan.tail_held) == (2 * CHUNK, False)
    held_after_lookup(plan, 4 * CHUNK + 3 * BLOCK, CHUNK)
    assert (plan.held_tokens, plan.tail_held) == (4 * CHUNK, True)


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
    assert op.token_ids == tuple(TOKENS)  # named as the lookup named them: the whole prompt
    return op.start, op.end, op.skip_first_n_tokens, op.block_ids


def test_a_load_starts_at_the_chunk_of_the_first_missing_token_and_skips_what_the_engine_has() -> (
    None
):
    plan = RequestPlan("r", hit_tokens=4 * CHUNK, local_tokens=CHUNK + 2 * BLOCK)
    start, end, skip, blocks = load(plan, 4 * CHUNK - (CHUNK + 2 * BLOCK)) or (0, 0, 0, ())
    assert (start, end, skip) == (CHUNK, 4 * CHUNK, 2 * BLOCK)
    assert blocks == tuple(BLOCKS[:16])


def test_a_load_may_end_inside_a_chunk_at_a_block_boundary() -> None:
    # The hit reaches the prompt's last whole block before its last token: the last chunk is
    # loaded in part (its first 3 blocks), the engine computes the rest.
    plan = RequestPlan("r", hit_tokens=4 * CHUNK + 3 * BLOCK)
    start, end, skip, blocks = load(plan, 4 * CHUNK + 3 * BLOCK) or (0, 0, 0, ())
    assert (start, end, skip) == (0, 4 * CHUNK + 3 * BLOCK, 0)
    assert blocks == tuple(BLOCKS[:19])


def test_nothing_to_load() -> None:
    assert load(RequestPlan("r", hit_tokens=2 * CHUNK, local_tokens=2 * CHUNK), 0) is None
    assert load(RequestPlan("r", hit_tokens=0), 0) is None
    # The engine asked for less than one whole block beyond its own: nothing is loadable.
    assert load(RequestPlan("r", hit_tokens=2 * CHUNK, local_tokens=CHUNK), BLOCK - 1) is None


def store(
    plan: RequestPlan, computed: int, blocks: int = len(BLOCKS), prompt: int = 10 * CHUNK
) -> list[tuple[int, int]]:
    transfers = plan_store(
        plan,
        tokens=TOKENS,
        block_ids=BLOCKS[:blocks],
        computed_tokens=computed,
        prompt_tokens=prompt,
        block_size=BLOCK,
        chunk_size=CHUNK,
    )
    for transfer in transfers:
        assert transfer.op.block_ids == tuple(BLOCKS[: transfer.op.end // BLOCK])
        assert transfer.op.token_ids == tuple(TOKENS[: transfer.op.end])
    return [(transfer.op.start, transfer.op.end) for transfer in transfers]


def test_stores_cover_each_whole_chunk_once_as_the_engine_computes_them() -> None:
    plan = RequestPlan("r")
    assert store(plan, CHUNK - 1) == []
    assert store(plan, CHUNK + 5) == [(0, CHUNK)]
    assert store(plan, CHUNK + 6) == []
    assert store(plan, 3 * CHUNK) == [(CHUNK, 3 * CHUNK)]
    assert store(plan, 10 * CHUNK) == [(3 * CHUNK, 5 * CHUNK)]  # only the tokens that exist
    assert plan.stores == 3


def test_the_prompts_partial_chunk_is_stored_once_the_prompt_is_computed() -> None:
    # A prompt of 2 chunks and 40 tokens: 2 whole blocks after its full chunks.
    prompt = 2 * CHUNK + 40
    plan = RequestPlan("r")
    assert store(plan, CHUNK, prompt=prompt) == [(0, CHUNK)]  # chunked prefill, first part
    assert store(plan, prompt, prompt=prompt) == [(CHUNK, 2 * CHUNK + 2 * BLOCK)]
    assert (plan.held_tokens, plan.tail_held) == (2 * CHUNK, True)
    assert store(plan, prompt + 1, prompt=prompt) == []  # decoding: nothing new yet
    assert store(plan, 3 * CHUNK, prompt=prompt) == [(2 * CHUNK, 3 * CHUNK)]  # a full chunk
    # Prefill and decode in one go (a resumed request): the tail, then the full chunks.
    plan = RequestPlan("r", held_tokens=CHUNK)
    assert store(plan, 4 * CHUNK, prompt=prompt) == [
        (CHUNK, 2 * CHUNK + 2 * BLOCK),
        (2 * CHUNK, 4 * CHUNK),
    ]
    # A prompt shorter than a chunk has a partial chunk too; one that a lookup found is not
    # stored again; a prompt of whole chunks has none.
    assert store(RequestPlan("r"), 40, prompt=40) == [(0, 2 * BLOCK)]
    assert store(RequestPlan("r", tail_held=True), 40, prompt=40) == []
    assert store(RequestPlan("r"), 2 * CHUNK, prompt=2 * CHUNK) == [(0, 2 * CHUNK)]


def test_stores_skip_what_kvtrio_holds_and_wait_for_blocks() -> None:
    plan = RequestPlan("r", held_tokens=2 * CHUNK)
    assert store(plan, 2 * CHUNK) == []
    assert store(plan, 4 * CHUNK, blocks=12) == [(2 * CHUNK, 3 * CHUNK)]  # 12 blocks: 3 chunks
    plan = RequestPlan("r", save=False)
    assert store(plan, 4 * CHUNK) == []
    assert plan.stores == 0


# --------------------------------------------------------------------------- options


def test_in_hash_mode_transfers_carry_the_engines_block_hashes_it_has() -> None:
    """A store ends where vLLM has hashed blocks (its hashes may lag its tokens); each
    operation carries the block hashes of what it names."""
    hashes = [bytes([i]) * 32 for i in range(len(BLOCKS))]
    plan = RequestPlan("r")
    (store,) = plan_store(
        plan, tokens=TOKENS, block_ids=BLOCKS, computed_tokens=len(TOKENS),
        prompt_tokens=len(TOKENS), block_size=BLOCK, chunk_size=CHUNK,
        block_hashes=hashes[:14],  # 3 chunks and 2 blocks hashed so far
    )  # fmt: skip
    assert (store.op.end, store.op.block_hashes) == (3 * CHUNK, tuple(hashes[:12]))
    plan = RequestPlan("r", hit_tokens=4 * CHUNK)
    transfer = plan_load(
        plan, tokens=TOKENS, block_ids=BLOCKS, external_tokens=4 * CHUNK,
        block_size=BLOCK, chunk_size=CHUNK, sync=False, block_hashes=hashes,
    )  # fmt: skip
    assert transfer is not None
    assert transfer.op.block_hashes == tuple(hashes)  # the prompt as it was looked up


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
        "kvtrio.insecure", "kvtrio.load", "kvtrio.save", "kvtrio.load_policy",
        "kvtrio.async_load", "kvtrio.timeout", "kvtrio.lookup_wait", "kvtrio.events",
        "kvtrio.keys", "kvtrio.load_failure",
    }  # fmt: skip
    assert ConnectorOptions().keys == "engine"  # vLLM's block hashes by default
    assert parse_options({"kvtrio.keys": "tokens"}).keys == "tokens"
    with pytest.raises(ValueError, match=r"kvtrio\.keys"):
        parse_options({"kvtrio.keys": "blocks"})


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
        "kvtrio.url: 'http://h': kvtrio speaks ZeroMQ over tcp:// or ipc://, not http://",
        "kvtrio.load: expected true or false, got 'maybe'",
        "kvtrio.timeout: expected 0 ≤ seconds < 3600, got -1.0",
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


def test_the_load_policy_judges_a_requests_hit_once() -> None:
    """vLLM asks for a waiting request's hit at every step until it can allocate its blocks:
    the policy decides (and counts, and counts towards exploring) once per request."""
    from kvtrio.integration._costs import CostModel
    from kvtrio.integration._options import ConnectorOptions
    from kvtrio.integration._scheduler_side import SchedulerSide

    class Adapter:
        chunk_size = CHUNK

        def maybe_submit_lookup_request(self, *args: object, **kwargs: object) -> None:
            pass

        def check_lookup_result(self, request_id: str, wait: float = 0.0) -> int:
            return 4 * CHUNK

        def lookup_l1_tokens(self, request_id: str) -> int:
            return 4 * CHUNK

    class Request:
        request_id = "r"
        all_token_ids = TOKENS
        kv_transfer_params = None
        cache_salt = None
        lora_request = None
        mm_features = None

    side = SchedulerSide(ConnectorOptions(), BLOCK, Adapter())  # type: ignore[arg-type]
    model = CostModel(explore_every=2)
    model.observe_step(1000, 0.001)  # computing is cheap here: loading does not pay
    model.observe_load(4 * CHUNK, 0.050)
    side.policy.model = model
    for _ in range(5):
        assert side.matched_tokens(Request(), 0, preempted=False) == (0, False)
    assert side.policy.stats == {"skipped": 1, "skipped_idle": 1, "skipped_tokens": 4 * CHUNK}


@given(
    prompt=st.integers(1, 12 * CHUNK),
    steps=st.lists(st.integers(1, 3 * CHUNK), min_size=1, max_size=40),
    hit=st.integers(0, 12 * CHUNK),
)
def test_a_step_skipped_by_may_store_would_have_stored_nothing(
    prompt: int, steps: list[int], hit: int
) -> None:
    """``build_step`` skips a request's ``plan_store`` when ``may_store`` says so (no blocks
    or hashes looked at): over any run of steps (prefill chunks, then decode), from any
    lookup hit, every skipped step is one that would have planned no store."""
    tokens = list(range(prompt + sum(steps)))
    blocks = list(range(len(tokens) // BLOCK + 1))
    plan = RequestPlan("r")
    held_after_lookup(plan, min(hit, prompt) - min(hit, prompt) % BLOCK, CHUNK)
    computed = 0
    for new in steps:
        computed = min(len(tokens), computed + new)
        skip = not may_store(plan, computed, prompt, BLOCK, CHUNK)
        stores = plan_store(
            plan, tokens=tokens, block_ids=blocks, computed_tokens=computed,
            prompt_tokens=prompt, block_size=BLOCK, chunk_size=CHUNK,
        )  # fmt: skip
        assert not (skip and stores)


def test_decode_steps_between_chunks_plan_no_store() -> None:
    plan = RequestPlan("r")
    prompt = len(TOKENS)
    tokens = [*TOKENS, *range(CHUNK)]
    assert may_store(plan, prompt, prompt, BLOCK, CHUNK)
    stores = plan_store(
        plan, tokens=tokens, block_ids=list(range(100, 130)), computed_tokens=prompt,
        prompt_tokens=prompt, block_size=BLOCK, chunk_size=CHUNK,
    )  # fmt: skip
    assert stores  # (the prompt's chunks and its partial chunk)
    assert not may_store(plan, prompt + 1, prompt, BLOCK, CHUNK)  # a decode step
    assert may_store(plan, 6 * CHUNK, prompt, BLOCK, CHUNK)  # a chunk of output completed
    assert not may_store(RequestPlan("r", save=False), 6 * CHUNK, prompt, BLOCK, CHUNK)
