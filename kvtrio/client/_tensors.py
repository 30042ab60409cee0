"""Engine KV tensors as the transfer path sees them: a layout and numpy views (torch is lazy)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ..transfer import KVLayout, cpu_helper, layout_kind

__all__ = ["describe_cuda_caches", "describe_kv_caches", "infer_layout_kind"]

_TORCH_DTYPES = {
    "torch.float16": "float16",
    "torch.bfloat16": "bfloat16",
    "torch.float32": "float32",
    "torch.float8_e4m3fn": "float8_e4m3fn",
    "torch.float8_e5m2": "float8_e5m2",
    "torch.uint8": "uint8",
    "torch.int8": "int8",
}


_NUMPY_DTYPES = {"float16": "float16", "float32": "float32", "uint8": "uint8", "int8": "int8"}


def infer_layout_kind(shape: tuple[int, ...], block_size: int, device: str) -> str:
    """The layout kind of a per-layer KV tensor of ``shape``; ``ValueError`` if ambiguous."""
    if len(shape) == 3 and shape[1] == block_size:
        return "mla"
    if len(shape) == 4 and shape[2] == block_size and shape[3] % 2 == 0:
        return "vllm_cpu"  # vLLM ≥ 0.32: [blocks, heads, block_size, 2 * head_dim] views
    if len(shape) == 5 and shape[2] == 2 and shape[3] == block_size and 2 not in shape[:2]:
        return "vllm_cpu"
    if len(shape) == 5:
        if shape[1] == 2 and shape[2] == block_size and shape[0] != 2:
            return "flash_infer"
        if shape[0] == 2:
            tokens_at_2, tokens_at_3 = shape[2] == block_size, shape[3] == block_size
            if tokens_at_2 and not tokens_at_3:
                return "flash_attn"
            if tokens_at_3 and not tokens_at_2:
                return "cpu"
            if tokens_at_2 and tokens_at_3:
                # heads == block size: a CPU engine uses vLLM's CPU layout.
                return "cpu" if device == "cpu" else "flash_attn"
    raise ValueError(
        f"cannot tell the KV layout of a tensor of shape {shape} with block size {block_size}; "
        "pass layout= explicitly (flash_attn, flash_infer, mla, cpu or vllm_cpu)"
    )


def describe_kv_caches(
    kv_caches: Mapping[str, Any], block_size: int, layout: str | None
) -> tuple[KVLayout, list[np.ndarray[Any, Any]]]:
    """Validate an engine's per-layer KV tensors; return their layout and numpy views of them.

    Accepts torch tensors (imported only if given) or numpy arrays. The views share memory with
    the tensors (bfloat16 and fp8 are viewed as same-size integers: the transfer copies bytes).
    Raises ``ValueError`` with what is wrong. Also readies the CPU copy helper (the first call
    of a machine compiles it: blocking, under a second).
    """
    if not kv_caches:
        raise ValueError("no KV cache tensors given")
    names = list(kv_caches)
    arrays, dtypes, device = _as_arrays(kv_caches)
    first = arrays[0]
    for name, array in zip(names, arrays, strict=True):
        if array.shape != first.shape or array.dtype != first.dtype:
            raise ValueError(f"{name}: all layers must have the same shape and dtype")
        if not array.flags.c_contiguous:
            raise ValueError(f"{name}: the KV tensor must be contiguous")
    shape = tuple(first.shape)
    kind = layout or infer_layout_kind(shape, block_size, device)
    if kind == "vllm_cpu" and len(shape) == 4 and shape[3] % 2 == 0:
        # vLLM hands over [blocks, heads, block_size, 2 * head_dim] views, but its CPU backend
        # keeps the block_size K rows first, then the V rows: the same bytes as this shape.
        shape = (shape[0], shape[1], 2, shape[2], shape[3] // 2)
        arrays = [array.reshape(shape) for array in arrays]
    num_blocks, heads, head_dim = layout_kind(kind).sizes(shape)
    kv_layout = KVLayout(
        kind=kind,
        num_layers=len(arrays),
        num_blocks=num_blocks,
        block_size=block_size,
        num_heads=heads,
        head_dim=head_dim,
        dtype=dtypes,
    )
    if tuple(kv_layout.layer_shape) != shape:
        raise ValueError(
            f"tensor shape {shape} does not match layout {kind} {kv_layout.layer_shape}"
        )
    # Build (first process only, a fraction of a second) and load the C copy helper now, at
    # registration, rather than inside the first store, where it would eat into the slots'
    # reservation time. Without it the copies fall back to numpy (logged once).
    cpu_helper()
    return kv_layout, arrays


def _as_arrays(kv_caches: Mapping[str, Any]) -> tuple[list[np.ndarray[Any, Any]], str, str]:
    """numpy views of the tensors, their dtype name, their device kind."""
    values = list(kv_caches.values())
    if all(isinstance(v, np.ndarray) for v in values):
        dtype = _NUMPY_DTYPES.get(values[0].dtype.name)
        if dtype is None:
            raise ValueError(f"unsupported KV dtype {values[0].dtype}")
        return list(values), dtype, "cpu"
    import torch  # the engine has it; kvtrio does not require it

    arrays = []
    for name, tensor in kv_caches.items():
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"{name}: expected a torch.Tensor, got {type(tensor).__name__}")
        if tensor.device.type != "cpu":
            raise ValueError(
                f"{name} lives on {tensor.device}: kvtrio serves CPU tensors (copied through the "
                "L1 arena) and CUDA tensors (copied by the server through CUDA IPC), not this"
            )
        if not tensor.is_contiguous():
            raise ValueError(f"{name}: the KV tensor must be contiguous")
        as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[
            tensor.element_size()
        ]
        arrays.append(tensor.view(as_int).numpy())
    dtype = _TORCH_DTYPES.get(str(values[0].dtype))
    if dtype is None:
        raise ValueError(f"unsupported KV dtype {values[0].dtype}")
    return arrays, dtype, "cpu"


def describe_cuda_caches(
    kv_caches: Mapping[str, Any], block_size: int, layout: str | None
) -> tuple[KVLayout, list[Any]]:
    """Validate CUDA KV tensors (one per layer); return their layout and the tensors.

    Any strides are accepted (the kernels follow them) as long as all layers share them.
    Raises ``ValueError`` with what is wrong.
    """
    if not kv_caches:
        raise ValueError("no KV cache tensors given")
    tensors = list(kv_caches.values())
    first = tensors[0]
    shape = tuple(first.shape)
    for name, tensor in kv_caches.items():
        if tuple(tensor.shape) != shape or str(tensor.dtype) != str(first.dtype):
            raise ValueError(f"{name}: all layers must have the same shape and dtype")
    dtype = _TORCH_DTYPES.get(str(first.dtype), str(first.dtype))
    if dtype not in _TORCH_DTYPES.values():
        raise ValueError(f"unsupported KV dtype {first.dtype}")
    kind = layout or infer_layout_kind(shape, block_size, "cuda")
    entry = layout_kind(kind)
    if not entry.strided or len(shape) != entry.ndim:
        raise ValueError(f"a CUDA tensor of shape {shape} cannot have layout {kind!r}")
    num_blocks, heads, head_dim = entry.sizes(shape)
    kv_layout = KVLayout(
        kind=kind,
        num_layers=len(tensors),
        num_blocks=num_blocks,
        block_size=block_size,
        num_heads=heads,
        head_dim=head_dim,
        dtype=dtype,
    )
    if tuple(kv_layout.layer_shape) != shape:
        raise ValueError(
            f"tensor shape {shape} does not match layout {kind} {kv_layout.layer_shape}"
        )
    return kv_layout, tensors
