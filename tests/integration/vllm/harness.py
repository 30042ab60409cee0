"""vLLM's real scheduler and KV-connector plumbing around a stand-in for the model's forward.

:class:`Engine` builds vLLM's own ``Scheduler`` from a ``VllmConfig`` (CPU device, a hand-written
model directory, no tokenizer, no weights), with ``KvtrioConnector`` loaded by vLLM's connector
factory from ``kv_connector_module_path`` on both sides. Each step is what vLLM's model runner
does: ``handle_preemptions``, then the forward inside ``set_forward_context`` and
``KVConnectorModelRunnerMixin._get_kv_connector_output`` (which starts the loads, queues the
stores and collects finished transfers and failed blocks), then ``update_from_output``.

The KV cache is real: one CPU tensor per layer in the shape vLLM's CPU attention backend
allocates, ``[num_blocks, heads, block_size, 2 * head_dim]`` (float32), written the way that
backend's kernels write it: per block and head, K transposed (``[head_dim, block_size]``), then
V (``[block_size, head_dim]``); ``tests/integration/vllm_cpu/test_layout.py`` checks that
packing against the real kernels. The only stand-in is the
model: its "forward" writes, for each token it computes, KV that is a function of the token and
its position (:func:`expected_kv`), and before writing it checks that the KV of every token the
request already counts as computed — by the engine, from its prefix cache or loaded from kvtrio
— is exactly that function's value. So every load is checked byte for byte where the engine
would read it.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import attrs
import torch
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer import kv_transfer_state
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.forward_context import set_forward_context
from vllm.lora.request import LoRARequest
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin

from kvtrio.integration.vllm import KvtrioConnector

from ..tiny_model import CONFIG

LAYERS = tuple(f"model.layers.{i}.self_attn.attn" for i in range(CONFIG["num_hidden_layers"]))
HEADS = CONFIG["num_key_value_heads"]
HEAD_DIM = CONFIG["head_dim"]
BLOCK = 32  # vLLM's CPU attention needs multiples of 32
DTYPE = torch.float32  # bfloat16 would pick the amx kernels on CPUs that have AMX

for _name, _value in {
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
}.items():
    os.environ.setdefault(_name, _value)


def expected_kv(
    tokens: Iterable[int], start: int, layer: int, marks: torch.Tensor | None = None
) -> torch.Tensor:
    """The KV the stand-in model computes for ``tokens`` at positions ``start, start + 1, ...``
    of layer ``layer``: ``[n, heads, 2, head_dim]`` small integers that differ with token,
    position, layer, head, K/V and dim, and with ``marks`` (per position: what else the KV
    depends on, see :func:`request_marks`)."""
    ids = torch.tensor(list(tokens), dtype=torch.int64)
    positions = torch.arange(start, start + len(ids), dtype=torch.int64)
    base = (ids * 31 + positions * 17) % 4093 + layer * 101
    if marks is not None:
        base = base + marks
    head = torch.arange(HEADS).view(1, HEADS, 1, 1) * 7
    kv = torch.arange(2).view(1, 1, 2, 1) * 3
    dim = torch.arange(HEAD_DIM).view(1, 1, 1, HEAD_DIM)
    return ((base.view(-1, 1, 1, 1) + head + kv + dim) % 251).to(DTYPE)


def make_config(
    model_dir: Path,
    url: str | None,
    *,
    prefix_caching: bool = False,
    max_batched_tokens: int = 128,
    kv_events: Any = None,
    failure_policy: str | None = "recompute",
    beside: dict[str, Any] | None = None,
    **options: Any,
) -> VllmConfig:
    """A ``VllmConfig`` for the tiny model on the CPU, with kvtrio at ``url`` as connector
    (``options`` become ``kvtrio.*`` extra-config keys; ``failure_policy`` None leaves vLLM's
    ``kv_load_failure_policy`` at its default)."""
    transfer = None
    if url is not None and beside is not None:  # kvtrio first in vLLM's MultiConnector
        alone = make_config(model_dir, url, failure_policy=failure_policy, **options)
        assert alone.kv_transfer_config is not None
        kvtrio = {
            "kv_connector": "KvtrioConnector",
            "kv_connector_module_path": "kvtrio.integration.vllm",
            "kv_role": "kv_both",
            "kv_connector_extra_config": alone.kv_transfer_config.kv_connector_extra_config,
        }
        transfer = KVTransferConfig(
            kv_connector="MultiConnector",
            kv_role="kv_both",
            **({} if failure_policy is None else {"kv_load_failure_policy": failure_policy}),
            kv_connector_extra_config={"connectors": [kvtrio, beside]},
        )
    elif url is not None:
        transfer = KVTransferConfig(
            kv_connector="KvtrioConnector",
            kv_connector_module_path="kvtrio.integration.vllm",
            kv_role="kv_both",
            **({} if failure_policy is None else {"kv_load_failure_policy": failure_policy}),
            kv_connector_extra_config={
                "kvtrio.url": url,
                "kvtrio.timeout": 2.0,
                **{f"kvtrio.{k}": v for k, v in options.items()},
            },
        )
    return VllmConfig(
        model_config=ModelConfig(
            model=str(model_dir),
            skip_tokenizer_init=True,
            dtype="float32",
            max_model_len=2048,
            seed=0,
        ),
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=prefix_caching),
        scheduler_config=SchedulerConfig(
            max_num_seqs=8,
            max_num_batched_tokens=max_batched_tokens,
            max_model_len=2048,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
        ),
        device_config=DeviceConfig("cpu"),
        kv_transfer_config=transfer,
        kv_events_config=kv_events,
    )


def _lora_id(name: str) -> int:
    return 1 + _mark(name)  # vLLM's LoRA ids are positive; one per name


def _mark(value: object) -> int:
    return int.from_bytes(hashlib.sha256(repr(value).encode()).digest()[:4], "little") % 4093


def request_marks(request: Request, end: int) -> torch.Tensor:
    """What the KV of positions ``[0, end)`` of ``request`` depends on besides its tokens, as a
    real model's would: its LoRA adapter and cache_salt (every position), an image (every
    position from the image's on) and its prompt embeddings (every position from the first
    on, each depending on the embeddings up to it). Zero for a plain request."""
    marks = torch.zeros(end, dtype=torch.int64)
    if request.lora_request is not None:
        marks += _mark((request.lora_request.lora_name, request.lora_request.lora_path))
    if request.cache_salt:
        marks += _mark(request.cache_salt)
    for feature in request.mm_features or ():
        marks[feature.mm_position.offset :] += _mark(feature.identifier)
    if request.prompt_embeds is not None:
        rows = request.prompt_embeds
        running = 0
        for position in range(min(end, len(rows))):
            running = (running * 31 + _mark(rows[position].tolist())) % 4093
            marks[position] += running
        marks[len(rows) :] += running
    return marks % 4093


@attrs.define
class Result:
    """What vLLM reported for one request."""

    output: list[int] = attrs.Factory(list)
    finish_reason: str | None = None
    local_cached: int | None = None
    """Tokens from vLLM's own prefix cache (its ``PrefillStats``)."""
    external_cached: int | None = None
    """Tokens from the connector, i.e. kvtrio."""


def _kvtrio(connector: Any) -> Any:
    """kvtrio's connector: itself, or the first of a MultiConnector's."""
    children = getattr(connector, "sub_connectors", None) or getattr(connector, "_connectors", None)
    return children[0] if children else connector


class Engine:
    """vLLM's scheduler and the connector's two sides in this process (see the module doc)."""

    def __init__(self, config: VllmConfig, *, num_blocks: int = 128) -> None:
        self.config = config
        self.num_blocks = num_blocks
        kv_cache_config = self._kv_cache_config(num_blocks)
        config.cache_config.num_gpu_blocks = num_blocks
        self.scheduler = Scheduler(
            vllm_config=config,
            kv_cache_config=kv_cache_config,
            structured_output_manager=StructuredOutputManager(config),
            block_size=BLOCK,
            log_stats=True,
        )
        self.worker: Any = None
        """The worker-side connector (kvtrio's, or the MultiConnector holding it)."""
        if config.kv_transfer_config is not None:
            assert isinstance(_kvtrio(self.scheduler.connector), KvtrioConnector)
            worker = KVConnectorFactory.create_connector(
                config=config, role=KVConnectorRole.WORKER, kv_cache_config=kv_cache_config
            )
            assert isinstance(_kvtrio(worker), KvtrioConnector)
            self.worker = worker
            kv_transfer_state._KV_CONNECTOR_AGENT = worker  # what the model runner's mixin uses
        self.kv = self._kv_tensors(num_blocks)
        if self.worker is not None:
            try:
                self.worker.register_kv_caches(self.kv)
            except BaseException:
                self.close()
                raise
        # What vLLM's EngineCore gives every request: block hashes for its prefix cache.
        hash_fn = get_hash_fn_by_name(config.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self._block_hasher = get_request_block_hasher(BLOCK, hash_fn)
        self.results: dict[str, Result] = {}
        self.requests: dict[str, Request] = {}
        self.steps: list[SchedulerOutput] = []
        self.failed_blocks: set[int] = set()
        """Blocks the workers reported as failed to load, over all steps."""
        self.connector_stats: list[dict[str, Any]] = []
        """The connector's stats of each step, as vLLM's scheduler sends them to its logger."""

    def _kv_cache_config(self, num_blocks: int) -> KVCacheConfig:
        """The KV cache config vLLM's engine core would make: one full-attention group."""
        spec = FullAttentionSpec(
            block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_DIM, dtype=DTYPE
        )
        return KVCacheConfig(
            num_blocks=num_blocks,
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(list(LAYERS), spec)],
        )

    def _kv_tensors(self, num_blocks: int) -> dict[str, torch.Tensor]:
        """The KV cache: one tensor per layer, as vLLM's CPU attention backend allocates it."""
        return {
            name: torch.zeros(num_blocks, HEADS, BLOCK, 2 * HEAD_DIM, dtype=DTYPE)
            for name in LAYERS
        }

    @property
    def connector(self) -> KvtrioConnector:
        connector = _kvtrio(self.scheduler.connector)
        assert isinstance(connector, KvtrioConnector)
        return connector

    # ----------------------------------------------------------------- requests

    def add(
        self,
        request_id: str,
        prompt: list[int],
        max_tokens: int = 4,
        *,
        cache_salt: str | None = None,
        lora: str | None = None,
        images: Iterable[tuple[str, int, int]] = (),
        prompt_embeds: torch.Tensor | None = None,
        **params: Any,
    ) -> None:
        """Submit a request (``params`` become its ``kv_transfer_params``), with a LoRA adapter
        ``lora``, ``images`` as ``(identifier, offset, length)``, or ``prompt_embeds`` (then
        ``prompt`` is ignored: vLLM counts one placeholder token 0 per embedding)."""
        sampling = SamplingParams(
            max_tokens=max_tokens,
            ignore_eos=True,
            extra_args={"kv_transfer_params": params} if params else None,
        )
        features = [
            MultiModalFeatureSpec(
                data=None,
                modality="image",
                identifier=identifier,
                mm_position=PlaceholderRange(offset=offset, length=length),
            )
            for identifier, offset, length in images
        ]
        request = Request(
            request_id,
            None if prompt_embeds is not None else list(prompt),
            sampling,
            None,
            prompt_embeds=prompt_embeds,
            mm_features=features or None,
            lora_request=None if lora is None else LoRARequest(lora, _lora_id(lora), f"/l/{lora}"),
            cache_salt=cache_salt,
            block_hasher=self._block_hasher,
        )
        self.requests[request_id] = request
        self.results[request_id] = Result()
        self.scheduler.add_request(request)

    def abort(self, request_id: str) -> None:
        self.scheduler.finish_requests(request_id, RequestStatus.FINISHED_ABORTED)

    def status(self, request_id: str) -> RequestStatus:
        return self.requests[request_id].status

    def held(self, request_id: str) -> bool:
        """Whether vLLM still holds the request (and its blocks)."""
        return request_id in self.scheduler.requests

    def free_blocks(self) -> int:
        return int(self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks())

    # ----------------------------------------------------------------- steps

    def schedule(self) -> SchedulerOutput:
        output = self.scheduler.schedule()
        self.steps.append(output)
        return output

    def execute(self, output: SchedulerOutput) -> None:
        """Run one scheduled step as vLLM's model runner does, then let the scheduler see it."""
        if self.worker is not None:
            assert output.kv_connector_metadata is not None
            self.worker.handle_preemptions(output.kv_connector_metadata)
            with (
                set_forward_context(None, self.config),
                KVConnectorModelRunnerMixin._get_kv_connector_output(output) as kv_output,
            ):
                sampled, bad = self._forward(output)
            self.failed_blocks |= kv_output.invalid_block_ids
            # A failed synchronous load leaves blocks the forward has just read: vLLM discards
            # that step for the request and recomputes, provided the blocks were reported.
            for request_id, blocks in bad.items():
                unreported = blocks - kv_output.invalid_block_ids
                assert not unreported, (
                    f"{request_id}: blocks {sorted(unreported)} hold wrong KV, not reported failed"
                )
        else:
            (sampled, bad), kv_output = self._forward(output), None
            assert not bad, f"wrong KV without a connector: {bad}"
        request_ids = list(output.num_scheduled_tokens)
        runner_output = ModelRunnerOutput(
            req_ids=request_ids,
            req_id_to_index={r: i for i, r in enumerate(request_ids)},
            sampled_token_ids=[sampled[r] for r in request_ids],
            kv_connector_output=kv_output,
        )
        for outputs in self.scheduler.update_from_output(output, runner_output).values():
            stats = outputs.scheduler_stats
            if stats is not None and stats.kv_connector_stats:
                self.connector_stats.append(stats.kv_connector_stats)
            for out in outputs.outputs:
                result = self.results[out.request_id]
                result.output.extend(out.new_token_ids)
                if out.finish_reason is not None:
                    result.finish_reason = str(out.finish_reason)
                if out.prefill_stats is not None:
                    result.local_cached = out.prefill_stats.num_local_cached_tokens
                    result.external_cached = out.prefill_stats.num_external_cached_tokens

    def step(self) -> SchedulerOutput:
        output = self.schedule()
        self.execute(output)
        return output

    def run(self, until: Callable[[], bool] | None = None, timeout: float = 30.0) -> None:
        """Step until ``until()`` (default: vLLM holds no request any more, so every delayed
        free has happened), within ``timeout`` seconds."""
        done = until or (lambda: not self.scheduler.requests)
        deadline = time.monotonic() + timeout
        while not done():
            if time.monotonic() > deadline:
                raise AssertionError(f"the engine did not get there in {timeout}s")
            self.step()
            if not self.scheduler.has_unfinished_requests():
                time.sleep(0.005)  # only transfers are left: let them progress

    # ----------------------------------------------------------------- the stand-in model

    def _layer_views(self, layer: str) -> tuple[torch.Tensor, torch.Tensor]:
        """K (``[blocks, heads, head_dim, block_size]``) and V (``[blocks, heads, block_size,
        head_dim]``) of a layer, as vLLM's CPU attention kernels keep them."""
        cache = self.kv[layer]
        blocks, heads, size, _ = cache.shape
        key = cache.view(blocks, heads, 2, HEAD_DIM, size)[:, :, 0]
        value = cache.view(blocks, heads, 2, size, HEAD_DIM)[:, :, 1]
        return key, value

    def read_kv(self, block_ids: list[int], start: int, end: int, layer: int) -> torch.Tensor:
        """The KV of positions ``[start, end)`` of a request with ``block_ids``, as
        ``[n, heads, 2, head_dim]``."""
        key, value = self._layer_views(LAYERS[layer])
        positions = torch.arange(start, end)
        blocks = torch.tensor(block_ids, dtype=torch.int64)[positions // BLOCK]
        offsets = positions % BLOCK
        k = key[blocks, :, :, offsets]  # [n, heads, head_dim]
        v = value[blocks, :, offsets]
        return torch.stack([k, v], dim=2)

    def _write_kv(
        self, block_ids: list[int], tokens: list[int], start: int, marks: torch.Tensor
    ) -> None:
        positions = torch.arange(start, start + len(tokens))
        blocks = torch.tensor(block_ids, dtype=torch.int64)[positions // BLOCK]
        offsets = positions % BLOCK
        for layer, name in enumerate(LAYERS):
            key, value = self._layer_views(name)
            kv = expected_kv(tokens, start, layer, marks)
            key[blocks, :, :, offsets] = kv[:, :, 0]
            value[blocks, :, offsets] = kv[:, :, 1]

    def _forward(self, output: SchedulerOutput) -> tuple[dict[str, list[int]], dict[str, set[int]]]:
        """Check the KV of what each request counts as computed, write the KV of the tokens
        computed now, sample. Returns the sampled tokens and, per request, the blocks whose
        KV was wrong (the caller decides whether that was allowed)."""
        sampled: dict[str, list[int]] = {}
        bad: dict[str, set[int]] = {}
        for request_id, num_new in output.num_scheduled_tokens.items():
            request = self.scheduler.requests[request_id]
            (block_ids,) = self.scheduler.kv_cache_manager.get_block_ids(request_id)
            end = request.num_computed_tokens  # vLLM counts this step's tokens already
            start = end - num_new
            tokens = list(request.all_token_ids)
            marks = request_marks(request, end)
            for layer in range(len(LAYERS)):
                have = self.read_kv(block_ids, 0, start, layer)
                want = expected_kv(tokens[:start], 0, layer, marks[:start])
                wrong = (have != want).flatten(1).any(1).nonzero().flatten().tolist()
                if wrong:
                    bad.setdefault(request_id, set()).update(block_ids[p // BLOCK] for p in wrong)
            self._write_kv(block_ids, tokens[start:end], start, marks[start:end])
            done_prefill = end >= request.num_tokens
            sampled[request_id] = [100 + sum(tokens[-3:]) % 800] if done_prefill else []
        return sampled, bad

    def load_failures(self) -> dict[str, int]:
        """The worker adapter's failed retrieves by cause (chunks), for assertion messages."""
        if self.worker is None:
            return {}
        failures: dict[str, int] = _kvtrio(self.worker)._worker.adapter.metrics()[
            "retrieve_failures"
        ]
        return failures

    def close(self) -> None:
        """Shut both connector sides down (the worker first: it finishes queued transfers)."""
        if self.worker is not None:
            kv_transfer_state.ensure_kv_transfer_shutdown()
            self.worker = None
            self.scheduler.connector.shutdown()
