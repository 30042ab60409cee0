"""The CPU copy path against a slow, explicit reference; round trips; cross-layout sharing;
validation.

The reference below is deliberately naive: Python loops over layer, K/V, block, token and head,
indexing each layout's tensor by its documented axis order. It shares no code with
``kvtrio.transfer._cpu``, which computes row indices instead.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from kvtrio.transfer import (
    DTYPE_SIZES,
    LAYOUT_KINDS,
    ChunkFormat,
    KVLayout,
    _cpu_native,
    gather,
    scatter,
)

from .._support.kv_layouts import (
    BLOCK_IDS,
    NUM_BLOCKS,
    Array,
    as_bytes,
    empty_chunk,
    make_layout,
    random_chunk,
    random_layers,
    reference_gather,
    reference_scatter,
)


@pytest.fixture(autouse=True, params=["helper", "helper-other-prefetch", "numpy"])
def copy_path(
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[str]:
    """Every test runs with the C helper (built once into a temporary cache), as this CPU runs
    it and with its prefetches to the other cache level (L1 or L2: the AMD and the Intel
    path), and with numpy."""
    helper = request.param != "numpy"
    if helper and not (shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler: the helper cannot be built")
    monkeypatch.setenv("KVTRIO_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "kvtrio-cache"))
    monkeypatch.setenv("KVTRIO_NO_EXT", "0" if helper else "1")
    _cpu_native.reset()
    loaded = _cpu_native.cpu_helper()
    assert (loaded is not None) == helper
    if loaded is not None and request.param == "helper-other-prefetch":
        levels = _cpu_native.PREFETCHES
        loaded.prefetch(levels[1 - levels.index(loaded.prefetch())])
    yield request.param
    _cpu_native.reset()


def test_reference_sanity() -> None:
    """The reference itself: flash_attn's K of block b, token o is layer[0, b, o] flattened."""
    layout = make_layout("flash_attn", 4, 2)
    layers = random_layers(layout)
    chunk = reference_gather(layout, layers, [5, 1])
    assert chunk[1, 0, 3].tobytes() == layers[1][0, 1, 1].tobytes()
    assert chunk[0, 1, 0].tobytes() == layers[0][1, 5, 0].tobytes()


# --------------------------------------------------------------------------- against the reference


@pytest.mark.parametrize("ids", list(BLOCK_IDS.values()), ids=list(BLOCK_IDS))
@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("element_size", [1, 2, 4])
@pytest.mark.parametrize("kind", LAYOUT_KINDS)
def test_gather_and_scatter_match_reference(
    kind: str, element_size: int, block_size: int, ids: list[int]
) -> None:
    layout = make_layout(kind, element_size, block_size)
    layers = random_layers(layout)
    before = as_bytes(layers)

    out = empty_chunk(layout, len(ids))
    gather(layout, layers, ids, out)
    assert out.tobytes() == reference_gather(layout, layers, ids).tobytes()
    assert as_bytes(layers) == before

    src = random_chunk(layout, len(ids))
    expected = [layer.copy() for layer in layers]
    reference_scatter(layout, expected, ids, src)
    scatter(layout, layers, np.array(ids, dtype=np.int32), src)
    assert as_bytes(layers) == as_bytes(expected)


@pytest.mark.parametrize("kind", LAYOUT_KINDS)
@pytest.mark.parametrize(
    "make_strided",
    [
        pytest.param(np.asfortranarray, id="fortran-order"),
        pytest.param(lambda a: np.repeat(a, 2, axis=-1)[..., ::2], id="every-other-element"),
    ],
)
def test_non_contiguous_layers(kind: str, make_strided: Callable[[Array], Array]) -> None:
    """Layers with other strides take the strided path and give the same bytes."""
    layout = make_layout(kind, 2, 4)
    layers = [make_strided(layer) for layer in random_layers(layout)]
    assert not any(layer.flags.c_contiguous for layer in layers)
    ids = [4, 0, 6]
    out = empty_chunk(layout, len(ids))
    if kind == "vllm_cpu":  # K is stored transposed: only whole (token, dim) regions make sense
        with pytest.raises(ValueError, match="must keep the K and the V of each block"):
            gather(layout, layers, ids, out)
        assert not out.any()
        return
    gather(layout, layers, ids, out)
    assert out.tobytes() == reference_gather(layout, layers, ids).tobytes()

    src = random_chunk(layout, len(ids))
    expected = [layer.copy() for layer in layers]
    reference_scatter(layout, expected, ids, src)
    scatter(layout, layers, ids, src)
    assert as_bytes(layers) == as_bytes(expected)


@pytest.mark.parametrize("contiguous", [True, False])
def test_unaligned_arena_slice_and_chunk_shaped_buffers(contiguous: bool) -> None:
    """A buffer at an odd offset of an arena works, and so does an array in the chunk shape."""
    layout = make_layout("cpu", 4, 2)
    layers = random_layers(layout, dtype=np.float32)
    if not contiguous:
        layers = [np.asfortranarray(layer) for layer in layers]
    ids = [2, 6]
    nbytes = layout.chunk_nbytes(4)
    arena = np.zeros(nbytes + 3, np.uint8)
    gather(layout, layers, ids, arena[1 : 1 + nbytes])
    expected = reference_gather(layout, layers, ids)
    assert arena[1 : 1 + nbytes].tobytes() == expected.tobytes()

    shaped = np.zeros(layout.chunk_shape(4), np.int32)
    gather(layout, layers, ids, shaped)
    assert shaped.tobytes() == expected.tobytes()

    copies = [layer.copy() for layer in layers]
    scatter(layout, copies, ids[::-1], expected)
    assert reference_gather(layout, copies, ids[::-1]).tobytes() == expected.tobytes()


def test_gather_accepts_repeated_blocks() -> None:
    layout = make_layout("flash_infer")
    layers = random_layers(layout)
    out = empty_chunk(layout, 3)
    gather(layout, layers, [2, 2, 0], out)
    assert out.tobytes() == reference_gather(layout, layers, [2, 2, 0]).tobytes()


def test_float16_bytes_are_copied_not_converted() -> None:
    """float16 arrays full of NaN and subnormal patterns come back bit for bit."""
    layout = KVLayout("flash_attn", 1, 4, 16, 2, 8, "float16")
    layer = np.arange(layout.layer_nbytes // 2, dtype=np.uint16).view(np.float16)
    layer = layer.reshape(layout.layer_shape)
    out = empty_chunk(layout, 2)
    gather(layout, [layer], [3, 1], out)
    target = np.zeros_like(layer)
    scatter(layout, [target], [3, 1], out)
    assert target[:, [3, 1]].tobytes() == layer[:, [3, 1]].tobytes()


# --------------------------------------------------------------------------- round trips, sharing


@pytest.mark.parametrize("kind", LAYOUT_KINDS)
def test_gather_scatter_elsewhere_gather_again(kind: str) -> None:
    layout = make_layout(kind, 2, 16)
    layers = random_layers(layout)
    first = empty_chunk(layout, 3)
    gather(layout, layers, [6, 1, 3], first)
    untouched = {b: [layer_block(layout, layer, b) for layer in layers] for b in (1, 3, 4, 6)}

    scatter(layout, layers, [0, 5, 2], first)
    again = empty_chunk(layout, 3)
    gather(layout, layers, [0, 5, 2], again)
    assert again.tobytes() == first.tobytes()
    for block, copies in untouched.items():  # blocks not scattered into did not change
        assert [layer_block(layout, layer, block) for layer in layers] == copies


def layer_block(layout: KVLayout, layer: Array, block: int) -> bytes:
    if layout.kind in ("flash_attn", "cpu"):
        return layer[:, block].tobytes()
    return layer[block].tobytes()


def test_chunks_are_shared_across_layout_kinds() -> None:
    """K/V gathered from a flash_attn engine lands where flash_infer and cpu engines keep it."""
    heads, dim, size = 3, 4, 16
    shapes = {
        kind: KVLayout(kind, 2, NUM_BLOCKS, size, heads, dim, "float16")
        for kind in ("flash_attn", "flash_infer", "cpu", "vllm_cpu")
    }
    assert len({layout.canonical() for layout in shapes.values()}) == 1
    fa = random_layers(shapes["flash_attn"], seed=5, dtype=np.uint16)
    chunk = empty_chunk(shapes["flash_attn"], 3)
    source, target = [4, 1, 6], [0, 2, 3]
    gather(shapes["flash_attn"], fa, source, chunk)

    fi = [np.zeros(shapes["flash_infer"].layer_shape, np.float16) for _ in range(2)]
    cpu = [np.zeros(shapes["cpu"].layer_shape, np.int16) for _ in range(2)]
    vcpu = [np.zeros(shapes["vllm_cpu"].layer_shape, np.int16) for _ in range(2)]
    scatter(shapes["flash_infer"], fi, target, chunk)
    scatter(shapes["cpu"], cpu, target, chunk)
    scatter(shapes["vllm_cpu"], vcpu, target, chunk)
    for layer in range(2):
        for k in range(2):
            for src_block, dst_block in zip(source, target, strict=True):
                for offset in range(size):
                    for head in range(heads):
                        expected = fa[layer][k, src_block, offset, head].tobytes()
                        assert fi[layer][dst_block, k, offset, head].tobytes() == expected
                        assert cpu[layer][k, dst_block, head, offset].tobytes() == expected
                        region = vcpu[layer][dst_block, head, k]  # K: [dim, token]
                        got = region.reshape(dim, size)[:, offset] if k == 0 else region[offset]
                        assert got.tobytes() == expected
    for kind, layers in (("flash_infer", fi), ("cpu", cpu), ("vllm_cpu", vcpu)):
        back = empty_chunk(shapes[kind], 3)
        gather(shapes[kind], layers, target, back)
        assert back.tobytes() == chunk.tobytes()


# --------------------------------------------------------------------------- layouts


def test_layout_properties() -> None:
    fa = KVLayout("flash_attn", 32, 1024, 16, 8, 128, "float16")
    assert fa.layer_shape == (2, 1024, 16, 8, 128)
    assert fa.element_size == 2
    assert fa.kv == 2
    assert fa.row_elements == 1024
    assert fa.chunk_shape(256) == (32, 2, 256, 1024)
    assert fa.chunk_nbytes(256) == 32 << 20
    assert fa.layer_nbytes == 64 << 20
    assert KVLayout("flash_infer", 1, 5, 16, 8, 128, "int8").layer_shape == (5, 2, 16, 8, 128)
    assert KVLayout("cpu", 1, 5, 16, 8, 128, "float32").layer_shape == (2, 5, 8, 16, 128)
    assert KVLayout("vllm_cpu", 1, 5, 16, 8, 128, "float32").layer_shape == (5, 8, 2, 16, 128)
    mla = KVLayout("mla", 61, 100, 64, 1, 576, "bfloat16")
    assert mla.layer_shape == (100, 64, 576)
    assert mla.kv == 1
    assert mla.chunk_shape(128) == (61, 1, 128, 576)
    assert mla.chunk_nbytes(128) == 61 * 128 * 576 * 2
    assert set(DTYPE_SIZES) == {
        "float16", "bfloat16", "float32", "float8_e4m3fn", "float8_e5m2", "uint8", "int8"
    }  # fmt: skip


def test_canonical_format() -> None:
    def layout(kind: str, **changes: Any) -> KVLayout:
        fields: dict[str, Any] = {"num_layers": 4, "num_blocks": 10, "block_size": 16}
        fields.update(num_heads=2, head_dim=64, dtype="bfloat16")
        return KVLayout(kind=kind, **{**fields, **changes})

    base = layout("flash_attn").canonical()
    assert base == ChunkFormat(num_layers=4, kv=2, row_elements=128, dtype="bfloat16")
    assert layout("flash_infer").canonical() == base
    assert layout("cpu", num_blocks=3, block_size=32).canonical() == base
    assert hash(layout("cpu").canonical()) == hash(base)
    assert layout("flash_attn", dtype="float16").canonical() != base
    assert layout("flash_attn", num_heads=4).canonical() != base
    assert layout("flash_attn", num_layers=5).canonical() != base
    assert KVLayout("mla", 4, 10, 16, 1, 128, "bfloat16").canonical() != base  # kv differs


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"kind": "paged"}, r"unknown layout kind 'paged': expected one of flash_attn, "),
        ({"dtype": "float64"}, r"unknown KV dtype 'float64'"),
        ({"num_blocks": 0}, r"num_blocks must be a positive int, got 0"),
        ({"head_dim": 1.5}, r"head_dim must be a positive int, got 1.5"),
        ({"num_layers": True}, r"num_layers must be a positive int, got True"),
        ({"kind": "mla", "num_heads": 8}, r"num_heads must be 1, got 8"),
    ],
)
def test_invalid_layouts(fields: dict[str, Any], match: str) -> None:
    valid: dict[str, Any] = {"kind": "flash_attn", "num_layers": 2, "num_blocks": 4}
    valid.update(block_size=16, num_heads=2, head_dim=8, dtype="float16")
    with pytest.raises(ValueError, match=match):
        KVLayout(**{**valid, **fields})


@pytest.mark.parametrize("tokens", [0, 8, 24, -16])
def test_chunk_tokens_must_be_whole_blocks(tokens: int) -> None:
    layout = make_layout("flash_attn", 2, 16)
    with pytest.raises(ValueError, match=rf"multiple of the block size 16, got {tokens}"):
        layout.chunk_nbytes(tokens)


LAYOUT = make_layout("flash_attn", 2, 4)


def _layers(**overrides: Any) -> list[Array]:
    return random_layers(LAYOUT, **overrides)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: gather(LAYOUT, _layers()[:1], [1], empty_chunk(LAYOUT, 1)),
         r"expected 2 layer arrays, got 1"),
        (lambda: gather(LAYOUT, [*_layers()[:1], [[0]]], [1], empty_chunk(LAYOUT, 1)),
         r"layer 1: expected a numpy array, got list"),
        (lambda: gather(LAYOUT, [a[:, :3] for a in _layers()], [1], empty_chunk(LAYOUT, 1)),
         r"layer 0: expected shape \(2, 7, 4, 2, 3\) \(flash_attn layout\), got \(2, 3, 4, 2, 3\)"),
        (lambda: gather(LAYOUT, _layers(dtype=np.float32), [1], empty_chunk(LAYOUT, 1)),
         r"layer 0: expected 2-byte elements \(bfloat16\), got dtype float32 \(4 bytes\)"),
        (lambda: gather(LAYOUT, _layers(), [1, 7], empty_chunk(LAYOUT, 2)),
         r"block ids out of range \(expected 0 ≤ id < num_blocks = 7\): 7"),
        (lambda: gather(LAYOUT, _layers(), [-1, 2, 9], empty_chunk(LAYOUT, 3)),
         r"out of range .*: -1, 9"),
        (lambda: gather(LAYOUT, _layers(), [], empty_chunk(LAYOUT, 1)),
         r"block_ids is empty"),
        (lambda: gather(LAYOUT, _layers(), [1.0], empty_chunk(LAYOUT, 1)),
         r"block_ids must be integers, got dtype float64"),
        (lambda: gather(LAYOUT, _layers(), [[1]], empty_chunk(LAYOUT, 1)),
         r"block_ids must be a 1-D sequence of ints, got shape \(1, 1\)"),
        (lambda: gather(LAYOUT, _layers(), [1, 2], empty_chunk(LAYOUT, 1)),
         r"out has 192 bytes, expected 384 for 2 block\(s\) of 4 tokens "
         r"\(chunk shape \(2, 2, 8, 6\), bfloat16\)"),
        (lambda: gather(LAYOUT, _layers(), [1], np.zeros((2, 2, 4, 6), np.float32)),
         r"out: expected 2-byte elements \(bfloat16\), got dtype float32"),
        (lambda: gather(LAYOUT, _layers(), [1], np.zeros((192, 1), np.uint8)),
         r"out must be a 1-D uint8 buffer of 192 bytes or an array of shape \(2, 2, 4, 6\), "
         r"got a uint8 array of shape \(192, 1\)"),
        (lambda: gather(LAYOUT, _layers(), [1], bytearray(192)),
         r"out must be a 1-D uint8 buffer .*, got bytearray"),
        (lambda: gather(LAYOUT, _layers(), [1], np.zeros(384, np.uint8)[::2]),
         r"out must be C-contiguous \(got strides \(2,\)\)"),
        (lambda: gather(LAYOUT, _layers(), [1], np.zeros((2, 2, 6, 4), np.int16).swapaxes(2, 3)),
         r"out must be C-contiguous"),
        (lambda: gather(LAYOUT, _layers(), [1], read_only(empty_chunk(LAYOUT, 1))),
         r"out is read-only"),
        (lambda: scatter(LAYOUT, _layers(), [3, 1, 3, 5, 1], empty_chunk(LAYOUT, 5)),
         r"block_ids must be distinct for a scatter; repeated: 1, 3"),
        (lambda: scatter(LAYOUT, [read_only(a) for a in _layers()], [1], empty_chunk(LAYOUT, 1)),
         r"layer 0: the array is read-only"),
        (lambda: scatter(LAYOUT, _layers(), [1], empty_chunk(LAYOUT, 2)),
         r"src has 384 bytes, expected 192"),
    ],
)  # fmt: skip
def test_invalid_arguments(call: Callable[[], None], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call()


def read_only(array: Array) -> Array:
    array.flags.writeable = False
    return array


def test_nothing_is_written_when_an_argument_is_wrong() -> None:
    layers = _layers()
    before = as_bytes(layers)
    bad_last = [*layers[:-1], layers[-1][:, :3]]
    with pytest.raises(ValueError, match="layer 1"):
        scatter(LAYOUT, bad_last, [0, 1], random_chunk(LAYOUT, 2))
    with pytest.raises(ValueError, match="src has"):
        scatter(LAYOUT, layers, [0, 1], random_chunk(LAYOUT, 3))
    assert as_bytes(layers) == before


@pytest.mark.parametrize("kind", ["cpu", "vllm_cpu"])
@pytest.mark.parametrize("block_size", [2, 16])
def test_head_major_gather_of_big_blocks(kind: str, block_size: int) -> None:
    """Head-major blocks of ≥ 128 KiB are gathered block by block, small ones row by row: same
    bytes."""
    layout = KVLayout(kind, 2, 5, block_size, 8, 128, "float32")  # 128 KiB blocks at 16 tokens
    layers = random_layers(layout)
    ids = [3, 0, 4]
    out = empty_chunk(layout, len(ids))
    gather(layout, layers, ids, out)
    assert out.tobytes() == reference_gather(layout, layers, ids).tobytes()
