"""The operation kernel's descriptors and index arithmetic, on the host, against the reference.

One launch copies every chunk of an operation (``kvt_move_unit`` of ``cuda_ext/kvtrio_batch.h``
for every segment and unit). The host library runs that body over host memory, so these tests
check what the kernel would copy: several chunks at scattered places in host memory (as L1 slots
are), chunks cut where two pinned pieces of the arena meet, partial retrieves and partial chunks
(block id -1: left alone in a scatter, zeros in a gather), every layout kind the kernels copy,
and the checks the launcher makes before launching anything.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvtrio.transfer import KVLayout
from kvtrio.transfer._batch import SEGMENT_DTYPE, Operation, PinnedHost, staged_segments
from kvtrio.transfer._geometry import GPU_LAYOUT_KINDS, geometry
from kvtrio.transfer._hostlib import HostLibrary

from .._support.kv_layouts import (
    make_layout,
    random_layers,
    reference_gather,
    reference_scatter,
)

CHUNKS = [[5, 0, 2], [6], [1, 3, 4]]


class Pinner:
    """Records what is pinned (no CUDA here: the host library's "device addresses" are host
    addresses)."""

    def __init__(self) -> None:
        self.pinned: dict[int, int] = {}

    def pin(self, memory: Any) -> int:
        address = int(memory.__array_interface__["data"][0])
        self.pinned[address] = memory.nbytes
        return address

    def unpin(self, token: int) -> None:
        del self.pinned[token]


def arena(nbytes: int, piece_bytes: int) -> PinnedHost:
    host = PinnedHost(Pinner(), np.zeros(nbytes, np.uint8), piece_bytes)
    host.map(0, lambda address: address)
    return host


def arena_for(op: Operation, piece_bytes: int) -> PinnedHost:
    return arena(int((op.offsets + op.nbytes).max()) + 64, piece_bytes)


def layer_setup(layout: KVLayout) -> tuple[list[Any], tuple[int, ...], list[int]]:
    layers = random_layers(layout)
    g = geometry(layout, [s // layout.element_size for s in layers[0].strides])
    return layers, g, [int(a.__array_interface__["data"][0]) for a in layers]


def operation(layout: KVLayout, chunks: list[list[int]], offsets: list[int]) -> Operation:
    sizes = [layout.chunk_nbytes(len(ids) * layout.block_size) for ids in chunks]
    return Operation.of([(ids, o, n) for ids, o, n in zip(chunks, offsets, sizes, strict=True)])


def scattered_offsets(layout: KVLayout, chunks: list[list[int]], gap: int = 48) -> list[int]:
    """Offsets of the chunks in host memory, out of order and with gaps (as L1 slots are)."""
    sizes = [layout.chunk_nbytes(len(ids) * layout.block_size) for ids in chunks]
    offsets, at = [0] * len(chunks), gap
    for i in reversed(range(len(chunks))):
        offsets[i] = at
        at += sizes[i] + gap
    return offsets


def test_the_segment_layout_matches_the_compiler(host_library: HostLibrary) -> None:
    assert SEGMENT_DTYPE.itemsize == host_library.segment_bytes == 32


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("element_size", [1, 2, 4])
@pytest.mark.parametrize("kind", GPU_LAYOUT_KINDS)
def test_one_launch_gathers_and_scatters_every_chunk(
    host_library: HostLibrary, kind: str, element_size: int, block_size: int
) -> None:
    layout = make_layout(kind, element_size, block_size)
    layers, g, bases = layer_setup(layout)
    offsets = scattered_offsets(layout, CHUNKS)
    op = operation(layout, CHUNKS, offsets)
    host = arena_for(op, 1 << 30)

    host_library.run(g, bases, op.ids, host.segments(op, 0), gather=True)
    for ids, offset, nbytes in zip(CHUNKS, offsets, op.nbytes.tolist(), strict=True):
        got = host.memory[offset : offset + nbytes].tobytes()
        assert got == reference_gather(layout, layers, ids).tobytes(), ids

    targets = [[0, 1, 2], [3], [4, 5, 6]]
    expected = [layer.copy() for layer in layers]
    for ids, offset, nbytes in zip(targets, offsets, op.nbytes.tolist(), strict=True):
        reference_scatter(layout, expected, ids, host.memory[offset : offset + nbytes])
    back = operation(layout, targets, offsets)
    host_library.run(g, bases, back.ids, host.segments(back, 0), gather=False)
    assert [a.tobytes() for a in layers] == [a.tobytes() for a in expected]


class Shadow:
    """Device addresses of pinned pieces that are *not* one range: piece k is mapped to
    ``gap`` bytes past the end of piece k - 1 in a separate buffer (the host library reads and
    writes that buffer, as a GPU would its mapping)."""

    def __init__(self, host: PinnedHost, gap: int = 32) -> None:
        self.host, self.stride = host, host.piece_bytes + gap
        pieces = -(-host.memory.nbytes // host.piece_bytes)
        self.buffer = np.zeros(pieces * self.stride, np.uint8)

    def mapped_address(self, address: int) -> int:
        piece = (address - self.host.address) // self.host.piece_bytes
        return int(self.buffer.ctypes.data) + piece * self.stride

    def positions(self, offset: int, nbytes: int) -> Any:
        at = np.arange(offset, offset + nbytes)
        piece_bytes = self.host.piece_bytes
        return at // piece_bytes * self.stride + at % piece_bytes


@pytest.mark.parametrize("piece_bytes", [64, 96, 160, 1 << 20])
@pytest.mark.parametrize("kind", GPU_LAYOUT_KINDS)
def test_chunks_cut_where_pinned_pieces_meet(
    host_library: HostLibrary, kind: str, piece_bytes: int
) -> None:
    """An L1 slot that straddles two pinned pieces whose device addresses are not contiguous is
    two segments (or more, with small pieces); the bytes land where each piece's mapping says,
    and units cut by a segment's end are split."""
    layout = make_layout(kind, 2, 4)
    layers, g, bases = layer_setup(layout)
    offsets = scattered_offsets(layout, CHUNKS, gap=16)
    op = operation(layout, CHUNKS, offsets)
    host = PinnedHost(Pinner(), np.zeros(int((op.offsets + op.nbytes).max()) + 64, np.uint8),
                      piece_bytes)  # fmt: skip
    shadow = Shadow(host)
    host.map(0, shadow.mapped_address)
    segments = host.segments(op, 0)
    if piece_bytes < 1 << 20:
        assert len(segments) > op.chunks
    else:
        assert len(segments) == op.chunks
    assert segments["length"].sum() == op.nbytes.sum()

    host_library.run(g, bases, op.ids, segments, gather=True)
    for ids, offset, nbytes in zip(CHUNKS, offsets, op.nbytes.tolist(), strict=True):
        got = shadow.buffer[shadow.positions(offset, nbytes)].tobytes()
        assert got == reference_gather(layout, layers, ids).tobytes()

    expected = [layer.copy() for layer in layers]
    targets = [[6, 5, 4], [3], [2, 1, 0]]
    for ids, offset, nbytes in zip(targets, offsets, op.nbytes.tolist(), strict=True):
        reference_scatter(layout, expected, ids, shadow.buffer[shadow.positions(offset, nbytes)])
    back = operation(layout, targets, offsets)
    host_library.run(g, bases, back.ids, host.segments(back, 0), gather=False)
    assert [a.tobytes() for a in layers] == [a.tobytes() for a in expected]


def test_one_address_range_needs_no_cut() -> None:
    """With UVA (device address = host address) a chunk over two pieces stays one segment."""
    host = arena(4096, 1024)
    op = Operation.of([([1, 2], 1000, 100)])
    segments = host.segments(op, 0)
    assert len(segments) == 1
    assert int(segments["address"][0]) == host.address + 1000


@pytest.mark.parametrize("kind", GPU_LAYOUT_KINDS)
def test_a_partial_retrieve_leaves_the_engines_blocks_alone(
    host_library: HostLibrary, kind: str
) -> None:
    layout = make_layout(kind, 2, 16)
    layers, g, bases = layer_setup(layout)
    chunks = [[-1, -1, 2], [4, -1, 6]]
    offsets = scattered_offsets(layout, chunks)
    op = operation(layout, chunks, offsets)
    host = arena_for(op, 1 << 30)
    host.memory[...] = np.random.default_rng(3).integers(0, 256, host.memory.nbytes, np.uint8)
    expected = [layer.copy() for layer in layers]
    for ids, offset, nbytes in zip(chunks, offsets, op.nbytes.tolist(), strict=True):
        reference_scatter(layout, expected, ids, host.memory[offset : offset + nbytes])
    host_library.run(g, bases, op.ids, host.segments(op, 0), gather=False)
    assert [a.tobytes() for a in layers] == [a.tobytes() for a in expected]


@pytest.mark.parametrize("piece_bytes", [64, 96, 1 << 20])
@pytest.mark.parametrize("kind", GPU_LAYOUT_KINDS)
def test_a_partial_chunk_is_gathered_with_zeros_after_its_blocks(
    host_library: HostLibrary, kind: str, piece_bytes: int
) -> None:
    """A store's last chunk may be the prompt's partial chunk: its trailing block ids are -1,
    and the launch writes zeros for them, so the slot holds the canonical partial chunk (its
    blocks, then zeros) whatever it held before, also where pinned pieces cut the slot."""
    layout = make_layout(kind, 2, 4)
    layers, g, bases = layer_setup(layout)
    chunks = [[5, 0, 2], [6, 1, -1], [3, -1, -1]]
    offsets = scattered_offsets(layout, chunks, gap=16)
    op = operation(layout, chunks, offsets)
    host = PinnedHost(Pinner(), np.zeros(int((op.offsets + op.nbytes).max()) + 64, np.uint8),
                      piece_bytes)  # fmt: skip
    shadow = Shadow(host)
    host.map(0, shadow.mapped_address)
    shadow.buffer[...] = np.random.default_rng(5).integers(0, 256, shadow.buffer.nbytes, np.uint8)
    host_library.run(g, bases, op.ids, host.segments(op, 0), gather=True)
    for ids, offset, nbytes in zip(chunks, offsets, op.nbytes.tolist(), strict=True):
        got = shadow.buffer[shadow.positions(offset, nbytes)].tobytes()
        assert got == reference_gather(layout, layers, ids).tobytes(), ids
    last = shadow.buffer[shadow.positions(offsets[2], int(op.nbytes[2]))]
    tokens = last.reshape((*layout.chunk_shape(3 * layout.block_size), -1))
    assert not tokens[:, :, layout.block_size :].any()  # zeros after its one block


def test_staged_partial_chunks_hide_what_the_staging_buffer_held(
    host_library: HostLibrary,
) -> None:
    """Staged: a partial chunk gathered into a staging buffer that held another chunk shows
    zeros after its blocks, not the other chunk's bytes (the copy engine moves whole slots)."""
    layout = make_layout("flash_attn", 2, 16)
    layers, g, bases = layer_setup(layout)
    staging = np.zeros(layout.chunk_nbytes(3 * layout.block_size), np.uint8)
    full = operation(layout, [[1, 3, 4]], [0])
    host_library.run(g, bases, full.ids, staged_segments(full, staging.ctypes.data), gather=True)
    assert staging.any()
    part = operation(layout, [[6, -1, -1]], [0])
    host_library.run(g, bases, part.ids, staged_segments(part, staging.ctypes.data), gather=True)
    assert staging.tobytes() == reference_gather(layout, layers, [6, -1, -1]).tobytes()


@pytest.mark.parametrize(
    ("max_segments", "max_ids", "launches"), [(128, 2048, 1), (2, 2048, 3), (128, 4, 3), (1, 3, 5)]
)
def test_operations_bigger_than_a_launch_are_cut(
    host_library: HostLibrary, max_segments: int, max_ids: int, launches: int
) -> None:
    """The launcher's cut (kvt_next_launch) of an operation into launches of at most so many
    segments and ids, each launch's ids rebased: the bytes are the same as in one launch."""
    layout = make_layout("flash_infer", 2, 4)
    layers, g, bases = layer_setup(layout)
    chunks = [[5, 0], [2], [6, 1, 3], [4], [0, 2]]
    offsets = scattered_offsets(layout, chunks)
    op = operation(layout, chunks, offsets)
    host = arena_for(op, 1 << 30)
    segments = host.segments(op, 0)
    got = host_library.run_launches(g, bases, op.ids, segments, gather=True,
                                    max_segments=max_segments, max_ids=max_ids)  # fmt: skip
    assert got == launches
    for ids, offset, nbytes in zip(chunks, offsets, op.nbytes.tolist(), strict=True):
        got_bytes = host.memory[offset : offset + nbytes].tobytes()
        assert got_bytes == reference_gather(layout, layers, ids).tobytes()

    expected = [layer.copy() for layer in layers]
    targets = [[-1, 6], [5], [4, -1, 3], [2], [1, 0]]
    for ids, offset, nbytes in zip(targets, offsets, op.nbytes.tolist(), strict=True):
        reference_scatter(layout, expected, ids, host.memory[offset : offset + nbytes])
    back = operation(layout, targets, offsets)
    host_library.run_launches(g, bases, back.ids, host.segments(back, 0), gather=False,
                              max_segments=max_segments, max_ids=max_ids)  # fmt: skip
    assert [a.tobytes() for a in layers] == [a.tobytes() for a in expected]
    with pytest.raises(ValueError, match="segment"):  # a chunk of more ids than a launch holds
        host_library.run_launches(g, bases, op.ids, segments, gather=True, max_segments=8,
                                  max_ids=2)  # fmt: skip


def test_staged_segments_pack_the_chunks(host_library: HostLibrary) -> None:
    layout = make_layout("flash_attn", 2, 16)
    layers, g, bases = layer_setup(layout)
    op = operation(layout, CHUNKS, [0, 0, 0])  # host offsets do not matter when staged
    staging = np.zeros(int(op.nbytes.sum()), np.uint8)
    host_library.run(g, bases, op.ids, staged_segments(op, staging.ctypes.data), gather=True)
    expected = b"".join(reference_gather(layout, layers, ids).tobytes() for ids in CHUNKS)
    assert staging.tobytes() == expected


def test_unit_and_vector_width_of_the_bench_shape(host_library: HostLibrary) -> None:
    """flash_attn with 16-byte aligned memory: whole blocks are runs, 4 × 16-byte vectors per
    unit (64 bytes a thread moves with four loads in flight)."""
    layout = KVLayout("flash_attn", 2, 8, 16, 8, 128, "float16")
    _layers, g, bases = layer_setup(layout)
    op = operation(layout, [[3, 1]], [0])
    host = arena_for(op, 1 << 30)
    assert host_library.run(g, bases, op.ids, host.segments(op, 0), gather=True) == (16, 4)


def test_the_launcher_checks_ids_and_segments(host_library: HostLibrary) -> None:
    layout = make_layout("flash_attn", 2, 4)
    _layers, g, bases = layer_setup(layout)
    host = arena(1 << 16, 1 << 30)
    before = host.memory.copy()

    def run(chunks: list[list[int]], *, gather: bool, **changes: Any) -> None:
        op = operation(layout, chunks, [0] * len(chunks))
        segments = host.segments(op, 0)
        for field, value in changes.items():
            segments[field][0] = value
        host_library.run(g, bases, op.ids, segments, gather=gather)

    with pytest.raises(ValueError, match="out of range"):
        run([[1, 7]], gather=True)
    with pytest.raises(ValueError, match="out of range"):
        run([[1, -2]], gather=True)  # -1 is the only negative id (no block: zeros)
    with pytest.raises(ValueError, match="out of range"):
        run([[1, -2]], gather=False)
    with pytest.raises(ValueError, match="segment"):
        run([[1, 2]], gather=True, length=1 << 20)  # beyond its chunk
    with pytest.raises(ValueError, match="segment"):
        run([[1, 2]], gather=True, first_id=1)  # ids beyond the operation's
    with pytest.raises(ValueError, match="no block ids"):
        host_library.run(g, bases, np.zeros(0, np.int32), np.zeros(0, SEGMENT_DTYPE),
                         gather=True)  # fmt: skip
    assert host.memory.tobytes() == before.tobytes()


def test_operations_from_slots_and_their_parts() -> None:
    op = Operation.of([([4, 5], 128, 10), ([6], 0, 5), ([7, 8, 9], 64, 15)])
    assert op.ids.dtype == np.int32
    assert op.ids.tolist() == [4, 5, 6, 7, 8, 9]
    assert op.first_ids.tolist() == [0, 2, 3]
    part = op.select(1, 3)
    assert part.ids.tolist() == [6, 7, 8, 9]
    assert part.offsets.tolist() == [0, 64]
    assert part.nbytes.tolist() == [5, 15]
    with pytest.raises(ValueError, match="outside the pinned memory"):
        arena(100, 1 << 30).segments(op, 0)
