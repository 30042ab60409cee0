"""kvtrio and vLLM's KV cache groups: vLLM 0.33's own grouping of a model's layers
(``get_kv_cache_groups``, under the config vLLM makes for kvtrio) and the connector as vLLM's
factory builds it for each role. What the scheduler then does with the hybrid
manager on is in ``test_hybrid_groups.py``; a real engine in
``tests/integration/vllm_cpu/test_hybrid.py``."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

try:  # vLLM 0.33
    from vllm.v1.core.kv_cache_planning import get_kv_cache_groups
except ImportError:  # vLLM 0.32
    from vllm.v1.core.kv_cache_utils import get_kv_cache_groups
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
)

from kvtrio.integration._kv_groups import kv_groups, unsupported_kv_cache
from kvtrio.integration._vllm_setup import UnsupportedVllm, supported_range
from kvtrio.integration.vllm import KvtrioConnector

from ..tiny_model import write_tiny_model
from .harness import BLOCK, DTYPE, HEAD_DIM, HEADS, LAYERS, make_config

NOWHERE = "tcp://127.0.0.1:9"
"""No kvtrio server: a connector that is off never connects."""


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory) -> VllmConfig:
    return make_config(write_tiny_model(tmp_path_factory.mktemp("model")), NOWHERE)


def full(head_size: int = HEAD_DIM) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=head_size, dtype=DTYPE)


def window() -> SlidingWindowSpec:
    return SlidingWindowSpec(
        block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_DIM, dtype=DTYPE, sliding_window=64
    )


def kv_cache_config(config: VllmConfig, *specs: KVCacheSpec) -> KVCacheConfig:
    """The KV cache config vLLM makes for layers of ``specs`` (one per layer), as its engine
    core does before building the connectors."""
    layers = dict(zip(LAYERS, specs, strict=True))
    return KVCacheConfig(
        num_blocks=64, kv_cache_tensors=[], kv_cache_groups=get_kv_cache_groups(config, layers)
    )


def connector(config: VllmConfig, role: KVConnectorRole, kv: KVCacheConfig) -> KvtrioConnector:
    built: Any = KVConnectorFactory.create_connector(config=config, role=role, kv_cache_config=kv)
    assert isinstance(built, KvtrioConnector)
    return built


def test_vllm_keeps_its_hybrid_manager_for_kvtrio(config: VllmConfig) -> None:
    """kvtrio declares SupportsHMA: vLLM's config check no longer turns the hybrid manager off
    for it (in this environment vLLM's platform, which has no kernels, turns it off anyway;
    ``test_hybrid_groups.py`` runs it on)."""
    assert config.kv_transfer_config is not None
    assert KVConnectorFactory.supports_hma_config(config.kv_transfer_config)


def test_windowed_and_full_layers_come_as_one_full_attention_group(config: VllmConfig) -> None:
    kv = kv_cache_config(config, window(), full())
    (group,) = kv.kv_cache_groups
    assert type(group.kv_cache_spec) is FullAttentionSpec
    assert unsupported_kv_cache(kv) is None


def test_windowed_only_layers_keep_the_connector_on_in_every_role(config: VllmConfig) -> None:
    kv = kv_cache_config(config, window(), window())
    (group,) = kv.kv_cache_groups
    assert type(group.kv_cache_spec) is SlidingWindowSpec
    assert unsupported_kv_cache(kv) is None
    assert [g.kind for g in kv_groups(kv)] == ["window"]
    scheduler = connector(config, KVConnectorRole.SCHEDULER, kv)
    assert scheduler.off_because is None
    assert scheduler.scheduler_side.spread is not None  # window-aware loads
    scheduler.shutdown()


def test_layers_of_different_kv_shapes_turn_the_connector_off(config: VllmConfig) -> None:
    kv = kv_cache_config(config, full(HEAD_DIM), full(2 * HEAD_DIM))
    reason = unsupported_kv_cache(kv)
    assert reason is not None
    scheduler = connector(config, KVConnectorRole.SCHEDULER, kv)
    worker = connector(config, KVConnectorRole.WORKER, kv)
    assert scheduler.off_because == worker.off_because == reason
    # the worker neither registers nor connects (no server listens at NOWHERE)
    worker.register_kv_caches({name: torch.zeros(4, HEADS, BLOCK, 2 * HEAD_DIM) for name in LAYERS})
    worker.start_load_kv(None)  # type: ignore[arg-type]
    worker.wait_for_save()
    assert worker.get_finished({"r"}) == (None, None)
    assert worker.get_block_ids_with_load_errors() == set()
    assert worker.build_connector_worker_meta() is None
    for side in (scheduler, worker):
        side.shutdown()


def test_groups_of_different_block_sizes_turn_the_connector_off(config: VllmConfig) -> None:
    """Was: on, every group's blocks taken as blocks of ``cache_config.block_size`` tokens; the
    worker's registration raised ("all layers must have the same shape") and vLLM did not
    start. (vLLM gives a group of smaller pages larger blocks, as here: half the heads.)"""
    wide = SlidingWindowSpec(
        block_size=2 * BLOCK, num_kv_heads=HEADS // 2, head_size=HEAD_DIM, dtype=DTYPE,
        sliding_window=64,
    )  # fmt: skip
    groups = [KVCacheGroupSpec(list(LAYERS[:1]), full()), KVCacheGroupSpec(list(LAYERS[1:]), wide)]
    kv = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=groups)
    reason = unsupported_kv_cache(kv, BLOCK)
    assert reason is not None
    scheduler = connector(config, KVConnectorRole.SCHEDULER, kv)
    worker = connector(config, KVConnectorRole.WORKER, kv)
    assert scheduler.off_because == worker.off_because == reason
    caches = {LAYERS[0]: torch.zeros(4, HEADS, BLOCK, 2 * HEAD_DIM)}
    caches |= {name: torch.zeros(4, HEADS // 2, 2 * BLOCK, 2 * HEAD_DIM) for name in LAYERS[1:]}
    worker.register_kv_caches(caches)  # (neither described nor registered: no ValueError)
    assert worker.get_finished({"r"}) == (None, None)
    for side in (scheduler, worker):
        side.shutdown()


def test_several_groups_keep_the_connector_on(config: VllmConfig) -> None:
    kv = kv_cache_config(config, full(), full())
    two = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=kv.kv_cache_groups * 2)
    assert unsupported_kv_cache(two) is None
    assert [g.index for g in kv_groups(two)] == [0, 1]


def test_vllm_itself_refuses_a_mamba_hybrid_without_its_hybrid_manager(
    config: VllmConfig,
) -> None:
    mamba = MambaSpec(block_size=BLOCK, shapes=((4, 256), (16, 256)), dtypes=(DTYPE, DTYPE))
    with pytest.raises(ValueError, match="Failed to promote local KV cache specs"):
        kv_cache_config(config, mamba, full())


def test_a_mamba_hybrid_keeps_the_connector_on_and_misses(config: VllmConfig) -> None:
    """With the hybrid manager (``SupportsHMA``) vLLM runs a Mamba hybrid; kvtrio does not keep
    the Mamba state, so its lookups miss (without asking the server) and nothing is stored,
    but the connector stays on and vLLM keeps its hybrid manager."""
    mamba = MambaSpec(block_size=BLOCK, shapes=((4, 256), (16, 256)), dtypes=(DTYPE, DTYPE))
    config.scheduler_config.disable_hybrid_kv_cache_manager = False
    config.cache_config.kv_cache_layout = "NHD"  # (what vLLM's engine core resolves)
    try:
        kv = kv_cache_config(config, mamba, full())
    finally:
        config.scheduler_config.disable_hybrid_kv_cache_manager = True
        config.cache_config.kv_cache_layout = None
    assert [g.kind for g in kv_groups(kv)] == ["mamba", "full"]
    assert unsupported_kv_cache(kv) is None
    scheduler = connector(config, KVConnectorRole.SCHEDULER, kv)
    assert scheduler.off_because is None
    request: Any = type(
        "R",
        (),
        {
            "request_id": "r",
            "all_token_ids": list(range(100)),
            "kv_transfer_params": None,
            "status": None,
            "block_hashes": [],
        },
    )()
    assert scheduler.get_num_new_matched_tokens(request, 0) == (0, False)
    scheduler.shutdown()


def test_a_vllm_outside_the_supported_range_fails_at_connector_start_in_one_line(
    config: VllmConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's factory builds the connector in a vLLM kvtrio does not claim: it fails there,
    in one line naming the supported range (not deep in a step)."""
    import vllm

    kv = kv_cache_config(config, full(), full())
    monkeypatch.setattr(vllm, "__version__", "0.34.0")
    with pytest.raises(UnsupportedVllm) as raised:
        connector(config, KVConnectorRole.SCHEDULER, kv)
    message = str(raised.value)
    assert "\n" not in message
    assert f"vLLM {supported_range()}, not 0.34.0" in message
