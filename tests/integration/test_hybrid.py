"""Hybrid models' loads and stores, decided without an engine (:mod:`kvtrio.integration._hybrid`,
:mod:`kvtrio.integration._kv_groups`), and the vLLM versions the connector accepts
(:mod:`kvtrio.integration._vllm_setup`)."""

from __future__ import annotations

import math
import re
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import attrs
import pytest

from kvtrio.client import EventGroup
from kvtrio.client._copies import Span
from kvtrio.client._grouped import grouped_chunks
from kvtrio.integration._hybrid import GroupSpread, primary_group
from kvtrio.integration._kv_groups import (
    KvGroup,
    group_block_hashes,
    kv_groups,
    unsupported_kv_cache,
)
from kvtrio.integration._options import ConnectorOptions
from kvtrio.integration._planner import RequestPlan, plan_load, plan_store
from kvtrio.integration._scheduler_side import SchedulerSide
from kvtrio.integration._vllm_setup import UnsupportedVllm, check_vllm_version, supported_range

from .._support.engine_requests import EngineRequest
from .test_load_policy import Adapter

CHUNK, BLOCK, WINDOW = 64, 16, 128
PROMPT = 1024 + 10
TOKENS = list(range(1000, 1000 + PROMPT))
BLOCK_BYTES = 4096

FULL = KvGroup(0, "full", "full_attention", 1, block_bytes=BLOCK_BYTES)
SLIDING = KvGroup(1, "window", "sliding_window", 1, WINDOW, BLOCK_BYTES)
LOCAL = KvGroup(1, "chunked", "chunked_local_attention", 1, WINDOW, BLOCK_BYTES)
MAMBA = KvGroup(1, "mamba", "mamba", 1)


def spec(name: str, **fields: int | str) -> object:
    kind = type(name, (), {"page_size_bytes": BLOCK_BYTES // 2, "block_size": BLOCK, **fields})
    return kind()


def config(*specs: object) -> object:
    groups = [SimpleNamespace(kv_cache_spec=s, layer_names=["a", "b"]) for s in specs]
    return SimpleNamespace(kv_cache_groups=groups)


def test_every_kind_vllm_groups_apart_is_kept() -> None:
    kv = config(
        spec("FullAttentionSpec"),
        spec("SlidingWindowMLASpec", sliding_window=128),
        spec("ChunkedLocalAttentionSpec", attention_chunk_size=256),
        spec("MambaSpec"),
        spec("MLAAttentionSpec"),
    )
    assert unsupported_kv_cache(kv) is None
    groups = kv_groups(kv)
    assert [(g.kind, g.spec_kind, g.window) for g in groups] == [
        ("full", "full_attention", 0),
        ("window", "sliding_window_mla", 128),
        ("chunked", "chunked_local_attention", 256),
        ("mamba", "mamba", 0),
        ("full", "mla_attention", 0),
    ]
    assert groups[0].block_bytes == BLOCK_BYTES  # two layers of half a block each


@pytest.mark.parametrize("name", ["RSWASpec", "UniformTypeKVCacheSpecs", "CrossAttentionSpec"])
def test_what_is_not_kept_turns_the_connector_off(name: str) -> None:
    assert unsupported_kv_cache(config(spec("FullAttentionSpec"), spec(name))) is not None
    assert unsupported_kv_cache(config(spec("MambaSpec"))) is not None  # only state


def test_groups_of_different_block_sizes_turn_the_connector_off() -> None:
    """Was: kept (``spec.block_size`` never read): every group's blocks were mapped as blocks
    of ``cache_config.block_size`` tokens, and the worker's registration raised ("all layers
    must have the same shape") into vLLM at start-up, which then failed to start."""
    full, window = spec("FullAttentionSpec"), spec("SlidingWindowSpec", sliding_window=WINDOW)
    assert unsupported_kv_cache(config(full, window), BLOCK) is None
    wider = spec("SlidingWindowSpec", sliding_window=WINDOW, block_size=2 * BLOCK)
    reason = unsupported_kv_cache(config(full, wider), BLOCK)
    assert reason is not None
    assert "FullAttentionSpec 16, SlidingWindowSpec 32" in reason
    assert unsupported_kv_cache(config(full, wider)) is not None  # (the engine's size unknown)
    assert unsupported_kv_cache(config(full, window), 2 * BLOCK) is not None  # (none of it)
    # a Mamba group's block size counts in align mode only (else vLLM's one block of
    # max_model_len tokens, never moved)
    aligned = spec("MambaSpec", mamba_cache_mode="align", block_size=4 * BLOCK)
    assert unsupported_kv_cache(config(full, aligned), BLOCK) is not None
    whole = spec("MambaSpec", mamba_cache_mode="none", block_size=4096)
    assert unsupported_kv_cache(config(full, whole), BLOCK) is None


def test_what_each_kind_reads_for_a_hit() -> None:
    assert FULL.first_needed(1024) == 0
    assert SLIDING.first_needed(1024) == 1024 - WINDOW + 1
    assert SLIDING.first_needed(100) == 0
    assert LOCAL.first_needed(1000) == 896  # the hit's last attention chunk
    assert LOCAL.first_needed(1024) == 1024  # a new attention chunk starts: nothing
    assert primary_group([SLIDING, attrs.evolve(FULL, index=1)]) == 1
    assert primary_group([SLIDING, attrs.evolve(LOCAL, index=2)]) == 1


def test_groups_never_share_keys() -> None:
    base = [bytes([i]) * 16 for i in range(8)]
    zero, one = group_block_hashes(base, 0), group_block_hashes(base, 1)
    assert len(set(zero) | set(one) | set(base)) == 3 * len(base)
    assert group_block_hashes(base[:4], 1) == one[:4]  # a prefix keeps its keys


def request(tokens: int = PROMPT) -> SimpleNamespace:
    return SimpleNamespace(request_id="r", all_token_ids=TOKENS[:tokens])


def blocks(group: KvGroup, end: int, nulls_before: int = 0) -> list[int]:
    """A group's blocks for tokens [0, end), the null block (0) before ``nulls_before``."""
    base = 1000 * (group.index + 1)
    return [0 if b * BLOCK < nulls_before else base + b for b in range(math.ceil(end / BLOCK))]


def spread_load(groups: list[KvGroup], local: int, hit: int) -> tuple[GroupSpread, list]:
    spread = GroupSpread(groups, BLOCK)
    plan = RequestPlan("r", hit_tokens=hit, local_tokens=local)
    ids = [blocks(g, PROMPT, g.first_needed(hit) // BLOCK * BLOCK) for g in groups]
    hashes = spread.hashes(request(), None)
    load_of = partial(
        plan_load, plan, tokens=TOKENS, external_tokens=hit - local,
        block_size=BLOCK, chunk_size=CHUNK, sync=False,
    )  # fmt: skip
    return spread, spread.loads(load_of, ids, hashes, plan, CHUNK)


def test_a_hit_loads_every_full_block_and_the_windows_last_blocks() -> None:
    spread, (full, sliding) = spread_load([FULL, SLIDING], 0, 1024)
    assert (full.group, full.op.start, full.op.end, full.op.skip_first_n_tokens) == (0, 0, 1024, 0)
    # the window's last 127 tokens: blocks from token 896 on, in the chunk at 896
    assert (sliding.group, sliding.op.start, sliding.op.skip_first_n_tokens) == (1, 896, 0)
    assert 0 not in sliding.op.block_ids[896 // BLOCK :]
    assert sliding.op.block_hashes != full.op.block_hashes
    moved = spread.stats["loaded_bytes"]
    assert moved == (1024 + 128) // BLOCK * BLOCK_BYTES
    assert spread.stats["hit_bytes_full"] == 2 * 1024 // BLOCK * BLOCK_BYTES
    # the issue's target: the sliding layers' bytes are at most window / prompt + one chunk
    sliding_share = (moved - 1024 // BLOCK * BLOCK_BYTES) / (1024 // BLOCK * BLOCK_BYTES)
    assert sliding_share <= WINDOW / PROMPT + CHUNK / 1024


def test_a_window_inside_a_chunk_skips_the_blocks_before_it() -> None:
    sliding = KvGroup(1, "window", "sliding_window", 1, 40, BLOCK_BYTES)
    _, (_, load) = spread_load([FULL, sliding], 0, 1024)
    # tokens 985-1023: from block 61 (976), in the chunk at 960
    assert (load.op.start, load.op.skip_first_n_tokens) == (960, 16)


def test_the_engines_own_prefix_is_left_alone_in_every_group() -> None:
    _, (full, sliding) = spread_load([FULL, SLIDING], 960, 1024)
    assert (full.op.start, full.op.skip_first_n_tokens) == (960, 0)
    assert (sliding.op.start, sliding.op.skip_first_n_tokens) == (960, 0)
    _, (full,) = spread_load([FULL, LOCAL], 512, 1024)  # (nothing of the local attention)
    assert full.group == 0


def test_stores_of_a_windowed_group_skip_the_null_block_and_are_marked() -> None:
    spread = GroupSpread([FULL, SLIDING], BLOCK)
    plan = RequestPlan("r")
    store_of = partial(
        plan_store, plan, tokens=TOKENS, computed_tokens=256, prompt_tokens=PROMPT,
        block_size=BLOCK, chunk_size=CHUNK,
    )  # fmt: skip
    # vLLM freed the sliding blocks of the first chunk before it was whole
    ids = [blocks(FULL, 256), blocks(SLIDING, 256, nulls_before=64)]
    stores = spread.stores(store_of, ids, spread.hashes(request(), None), plan)
    assert [(s.group, s.windowed, s.op.start, s.op.end) for s in stores] == [
        (0, False, 0, 256),
        # (one store of chunks 0-3: its first blocks are null, so none of it)
    ]
    assert spread.stats["stores_skipped_window"] == 1
    store_of = partial(
        plan_store, plan, tokens=TOKENS, computed_tokens=320, prompt_tokens=PROMPT,
        block_size=BLOCK, chunk_size=CHUNK,
    )  # fmt: skip
    ids = [blocks(FULL, 320), blocks(SLIDING, 320, nulls_before=128)]
    stores = spread.stores(store_of, ids, spread.hashes(request(), None), plan)
    assert [(s.group, s.windowed, s.op.start, s.op.end) for s in stores] == [
        (0, False, 256, 320),
        (1, True, 256, 320),
    ]


def test_every_groups_store_names_its_group_and_the_engines_block_hashes() -> None:
    """vLLM names a block alike in every group and tells groups apart by ``group_idx``,
    ``kv_cache_spec_kind`` and ``kv_cache_spec_sliding_window``: each group's store carries the
    engine's block hashes (the primary group's names) and its group, and so do the server's
    stores of it (its KV events)."""
    spread = GroupSpread([FULL, SLIDING], BLOCK)
    plan = RequestPlan("r")
    store_of = partial(
        plan_store, plan, tokens=TOKENS, computed_tokens=256, prompt_tokens=PROMPT,
        block_size=BLOCK, chunk_size=CHUNK,
        event_hashes=lambda first, stop: [700 + b for b in range(first, stop)],
    )  # fmt: skip
    ids = [blocks(FULL, 256), blocks(SLIDING, 256)]
    stores = spread.stores(store_of, ids, spread.hashes(request(), None), plan)
    assert [(s.group, s.op.group) for s in stores] == [
        (0, EventGroup(0, "full_attention", 0)),
        (1, EventGroup(1, "sliding_window", WINDOW)),
    ]
    assert stores[0].op.event_hashes == stores[1].op.event_hashes == tuple(range(700, 716))
    assert stores[0].op.block_hashes != stores[1].op.block_hashes  # (keys of its own)
    span = Span(
        "r", 0, (b"c" * 16,), b"", CHUNK, 1, CHUNK // BLOCK, ids[1], group=stores[1].op.group
    )
    store = span.store()
    assert (store.group_idx, store.kv_cache_spec_kind, store.kv_cache_spec_sliding_window) == (
        1, "sliding_window", WINDOW,
    )  # fmt: skip
    one = Span("r", 0, (b"c" * 16,), b"", CHUNK, 1, CHUNK // BLOCK, ids[0]).store()
    assert (one.group_idx, one.kv_cache_spec_kind) == (-1, "")  # one group: none, as before
    mamba = GroupSpread([FULL, ALIGNED], BLOCK)
    plan = RequestPlan("r")
    store_of = partial(store_of.func, plan, **store_of.keywords)
    state_ids = [0] * 15 + [2015]  # the state at 256 in block 15
    hashes = mamba.hashes(request(), None)
    stores = mamba.stores(store_of, [ids[0], state_ids], hashes, plan, CHUNK)
    assert [(s.op.start, s.op.group) for s in stores] == [
        (0, EventGroup(0, "full_attention", 0)),
        (192, EventGroup(1, "mamba", 0)),
    ]
    assert stores[1].op.event_hashes == tuple(range(712, 716))  # (from the state's chunk on)


def test_a_mamba_group_loads_and_stores_nothing() -> None:
    assert not GroupSpread([FULL, MAMBA], BLOCK).keeps_state
    assert GroupSpread([FULL, SLIDING], BLOCK).keeps_state


@pytest.mark.parametrize("version", ["0.32.0", "0.33.0", "0.33.1.dev4+g123", "0.32.0+cpu"])
def test_supported_vllm_versions_are_accepted(version: str) -> None:
    check_vllm_version(version)


@pytest.mark.parametrize("version", ["0.31.2", "0.34.0", "1.0.0", "nightly"])
def test_a_vllm_outside_the_range_fails_in_one_line_naming_it(version: str) -> None:
    with pytest.raises(UnsupportedVllm) as raised:
        check_vllm_version(version)
    message = str(raised.value)
    assert "\n" not in message
    assert supported_range() == ">=0.32,<0.34"
    assert ">=0.32,<0.34" in message


def test_the_vllm_extra_names_the_supported_range() -> None:
    pyproject = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    (extra,) = re.findall(r"^vllm = \[(.*)\]", pyproject, re.MULTILINE)
    assert extra == f'"vllm{supported_range()}"'


def test_events_relay_the_group_fields_where_the_server_gives_them() -> None:
    from kvtrio.integration._events import _REMOVED_OPTIONAL, _STORED_OPTIONAL, _optional

    class Stored:  # a vLLM whose BlockStored has the group fields
        __struct_fields__ = ("block_hashes", "group_idx", "kv_cache_spec_kind")

    class Old:  # one without them
        __struct_fields__ = ("block_hashes",)

    stored = SimpleNamespace(group_idx=1, kv_cache_spec_kind="sliding_window")
    assert _optional(Stored, stored, _STORED_OPTIONAL) == {
        "group_idx": 1,
        "kv_cache_spec_kind": "sliding_window",
    }
    assert _optional(Stored, stored, _REMOVED_OPTIONAL) == {"group_idx": 1}
    assert _optional(Old, stored, _STORED_OPTIONAL) == {}
    unset = SimpleNamespace(group_idx=None, kv_cache_spec_kind=None)  # a server without them
    assert _optional(Stored, unset, _STORED_OPTIONAL) == {}


def test_a_hybrid_engines_failed_load_is_not_tried_again() -> None:
    """Several groups: loads are asynchronous (whatever ``async_load`` says); a request whose
    load failed (vLLM recomputes its prompt and asks again) loads nothing more."""
    from kvtrio.integration._options import ConnectorOptions
    from kvtrio.integration._scheduler_side import SchedulerSide

    from . import test_load_policy as policy

    adapter = policy.Adapter()
    options = ConnectorOptions(async_load=False)
    block = policy.BLOCK
    groups = [
        attrs.evolve(FULL, block_bytes=1),
        KvGroup(1, "window", "sliding_window", 1, 2 * block, 1),
    ]
    side = SchedulerSide(options, block, adapter, groups=groups)  # type: ignore[arg-type]
    request = EngineRequest("r", policy.PROMPT)
    adapter.hits["r"] = (5 * policy.CHUNK, 5 * policy.CHUNK)  # (all of it: not asked again)
    need, asynchronous = side.matched_tokens(request, 0, preempted=False)
    assert (need, asynchronous) == (5 * policy.CHUNK, True)
    ids = [policy.BLOCKS, [b + 1000 for b in policy.BLOCKS]]
    side.allocated(request, ids[0], need or 0, ids)
    loads = side.build_step({}, (), 0, None).transfers
    assert [(t.group, t.sync) for t in loads] == [(0, False), (1, False)]
    side.loads_failed({"r"})
    assert side.matched_tokens(request, 0, preempted=False) == (0, False)


ALIGNED = KvGroup(1, "mamba", "mamba", 1, block_bytes=BLOCK_BYTES, aligned=True)


def test_a_lookup_asks_each_group_for_what_a_hit_at_its_end_needs() -> None:
    spread = GroupSpread([FULL, SLIDING, attrs.evolve(ALIGNED, index=2)], BLOCK)
    hashes = spread.hashes(request(), None)
    groups, state = spread.lookup_hashes("r", hashes, PROMPT)
    assert [(len(h), first) for h, first in groups] == [(64, 0), (64, 1024 - WINDOW)]
    assert state is not None
    assert (len(state), state[-1]) == (64, hashes[2][63])


def test_a_prompt_of_whole_chunks_asks_for_its_last_chunk_whole() -> None:
    """Without a Mamba group a lookup asks every whole block, as a one-group lookup does: a
    prompt of whole chunks hits its last chunk (stored whole) and loads it up to the block
    before its last token; asked only up to there, that chunk would be a partial one nobody
    stored, and the hit a chunk shorter (bench/ttft.py's gpt-oss-shaped hit was 768 of 1,024
    tokens, not 992)."""
    spread = GroupSpread([FULL, SLIDING], BLOCK)
    hashes = spread.hashes(request(1024), None)
    groups, state = spread.lookup_hashes("r", hashes, 1024)
    assert state is None
    assert [(len(h), first) for h, first in groups] == [(64, 0), (64, 1008 - WINDOW)]
    chunks = grouped_chunks(CHUNK, BLOCK, groups)
    assert chunks.covered(len(chunks.hashes)) == 1024
    assert spread.hit("r", 1024, 1024) == 1008
    with_state = GroupSpread([FULL, SLIDING, attrs.evolve(ALIGNED, index=2)], BLOCK)
    groups, state = with_state.lookup_hashes("r", with_state.hashes(request(1024), None), 1024)
    assert [len(h) for h, _ in groups] == [63, 63]  # a state only at the hit's end
    assert state is not None
    assert len(state) == 63


def test_a_short_answer_is_asked_again_for_its_own_end() -> None:
    spread = GroupSpread([FULL, SLIDING], BLOCK)
    hashes = spread.hashes(request(), None)
    assert spread.hit("r", 1024, PROMPT) == 1024  # whole: as answered
    assert spread.hit("r", 512, PROMPT) is None  # windows asked only at 1024
    groups, _ = spread.lookup_hashes("r", hashes, PROMPT)
    assert [(len(h), first) for h, first in groups] == [(32, 0), (32, 512 - WINDOW)]
    assert spread.hit("r", 512, PROMPT) == 512
    assert spread.hit("r", 512, PROMPT) == 512  # vLLM asks again: the same answer
    spread.forget("r")
    assert spread.hit("r", 512, PROMPT) is None
    assert spread.hit("r", 256, PROMPT) is None
    assert spread.hit("r", 128, PROMPT) == 0  # asked again twice: nothing
    assert spread.hit("r", 128, PROMPT) == 0
    assert GroupSpread([FULL, attrs.evolve(FULL, index=1)], BLOCK).hit("r", 512, PROMPT) == 512


def test_a_mamba_group_stores_the_state_at_a_stores_end_where_vllm_has_it() -> None:
    spread = GroupSpread([FULL, ALIGNED], BLOCK)
    assert spread.keeps_state
    plan = RequestPlan("r")
    store_of = partial(
        plan_store, plan, tokens=TOKENS, computed_tokens=256, prompt_tokens=PROMPT,
        block_size=BLOCK, chunk_size=CHUNK,
    )  # fmt: skip
    state_ids = [0] * 15 + [2015]  # align mode: the state at 256 in block 15, null before
    stores = spread.stores(
        store_of, [blocks(FULL, 256), state_ids], spread.hashes(request(), None), plan, CHUNK
    )
    assert [(s.group, s.windowed, s.op.start, s.op.end) for s in stores] == [
        (0, False, 0, 256),
        (1, True, 192, 256),  # its last chunk, every slot the state block
    ]
    assert stores[1].op.block_ids[192 // BLOCK :] == (2015,) * 4
    plan = RequestPlan("r")
    store_of = partial(store_of.func, plan, **store_of.keywords)
    stores = spread.stores(
        store_of, [blocks(FULL, 256), [0] * 16], spread.hashes(request(), None), plan, CHUNK
    )
    assert [s.group for s in stores] == [0]  # no state at 256: not stored
    assert spread.stats["stores_skipped_state"] == 1


WINDOW_ONLY = attrs.evolve(SLIDING, index=0)


@pytest.mark.parametrize(
    ("groups", "local", "state", "stored"),
    [
        ([WINDOW_ONLY], 512, False, []),
        ([WINDOW_ONLY, ALIGNED], 512, False, []),
        ([WINDOW_ONLY, ALIGNED], 512, True, [1]),  # (the state's store holds the blocks)
        ([WINDOW_ONLY], 0, False, [0]),
    ],
    ids=["window", "window-and-mamba", "window-and-mamba-state", "window-whole"],
)
def test_a_store_no_group_hands_to_the_workers_does_not_hold_the_requests_blocks(
    groups: list[KvGroup], local: int, state: bool, stored: list[int]
) -> None:
    """Was: with no full-attention group (the primary group a windowed one), a store skipped
    for vLLM's null block before the window was still counted, so ``finished`` told vLLM to
    keep the request's blocks until the workers reported stores they never got: vLLM never
    freed them, and the engine ran out of KV blocks."""
    side = SchedulerSide(ConnectorOptions(), BLOCK, Adapter(), groups=groups)  # type: ignore[arg-type]
    request = EngineRequest("r", PROMPT)
    # vLLM's own prefix cache has the first ``local`` tokens, kvtrio none
    assert side.matched_tokens(request, local, preempted=False) == (0, False)
    request.num_computed_tokens = local
    window = blocks(WINDOW_ONLY, PROMPT, WINDOW_ONLY.first_needed(local) // BLOCK * BLOCK)
    states = [0] * len(window)
    if state:  # align mode: the state at 1024 (the store's end) in block 63
        states[1024 // BLOCK - 1] = 2063
    ids = [window, states][: len(groups)]
    step = side.build_step(
        {"r": PROMPT - local}, (), PROMPT - local, lambda rid: ids[0], lambda rid: ids
    )
    assert [(t.group, t.op.end) for t in step.transfers] == [(g, 1024) for g in stored]
    assert side.finished("r") is bool(stored)


def test_a_mamba_group_loads_the_one_block_of_the_state_at_the_hits_end() -> None:
    spread, (full, state) = spread_load([FULL, ALIGNED], 0, 1024)
    assert (full.op.start, full.op.end) == (0, 1024)
    assert (state.group, state.op.start, state.op.skip_first_n_tokens) == (1, 960, 48)
    assert spread.stats["loaded_bytes"] == (1024 // BLOCK + 1) * BLOCK_BYTES
