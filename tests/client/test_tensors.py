"""How the worker adapter reads an engine's KV tensors (numpy arrays or torch tensors)."""

from __future__ import annotations

import numpy as np
import pytest

from kvtrio.client._tensors import describe_kv_caches, infer_layout_kind
from kvtrio.transfer import gather


@pytest.mark.parametrize(
    ("shape", "kind"),
    [
        ((2, 100, 16, 8, 128), "flash_attn"),
        ((100, 2, 16, 8, 128), "flash_infer"),
        ((2, 100, 8, 16, 128), "cpu"),
        ((100, 16, 576), "mla"),
        ((2, 100, 16, 16, 64), "cpu"),  # heads == block size: a CPU engine's own layout
        ((100, 8, 2, 16, 128), "vllm_cpu"),
        ((100, 8, 16, 256), "vllm_cpu"),  # vLLM ≥ 0.32 hands connectors these views
    ],
)
def test_layout_inference(shape: tuple[int, ...], kind: str) -> None:
    assert infer_layout_kind(shape, 16, "cpu") == kind


def test_ambiguous_or_unknown_shapes_ask_for_the_layout() -> None:
    with pytest.raises(ValueError, match="pass layout= explicitly"):
        infer_layout_kind((3, 100, 16, 8, 128), 16, "cpu")


def test_numpy_arrays() -> None:
    layers = {f"l{i}": np.zeros((2, 10, 16, 2, 32), np.float16) for i in range(3)}
    layout, arrays = describe_kv_caches(layers, 16, None)
    assert (layout.kind, layout.num_layers, layout.num_blocks, layout.dtype) == (
        "flash_attn",
        3,
        10,
        "float16",
    )
    assert arrays[0] is layers["l0"]


def test_inconsistent_or_unsupported_tensors_are_refused() -> None:
    with pytest.raises(ValueError, match="same shape and dtype"):
        describe_kv_caches(
            {
                "a": np.zeros((2, 10, 16, 2, 32), np.float16),
                "b": np.zeros((2, 9, 16, 2, 32), np.float16),
            },
            16,
            None,
        )
    with pytest.raises(ValueError, match="cannot have layout 'mla'"):
        describe_kv_caches({"a": np.zeros((2, 10, 16, 2, 32), np.float16)}, 16, "mla")
    with pytest.raises(ValueError, match="unsupported KV dtype"):
        describe_kv_caches({"a": np.zeros((2, 10, 16, 2, 32), np.float64)}, 16, None)
    with pytest.raises(ValueError, match="no KV cache"):
        describe_kv_caches({}, 16, None)


def test_torch_tensors_are_viewed_without_copying() -> None:
    torch = pytest.importorskip("torch")
    tensor = torch.zeros((2, 10, 2, 16, 32), dtype=torch.bfloat16)
    layout, (array,) = describe_kv_caches({"l0": tensor}, 16, None)
    assert (layout.kind, layout.dtype, layout.element_size) == ("cpu", "bfloat16", 2)
    array[0, 3] = 0x3F80  # 1.0 in bfloat16
    assert float(tensor[0, 3, 0, 0, 0]) == 1.0


def test_vllm_cpu_views_are_read_as_transposed_k_then_v_rows() -> None:
    """vLLM's [blocks, heads, block_size, 2 * head_dim] view: per block and head, the CPU
    backend's kernels keep K first, transposed ([head_dim, block_size]), then V token by token
    (tests/integration/vllm_cpu/test_layout.py checks this against the real kernels)."""
    torch = pytest.importorskip("torch")
    view = torch.zeros((10, 2, 16, 64), dtype=torch.float16)
    layout, (array,) = describe_kv_caches({"l0": view}, 16, None)
    assert (layout.kind, layout.num_blocks, layout.num_heads, layout.head_dim) == (
        "vllm_cpu",
        10,
        2,
        32,
    )
    assert array.shape == (10, 2, 2, 16, 32)
    regions = view.view(10, 2, 2, 16 * 32)  # per block and head: K's bytes, then V's
    regions[3, 1, 0].view(32, 16)[5, 7] = 1.0  # K, dim 5 of token 7
    regions[3, 1, 1].view(16, 32)[7, 6] = 2.0  # V, dim 6 of token 7
    chunk = np.zeros(layout.chunk_nbytes(16), np.uint8)
    gather(layout, [array], [3], chunk)
    canonical = chunk.view(np.float16).reshape(layout.chunk_shape(16))  # [layer, kv, t, row]
    assert canonical[0, 0, 7, 32 + 5] == 1.0
    assert canonical[0, 1, 7, 32 + 6] == 2.0
    assert np.count_nonzero(canonical) == 2


def test_tensors_off_the_cpu_are_refused_with_a_clear_message() -> None:
    torch = pytest.importorskip("torch")
    tensor = torch.empty((2, 10, 16, 2, 32), dtype=torch.float16, device="meta")
    with pytest.raises(
        ValueError, match=r"lives on meta: kvtrio serves CPU tensors .* and CUDA tensors"
    ):
        describe_kv_caches({"l0": tensor}, 16, None)
