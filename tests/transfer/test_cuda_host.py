"""The CUDA kernels' index arithmetic, compiled for the host, against the numpy reference.

``cuda_ext/kvtrio_index.h`` is compiled into the kernels and into the host library
(``kvtrio_host.cpp``); these tests run the host build, which executes the kernels' per-vector
body (``kvt_move``) for every vector of a chunk, and compare its bytes with the slow reference
of ``test_cpu.py`` for every layout kind the kernels copy (``vllm_cpu``, a CPU-only layout
whose K is transposed, is refused), element size, block size and odd block-id list.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvtrio.transfer import KVLayout, gather
from kvtrio.transfer._geometry import GPU_LAYOUT_KINDS, check_extent, geometry
from kvtrio.transfer._hostlib import HostLibrary

from .._support.kv_layouts import (
    BLOCK_IDS,
    NUM_BLOCKS,
    as_bytes,
    empty_chunk,
    make_layout,
    random_chunk,
    random_layers,
    reference_gather,
    reference_scatter,
)


@pytest.mark.parametrize("ids", list(BLOCK_IDS.values()), ids=list(BLOCK_IDS))
@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("element_size", [1, 2, 4])
@pytest.mark.parametrize("kind", GPU_LAYOUT_KINDS)
def test_host_copy_matches_reference(
    host_library: HostLibrary, kind: str, element_size: int, block_size: int, ids: list[int]
) -> None:
    layout = make_layout(kind, element_size, block_size)
    layers = random_layers(layout)
    before = as_bytes(layers)

    out = empty_chunk(layout, len(ids))
    host_library.gather(layout, layers, ids, out)
    assert out.tobytes() == reference_gather(layout, layers, ids).tobytes()
    assert as_bytes(layers) == before

    src = random_chunk(layout, len(ids))
    expected = [layer.copy() for layer in layers]
    reference_scatter(layout, expected, ids, src)
    host_library.scatter(layout, layers, ids, src)
    assert as_bytes(layers) == as_bytes(expected)


@pytest.mark.parametrize("kind", GPU_LAYOUT_KINDS)
@pytest.mark.parametrize(
    "make_strided",
    [
        pytest.param(np.asfortranarray, id="fortran-order"),
        pytest.param(lambda a: np.repeat(a, 2, axis=-1)[..., ::2], id="every-other-element"),
        pytest.param(lambda a: np.repeat(a, 3, axis=0)[::3], id="padded-outer-axis"),
    ],
)
def test_host_copy_of_strided_layers(
    host_library: HostLibrary, kind: str, make_strided: Any
) -> None:
    """Layers that are views with other strides (as an engine may hand over) give the same
    bytes; the vector width drops to what the strides allow."""
    layout = make_layout(kind, 2, 4)
    layers = [make_strided(layer) for layer in random_layers(layout)]
    ids = [4, 0, 6]
    out = empty_chunk(layout, len(ids))
    host_library.gather(layout, layers, ids, out)
    assert out.tobytes() == reference_gather(layout, layers, ids).tobytes()

    src = random_chunk(layout, len(ids))
    expected = [layer.copy() for layer in layers]
    reference_scatter(layout, expected, ids, src)
    host_library.scatter(layout, layers, ids, src)
    assert as_bytes(layers) == as_bytes(expected)


@pytest.mark.parametrize("kind", GPU_LAYOUT_KINDS)
@pytest.mark.parametrize("element_size", [1, 2, 4])
def test_every_byte_lands_where_the_reference_puts_it(
    host_library: HostLibrary, kind: str, element_size: int
) -> None:
    """kvt_engine_offset for every byte of a chunk, against the reference applied to a layer
    whose elements are their own offsets."""
    layout = make_layout(kind, element_size, 2, heads=3, head_dim=5)
    ids = [6, 2, 3]
    positions = np.arange(int(np.prod(layout.layer_shape)), dtype=np.int64)
    layer = positions.reshape(layout.layer_shape)
    canonical = reference_gather(layout, [layer, layer], ids)[0]  # one layer's share
    expected = (canonical.reshape(-1, 1) * element_size + np.arange(element_size)).reshape(-1)
    g = geometry(layout)
    layer_bytes = host_library.layer_bytes(g, len(ids))
    assert layer_bytes == expected.size
    assert host_library.engine_offsets(g, ids, 0, layer_bytes).tolist() == expected.tolist()


@pytest.mark.parametrize(
    ("kind", "block_size", "heads", "head_dim", "dtype", "run", "vec"),
    [
        ("flash_attn", 16, 8, 128, "float16", 16 * 8 * 128 * 2, 16),  # whole blocks, 128-bit
        ("flash_infer", 16, 8, 128, "bfloat16", 16 * 8 * 128 * 2, 16),
        ("mla", 16, 1, 576, "bfloat16", 16 * 576 * 2, 16),
        ("cpu", 16, 8, 128, "float16", 128 * 2, 16),  # head-major: one head of one token per run
        ("flash_attn", 1, 3, 3, "float16", 9 * 2, 2),  # 18-byte blocks: 2-byte moves
        ("flash_attn", 1, 1, 5, "uint8", 5, 1),
        ("mla", 1, 1, 6, "float32", 6 * 4, 8),
    ],
)
def test_runs_and_vector_width(
    host_library: HostLibrary,
    kind: str,
    block_size: int,
    heads: int,
    head_dim: int,
    dtype: str,
    run: int,
    vec: int,
) -> None:
    layout = KVLayout(kind, 2, 64, block_size, heads, head_dim, dtype)
    plan = host_library.plan(geometry(layout))
    assert (plan.run, plan.vec) == (run, vec)
    assert host_library.plan(geometry(layout), pointer_bits=0x1000 | 0x4).vec == min(vec, 4)
    assert host_library.plan(geometry(layout), pointer_bits=1).vec == 1


@pytest.mark.parametrize("offset", [1, 2, 8])
def test_misaligned_chunk_buffers_use_narrower_moves(
    host_library: HostLibrary, offset: int
) -> None:
    layout = KVLayout("flash_attn", 2, NUM_BLOCKS, 16, 2, 64, "float16")
    layers = random_layers(layout)
    ids = [5, 1]
    nbytes = layout.chunk_nbytes(32)
    arena = np.zeros(nbytes + 32, np.uint8)
    start = (-arena.ctypes.data) % 16 + offset  # 16-aligned, then `offset` bytes further
    vec = host_library.gather(layout, layers, ids, arena[start : start + nbytes])
    assert vec == offset
    assert (
        arena[start : start + nbytes].tobytes() == reference_gather(layout, layers, ids).tobytes()
    )


def test_matches_the_cpu_path_on_the_bench_shape(host_library: HostLibrary) -> None:
    """The LMCache bench geometry (8 heads × 128, fp16, 16-token blocks), fewer layers/blocks."""
    layout = KVLayout("flash_attn", 4, 64, 16, 8, 128, "float16")
    layers = random_layers(layout, dtype=np.float16)
    ids = np.random.default_rng(3).choice(64, 16, replace=False).tolist()
    ours, theirs = empty_chunk(layout, 16), empty_chunk(layout, 16)
    assert host_library.gather(layout, layers, ids, ours) == 16
    gather(layout, layers, ids, theirs)
    assert ours.tobytes() == theirs.tobytes()


@pytest.mark.parametrize("kind", ["flash_attn", "flash_infer", "mla"])
def test_scatter_skips_blocks_marked_minus_one(host_library: HostLibrary, kind: str) -> None:
    """-1 in a scatter's block ids: the engine keeps that block; its chunk bytes are not copied."""
    layout = make_layout(kind, 2, 4)
    layers = random_layers(layout)
    src = random_chunk(layout, 3)
    expected = [layer.copy() for layer in layers]
    full = [layer.copy() for layer in layers]
    reference_scatter(layout, full, [1, 5, 3], src)
    # Only block 5 (chunk block 1) and block 3 (chunk block 2) take the chunk's bytes.
    for target, source in zip(expected, full, strict=True):
        for block in (5, 3):
            if kind == "flash_attn":
                target[:, block] = source[:, block]
            else:
                target[block] = source[block]
    host_library.scatter(layout, layers, [-1, 5, 3], src)
    assert as_bytes(layers) == as_bytes(expected)


@pytest.mark.parametrize("kind", GPU_LAYOUT_KINDS)
def test_gather_writes_zeros_for_blocks_marked_minus_one(
    host_library: HostLibrary, kind: str
) -> None:
    """-1 in a gather's block ids (the tail of a prompt's partial chunk): its chunk bytes are
    zeros, whatever the buffer held (the canonical partial chunk: its blocks, then zeros)."""
    layout = make_layout(kind, 2, 4)
    layers = random_layers(layout)
    out = random_chunk(layout, 4)
    host_library.gather(layout, layers, [5, 2, -1, -1], out)
    assert out.tobytes() == reference_gather(layout, layers, [5, 2, -1, -1]).tobytes()
    expected = reference_gather(layout, layers, [5, 2, 0, 0])
    expected[:, :, 2 * layout.block_size :] = 0
    assert out.tobytes() == expected.tobytes()


def test_bad_block_ids_and_geometries_are_refused(host_library: HostLibrary) -> None:
    layout = make_layout("flash_attn", 2, 4)
    layers = random_layers(layout)
    with pytest.raises(ValueError, match="block id is out of range"):
        host_library.gather(layout, layers, [1, NUM_BLOCKS], empty_chunk(layout, 2))
    with pytest.raises(ValueError, match="block id is out of range"):
        host_library.gather(layout, layers, [1, -2], empty_chunk(layout, 2))  # -1 only
    with pytest.raises(ValueError, match="block id is out of range"):
        host_library.scatter(layout, layers, [-2], random_chunk(layout, 1))
    with pytest.raises(ValueError, match="no block ids"):
        host_library.copy(geometry(layout), [0, 0], [], 0, gather=True)
    bad = list(geometry(layout))
    bad[0] = 3
    with pytest.raises(ValueError, match="kv 1 or 2"):
        host_library.plan(bad)
    bad = list(geometry(layout))
    bad[-1] = -2
    with pytest.raises(ValueError, match="strides must not be negative"):
        host_library.plan(bad)


def test_extent_checks() -> None:
    layout = KVLayout("flash_attn", 1, 4, 2, 2, 3, "float16")
    strides = (48, 12, 6, 3, 1)
    check_extent(layout, strides, 0, 2 * 4 * 2 * 2 * 3 * 2)
    with pytest.raises(ValueError, match="beyond the 190 bytes"):
        check_extent(layout, strides, 0, 190)
    with pytest.raises(ValueError, match="beyond"):
        check_extent(layout, strides, 1, 192)
    with pytest.raises(ValueError, match="overlap"):
        check_extent(layout, (48, 12, 6, 2, 1), 0, 1 << 20)
    with pytest.raises(ValueError, match="5 axes"):
        check_extent(layout, (1, 2, 3), 0, 1 << 20)


def test_the_cpu_only_layout_is_refused_with_a_clear_message() -> None:
    layout = make_layout("vllm_cpu", 2, 16)
    with pytest.raises(ValueError, match="CPU-only layout"):
        geometry(layout)
