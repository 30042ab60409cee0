"""The layout-kind registry: each entry gives the shapes and flags the old per-kind switches did."""

from __future__ import annotations

import pytest

from kvtrio.transfer import LAYOUT_KINDS, LAYOUTS, KVLayout, layout_kind
from kvtrio.transfer._geometry import GPU_LAYOUT_KINDS, KIND_AXES

BLOCKS, SIZE, HEADS, DIM = 7, 16, 3, 8

DOCUMENTED = {  # the table of kvtrio/transfer/_layouts.py
    "flash_attn": (2, BLOCKS, SIZE, HEADS, DIM),
    "flash_infer": (BLOCKS, 2, SIZE, HEADS, DIM),
    "mla": (BLOCKS, SIZE, DIM),
    "cpu": (2, BLOCKS, HEADS, SIZE, DIM),
    "vllm_cpu": (BLOCKS, HEADS, 2, SIZE, DIM),
}


def test_every_kind_is_registered_once() -> None:
    assert LAYOUT_KINDS == tuple(LAYOUTS) == tuple(DOCUMENTED)


@pytest.mark.parametrize("name", LAYOUT_KINDS)
def test_layer_shapes_and_sizes_round_trip(name: str) -> None:
    kind = layout_kind(name)
    heads = 1 if kind.latent else HEADS
    shape = kind.layer_shape(BLOCKS, SIZE, heads, DIM)
    assert shape == DOCUMENTED[name]
    assert kind.sizes(shape) == (BLOCKS, heads, DIM)
    layout = KVLayout(name, 2, BLOCKS, SIZE, heads, DIM, "float16")
    assert layout.layer_shape == shape
    assert layout.kv == (1 if name == "mla" else 2)
    assert layout.head_major == (name in ("cpu", "vllm_cpu"))


def test_the_cuda_kernels_copy_the_strided_kinds() -> None:
    assert KIND_AXES == {
        "flash_attn": (0, 1, 2, 3, 4),
        "flash_infer": (1, 0, 2, 3, 4),
        "mla": (None, 0, 1, None, 2),
        "cpu": (0, 1, 3, 2, 4),
    }
    assert "vllm_cpu" not in GPU_LAYOUT_KINDS


def test_wrong_kinds_and_shapes_say_so() -> None:
    with pytest.raises(ValueError, match="unknown layout kind 'paged'"):
        layout_kind("paged")
    with pytest.raises(ValueError, match="cannot have layout 'mla'"):
        layout_kind("mla").sizes((2, BLOCKS, SIZE, HEADS, DIM))
