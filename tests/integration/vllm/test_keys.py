"""Chunks named by vLLM's own block hashes (hash mode, the connector's default) inside vLLM's
real scheduler: requests with a cache_salt, a LoRA adapter, an image or prompt embeddings are
cached, and two requests share KV exactly when vLLM's block hashes say they may.

The stand-in model's KV depends on what a real model's would (``harness.request_marks``: the
adapter, the salt, the image from its position on, the embeddings), and every step checks the
KV of every token a request counts as computed, so a load of another kind's KV fails where it
happens, not only in the hit counts.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_utils
from vllm.v1.core.encoder_cache_manager import EncoderCacheManager
from vllm.v1.core.kv_cache_utils import init_none_hash

from kvtrio.client import Client
from kvtrio.errors import Incompatible
from kvtrio.integration._engine_keys import KeyScheme, key_scheme
from kvtrio.launch import ServerProcess
from kvtrio.protocol import LayoutSpec, Register

from ..._support.server_cache import assert_no_pins, cache, wait_chunks
from ..._support.waiting import wait_for
from ..tiny_model import CONFIG
from .harness import BLOCK, HEAD_DIM, HEADS, LAYERS, Engine, make_config

CHUNK = 64
SERVER_ARGS = ("--chunk-size", str(CHUNK), "--l1-size", "64MiB", "--heartbeat-timeout", "3")
PROMPT = [(i * 7919) % 997 + 3 for i in range(5 * CHUNK + 10)]  # 5 whole chunks
IMAGE_AT = 2 * CHUNK + 5  # chunks 0 and 1 come before the image


@pytest.fixture
def kvtrio(server_process: Callable[..., ServerProcess]) -> ServerProcess:
    return server_process(*SERVER_ARGS)


@pytest.fixture
def engine(
    model_dir: Path, kvtrio: ServerProcess, request: pytest.FixtureRequest
) -> Iterator[Engine]:
    options = {"load_policy": "always", **getattr(request, "param", {})}
    made = Engine(make_config(model_dir, kvtrio.endpoint, **options))
    # The tiny model is text-only, so vLLM gives it no encoder budget: give it one, as a
    # multimodal model's would be (the stand-in "encoder" costs nothing).
    made.scheduler.max_num_encoder_input_tokens = 4096
    made.scheduler.encoder_cache_manager = EncoderCacheManager(cache_size=4096)
    try:
        yield made
    finally:
        made.close()


def embeddings(seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(len(PROMPT), CONFIG["hidden_size"], generator=generator)


def kind(name: str, which: int) -> dict[str, Any]:
    """What makes request ``which`` (1 or 2) of kind ``name`` differ beyond its tokens."""
    if name == "cache_salt":
        return {"cache_salt": f"tenant-{which}"}
    if name == "lora":
        return {"lora": f"adapter-{which}"}
    if name == "image":
        return {"images": [(f"image-{which}", IMAGE_AT, 40)]}
    assert name == "prompt_embeds"
    return {"prompt_embeds": embeddings(which)}


def shared_with_others(name: str) -> int:
    """Tokens a request of kind ``name`` may share with another kind's same prompt: the whole
    chunks before its image (vLLM's block hashes before it are a plain prompt's)."""
    return 2 * CHUNK if name == "image" else 0


def run(engine: Engine, request_id: str, **fields: Any) -> int:
    """Run one request to its end; the tokens it loaded from kvtrio."""
    engine.add(request_id, PROMPT, **fields)
    engine.run()
    result = engine.results[request_id]
    assert len(result.output) == 4
    assert result.external_cached is not None
    return result.external_cached


@pytest.mark.parametrize("name", ["cache_salt", "lora", "image", "prompt_embeds"])
def test_equal_tokens_share_kv_only_with_the_same_salt_adapter_image_or_embeddings(
    engine: Engine, kvtrio: ServerProcess, name: str
) -> None:
    placeholder = [0] * len(PROMPT)  # the tokens vLLM counts for prompt embeddings
    assert run(engine, "one", **kind(name, 1)) == 0
    wait_chunks(kvtrio, 5)  # stored: the request is cached
    # The same tokens with another salt / adapter / image / embeddings: nothing of the first
    # (but what comes before the image), and its own chunks are stored.
    assert run(engine, "two", **kind(name, 2)) == shared_with_others(name)
    wait_chunks(kvtrio, 5 + 5 - shared_with_others(name) // CHUNK)
    # The same tokens and nothing else (for embeddings: their placeholder tokens): likewise.
    engine.add("plain", placeholder if name == "prompt_embeds" else PROMPT)
    engine.run()
    assert engine.results["plain"].external_cached == shared_with_others(name)
    # The same kind again: the whole prompt but its last block from kvtrio, for each.
    assert run(engine, "one-again", **kind(name, 1)) == 5 * CHUNK
    assert run(engine, "two-again", **kind(name, 2)) == 5 * CHUNK
    assert_no_pins(kvtrio)


@pytest.mark.parametrize("engine", [{"keys": "tokens"}], indirect=True, ids=["tokens"])
@pytest.mark.parametrize("name", ["cache_salt", "lora", "image", "prompt_embeds"])
def test_in_token_mode_such_requests_bypass_kvtrio(
    engine: Engine, kvtrio: ServerProcess, name: str
) -> None:
    """Token ids alone cannot tell such requests apart: they neither load nor store."""
    engine.add("plain", PROMPT)
    engine.run()
    wait_chunks(kvtrio, 5)
    assert run(engine, "one", **kind(name, 1)) == 0
    assert run(engine, "one-again", **kind(name, 1)) == 0
    stats = cache(kvtrio)
    assert (stats.lookups, stats.l1_ready) == (1, 5)


# --------------------------------------------------------------------------- agreeing on the hash


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor", "xxhash"])
def test_the_registered_fingerprint_is_of_vllms_own_root_hash(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch, algo: str
) -> None:
    """The connector derives vLLM's root block hash (``NONE_HASH``) as vLLM's ``init_none_hash``
    does, from PYTHONHASHSEED (or vLLM's fixed seed for SHA-256), before vLLM has set it."""
    config = make_config(model_dir, None)
    config.cache_config.prefix_caching_hash_algo = algo
    fingerprints = []
    for seed in ("1", "1", "2"):
        monkeypatch.setenv("PYTHONHASHSEED", seed)
        keys = key_scheme("engine", config, None)
        init_none_hash(get_hash_fn_by_name(algo))
        assert keys.root == kv_cache_utils.NONE_HASH
        assert keys.hash_scheme == f"blocks/{algo}/v1"
        assert len(keys.hash_seed) == 32  # a hash of the root, not the root
        assert keys.root.hex()[:32] != keys.hash_seed
        fingerprints.append(keys.hash_seed)
    assert fingerprints[0] == fingerprints[1] != fingerprints[2]
    if algo.startswith("sha256"):  # a fixed seed without PYTHONHASHSEED: engines still agree
        monkeypatch.delenv("PYTHONHASHSEED")
        keys = key_scheme("engine", config, None)
        init_none_hash(get_hash_fn_by_name(algo))
        assert keys.root == kv_cache_utils.NONE_HASH
        assert keys.hash_seed == key_scheme("engine", config, None).hash_seed


def test_a_random_root_falls_back_to_token_mode_and_says_what_to_set(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """xxhash without PYTHONHASHSEED: vLLM draws a random root per process, which no other
    engine (nor this one after a restart) could ever match."""
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    config = make_config(model_dir, None)
    config.cache_config.prefix_caching_hash_algo = "xxhash"
    with caplog.at_level(logging.WARNING, logger="kvtrio.vllm"):
        keys = key_scheme("engine", config, None)
    assert keys == KeyScheme()  # token mode
    assert "PYTHONHASHSEED" in caplog.text


def test_an_engine_with_another_seed_is_refused(
    model_dir: Path, kvtrio: ServerProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine's workers register its hash scheme and root fingerprint: an engine of the
    same model with another PYTHONHASHSEED is refused, with one line saying what to set."""
    monkeypatch.setenv("PYTHONHASHSEED", "7")
    config = make_config(model_dir, kvtrio.endpoint)
    engine = Engine(config)
    try:
        wait_for(lambda: cache(kvtrio).registrations >= 1, what="the worker to register")
        monkeypatch.setenv("PYTHONHASHSEED", "8")
        other = key_scheme("engine", config, None)
        layout = LayoutSpec("vllm_cpu", len(LAYERS), 128, BLOCK, HEADS, HEAD_DIM, "float32")
        model = config.model_config.model
        with Client(kvtrio.endpoint, timeout=2.0) as client:
            register = Register("other", model, 1, 0, layout, other.hash_scheme)
            with pytest.raises(Incompatible, match="PYTHONHASHSEED"):
                client.request(attrs.evolve(register, hash_seed=other.hash_seed))
            monkeypatch.setenv("PYTHONHASHSEED", "7")
            same = key_scheme("engine", config, None)
            client.request(attrs.evolve(register, hash_seed=same.hash_seed))  # shares
    finally:
        engine.close()


def test_an_engine_whose_root_is_not_the_registered_one_neither_loads_nor_stores(
    model_dir: Path,
    kvtrio: ServerProcess,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """vLLM sets its root after building the connector: if it is not the one the connector
    derived (and registered a fingerprint of), the connector keeps its chunks out of kvtrio."""
    monkeypatch.setenv("PYTHONHASHSEED", "1")
    engine = Engine(make_config(model_dir, kvtrio.endpoint, load_policy="always"))
    try:
        monkeypatch.setenv("PYTHONHASHSEED", "2")
        init_none_hash(get_hash_fn_by_name("sha256"))  # what the engine's hashes start from
        engine.add("r", PROMPT)
        with caplog.at_level(logging.ERROR, logger="kvtrio.vllm"):
            engine.run()
        assert "root block hash" in caplog.text
        assert cache(kvtrio).lookups == 0
        assert cache(kvtrio).l1_ready == 0
    finally:
        engine.close()
