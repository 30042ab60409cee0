"""The optional C helper for ``vllm_cpu`` against the numpy path and the reference; its lazy
build, its cache and the numpy fallback when it cannot be built."""

from __future__ import annotations

import contextlib
import logging
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from kvtrio.transfer import KVLayout, gather, scatter, scatter_parts
from kvtrio.transfer import _cpu_native as native

from .._support.kv_layouts import DTYPES, as_bytes, reference_gather, reference_scatter

Array = npt.NDArray[Any]

needs_compiler = pytest.mark.skipif(
    not (shutil.which("cc") or shutil.which("gcc")), reason="no C compiler"
)


@pytest.fixture(autouse=True)
def _fresh_helper(
    monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[None]:
    """Each test decides anew whether the helper loads; built once per session in a temp cache."""
    monkeypatch.setenv("KVTRIO_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "kvtrio-cache"))
    monkeypatch.delenv("KVTRIO_NO_EXT", raising=False)
    native.reset()
    yield
    native.reset()


def layout_of(element_size: int, block_size: int, heads: int, head_dim: int) -> KVLayout:
    return KVLayout("vllm_cpu", 3, 9, block_size, heads, head_dim, DTYPES[element_size][0])


def layers_of(layout: KVLayout, seed: int = 0, spread: bool = False) -> list[Array]:
    rng = np.random.default_rng(seed)
    dtype = np.dtype(DTYPES[layout.element_size][1])
    blocks, heads, kv, size, dim = layout.layer_shape
    shape = (blocks, heads + 1, kv + 1, size, dim) if spread else layout.layer_shape
    out = []
    for _ in range(layout.num_layers):
        full = rng.integers(0, 256, int(np.prod(shape)) * dtype.itemsize, dtype=np.uint8)
        array = full.view(dtype).reshape(shape)
        out.append(array[:, :heads, :kv] if spread else array)  # spread: gaps between heads, K/V
    return out


def both_paths(layout: KVLayout, layers: list[Array], ids: list[int], seed: int) -> list[bytes]:
    """Gather, check against the reference, scatter a random chunk; return the layers' bytes."""
    out = np.zeros(layout.chunk_nbytes(len(ids) * layout.block_size), np.uint8)
    gather(layout, layers, ids, out)
    assert out.tobytes() == reference_gather(layout, layers, ids).tobytes()
    src = np.random.default_rng(seed).integers(0, 256, out.size, dtype=np.uint8)
    expected = [layer.copy() for layer in layers]
    reference_scatter(layout, expected, ids, src)
    scatter(layout, layers, np.array(ids, dtype=np.int16), src)
    assert as_bytes(layers) == as_bytes(expected)
    return as_bytes(layers)


@needs_compiler
@pytest.mark.parametrize("spread", [False, True], ids=["contiguous", "gaps-between-heads"])
@pytest.mark.parametrize(
    ("block_size", "heads", "head_dim"),
    [(16, 2, 16), (8, 1, 8), (5, 3, 6), (12, 2, 20), (1, 1, 1), (32, 1, 24)],
)
@pytest.mark.parametrize("element_size", [1, 2, 4])
def test_helper_matches_reference_and_numpy(
    element_size: int, block_size: int, heads: int, head_dim: int, spread: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """Tile edges (sizes not multiples of 8), every element size, strided blocks: same bytes as
    the reference, and as the numpy path on the same input."""
    layout = layout_of(element_size, block_size, heads, head_dim)
    ids = [7, 0, 3, 8]
    assert native.cpu_helper() is not None
    with_helper = both_paths(layout, layers_of(layout, spread=spread), ids, seed=5)
    monkeypatch.setenv("KVTRIO_NO_EXT", "1")
    native.reset()
    assert native.cpu_helper() is None
    assert both_paths(layout, layers_of(layout, spread=spread), ids, seed=5) == with_helper


@needs_compiler
@pytest.mark.parametrize("isa", native.ISAS)
@pytest.mark.parametrize(
    ("block_size", "heads", "head_dim"),
    [(32, 3, 64), (48, 1, 40), (17, 2, 33), (64, 1, 8)],
    ids=["smollm2", "tiles-and-edges", "odd", "short-heads"],
)
@pytest.mark.parametrize("element_size", [1, 2, 4])
def test_every_instruction_set_matches_the_reference(
    element_size: int, block_size: int, heads: int, head_dim: int, isa: str
) -> None:
    """Whole tiles for every element size (AVX2's tiles of bytes take 32 rows), their edges, and
    heads narrower than a tile, on each instruction set this CPU has; gaps between heads too.
    ``smollm2`` is SmolLM2-135M's shape (vLLM CPU: 32 tokens a block, 3 KV heads of 64)."""
    helper = native.cpu_helper()
    assert helper is not None
    used = helper.isa(isa)
    assert native.ISAS.index(used) <= native.ISAS.index(isa)
    if used != isa:
        pytest.skip(f"this CPU has no {isa}")
    layout = layout_of(element_size, block_size, heads, head_dim)
    both_paths(layout, layers_of(layout, seed=2, spread=True), [6, 1, 8], seed=7)


def aligned_bytes(nbytes: int, offset: int) -> Array:
    """A zeroed ``uint8`` buffer of ``nbytes`` whose address is ``offset`` mod 64."""
    raw = np.zeros(nbytes + 128, np.uint8)
    start = (offset - raw.ctypes.data) % 64
    return raw[start : start + nbytes]


@needs_compiler
@pytest.mark.parametrize("offset", [0, 16, 2])
@pytest.mark.parametrize("head_dim", [64, 40])
def test_buffers_at_any_alignment(offset: int, head_dim: int) -> None:
    """Rows of whole cache lines into a chunk at 0 mod 64 take non-temporal stores, the others
    plain ones, and scatters stream into layers only from 16-byte boundaries: same bytes at
    every alignment of the chunk and of the layers."""
    layout = layout_of(2, 16, 2, head_dim)
    ids = [3, 8, 0]
    layers = []
    for layer in layers_of(layout, seed=4):
        moved = aligned_bytes(layer.nbytes, offset).view(layer.dtype).reshape(layer.shape)
        moved[...] = layer
        layers.append(moved)
    out = aligned_bytes(layout.chunk_nbytes(len(ids) * 16), offset)
    assert native.cpu_helper() is not None
    gather(layout, layers, ids, out)
    assert out.tobytes() == reference_gather(layout, layers, ids).tobytes()
    out[...] = np.random.default_rng(9).integers(0, 256, out.size, dtype=np.uint8)
    expected = [layer.copy() for layer in layers]
    reference_scatter(layout, expected, ids, out)
    scatter(layout, layers, ids, out)
    assert as_bytes(layers) == as_bytes(expected)


@needs_compiler
def test_the_instruction_set_can_be_capped_and_reset_lifts_the_cap() -> None:
    helper = native.cpu_helper()
    assert helper is not None
    best = helper.isa()
    assert best in native.ISAS
    assert helper.isa("scalar") == "scalar"
    assert helper.isa() == "scalar"
    with pytest.raises(ValueError, match="unknown instruction set"):
        helper.isa("avx512")
    native.reset()
    helper = native.cpu_helper()
    assert helper is not None
    assert helper.isa() == best


def cpu_vendor() -> str:
    """``vendor_id`` of /proc/cpuinfo (``""`` where there is none)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("vendor_id"):
                return line.split(":", 1)[1].strip()
    return ""


@needs_compiler
def test_prefetches_go_to_l2_on_amd_and_to_l1_elsewhere_and_reset_restores_that() -> None:
    """The CPU's default (L2 where prefetches into L1 stalled the copies: AMD), a level set for
    the rest of the process, and :func:`reset` back to the default."""
    helper = native.cpu_helper()
    assert helper is not None
    default = "l2" if cpu_vendor() == "AuthenticAMD" else "l1"
    assert helper.prefetch() == default
    other = "l1" if default == "l2" else "l2"
    assert helper.prefetch(other) == other
    assert helper.prefetch() == other
    with pytest.raises(ValueError, match="unknown prefetch level"):
        helper.prefetch("l3")
    native.reset()
    helper = native.cpu_helper()
    assert helper is not None
    assert helper.prefetch() == default


def test_base_addresses_are_kept_only_while_their_arrays_live() -> None:
    """The same arrays (in any list) give the cached addresses; new arrays, even ones that reuse
    a dead array's id, and views of the same memory get their own."""
    layers = [np.zeros(64, np.uint8) for _ in range(3)]
    first = native._bases(layers)
    assert first.tolist() == [layer.ctypes.data for layer in layers]
    assert native._bases(list(layers)) is first
    shifted = [layers[0][16:], *layers[1:]]
    assert native._bases(shifted)[0] == layers[0].ctypes.data + 16
    del shifted
    reused = 0
    for _ in range(20):  # fresh arrays, often at a dead one's id (and not always its address)
        ids = [id(layer) for layer in layers]
        del layers
        layers = [np.zeros(128, np.uint8) for _ in range(3)]
        reused += [id(layer) for layer in layers] == ids
        assert native._bases(layers).tolist() == [layer.ctypes.data for layer in layers]
    assert reused  # the case this test is about happened


@needs_compiler
def test_gather_of_repeated_blocks_and_layers_with_different_strides() -> None:
    layout = layout_of(2, 16, 2, 16)
    layers = layers_of(layout)
    layers[1] = layers_of(layout, seed=3, spread=True)[1]  # one layer strided differently
    assert native.cpu_helper() is not None
    ids = [2, 2, 5]
    out = np.zeros(layout.chunk_nbytes(len(ids) * 16), np.uint8)
    gather(layout, layers, ids, out)
    assert out.tobytes() == reference_gather(layout, layers, ids).tobytes()


@needs_compiler
def test_wrong_arguments_are_refused_before_the_helper_writes() -> None:
    layout = layout_of(2, 16, 2, 16)
    layers = layers_of(layout)
    before = as_bytes(layers)
    src = np.ones(layout.chunk_nbytes(32), np.uint8)
    with pytest.raises(ValueError, match="out of range"):
        scatter(layout, layers, [1, 9], src)
    with pytest.raises(ValueError, match="distinct"):
        scatter(layout, layers, [1, 1], src)
    with pytest.raises(ValueError, match="bytes, expected"):
        scatter(layout, layers, [1], src)
    assert as_bytes(layers) == before


def parts_of(layout: KVLayout, seed: int) -> tuple[list[tuple[list[int], Array, int]], Array]:
    """Three parts (a whole chunk of 2 blocks, blocks 1-2 of a chunk of 4, the first block of
    a chunk of 3) and the chunk of 4 blocks their bytes make when cut out contiguously."""
    rng = np.random.default_rng(seed)
    size = layout.chunk_nbytes(layout.block_size)
    chunks = [rng.integers(0, 256, n * size, dtype=np.uint8) for n in (2, 4, 3)]
    parts = [([4, 0], chunks[0], 0), ([8, 2], chunks[1], 1), ([6], chunks[2], 0)]
    blocks = []
    for ids, chunk, first in parts:
        rows = chunk.reshape(layout.num_layers, layout.kv, -1, size // layout.num_layers // 2)
        blocks.append(rows[:, :, first : first + len(ids)])
    return parts, np.ascontiguousarray(np.concatenate(blocks, axis=2)).reshape(-1)


@needs_compiler
@pytest.mark.parametrize("spread", [False, True], ids=["contiguous", "gaps-between-heads"])
@pytest.mark.parametrize("element_size", [1, 4])
def test_scatter_parts_is_a_scatter_of_the_parts_blocks(
    element_size: int, spread: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One call for several chunks and parts of chunks (a retrieve's partial last chunk): the
    same bytes as one scatter of those blocks cut out, with the helper and with numpy."""
    layout = layout_of(element_size, 5, 3, 6)
    parts, joined = parts_of(layout, seed=2)
    expected = layers_of(layout, seed=1, spread=spread)
    reference_scatter(layout, expected, [4, 0, 8, 2, 6], joined)
    results = []
    for no_ext in (False, True):
        if no_ext:
            monkeypatch.setenv("KVTRIO_NO_EXT", "1")
            native.reset()
        assert (native.cpu_helper() is None) == no_ext
        layers = layers_of(layout, seed=1, spread=spread)
        scatter_parts(layout, layers, parts)
        results.append(as_bytes(layers))
    assert results == [as_bytes(expected)] * 2


@needs_compiler
def test_scatter_parts_refuses_wrong_parts_before_writing() -> None:
    layout = layout_of(2, 16, 2, 16)
    layers = layers_of(layout)
    before = as_bytes(layers)
    chunk = np.ones(layout.chunk_nbytes(32), np.uint8)  # 2 blocks
    with pytest.raises(ValueError, match="does not fit"):
        scatter_parts(layout, layers, [([1], chunk, 0), ([2, 3], chunk, 1)])
    with pytest.raises(ValueError, match="distinct"):
        scatter_parts(layout, layers, [([1], chunk, 0), ([1], chunk, 1)])
    with pytest.raises(ValueError, match="out of range"):
        scatter_parts(layout, layers, [([1, 9], chunk, 0)])
    with pytest.raises(ValueError, match="bytes, expected"):  # not a whole number of blocks
        scatter_parts(layout, layers, [([1], chunk[:-1], 0)])
    assert as_bytes(layers) == before
    scatter_parts(layout, layers, [])  # nothing to do
    assert as_bytes(layers) == before


@needs_compiler
def test_build_is_cached_by_source_digest(tmp_path: Path) -> None:
    first = native.build_cpu_library(tmp_path)
    mtime = first.stat().st_mtime_ns
    assert native.build_cpu_library(tmp_path, compiler="/nonexistent/cc") == first
    assert first.stat().st_mtime_ns == mtime
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temporary files left


def test_failed_build_raises_with_the_compiler_output(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="building the kvtrio CPU helper failed"):
        native.build_cpu_library(tmp_path, compiler="false")
    assert not list(tmp_path.iterdir())


def test_without_a_compiler_numpy_copies_and_a_warning_is_logged_once(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("KVTRIO_CACHE_DIR", str(tmp_path))  # nothing built there yet
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    layout = layout_of(2, 16, 2, 16)
    with caplog.at_level(logging.WARNING, logger="kvtrio.transfer"):
        both_paths(layout, layers_of(layout), [4, 1], seed=2)
        both_paths(layout, layers_of(layout), [0], seed=3)
    warnings = [r for r in caplog.records if "CPU copy helper is unavailable" in r.message]
    assert len(warnings) == 1
    assert native.cpu_helper() is None


def test_kvtrio_no_ext_keeps_the_numpy_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVTRIO_NO_EXT", "1")
    monkeypatch.setenv("CC", "false")  # would fail loudly if a build were attempted
    assert native.cpu_helper() is None
    layout = layout_of(4, 5, 1, 3)
    both_paths(layout, layers_of(layout), [8, 2], seed=1)


@needs_compiler
def test_registering_a_cpu_cache_readies_the_helper() -> None:
    """The helper is built when the worker registers, not inside its first store."""
    from kvtrio.client._tensors import describe_kv_caches

    assert "lib" not in native._state
    describe_kv_caches({"l0": np.zeros((2, 4, 16, 2, 8), np.float16)}, 16, None)
    assert native._state["lib"] is not None


def test_an_unwritable_cache_falls_back_to_numpy(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A cache directory that cannot be created (here: a file is in the way) costs speed only."""
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    monkeypatch.setenv("KVTRIO_CACHE_DIR", str(blocker))
    with caplog.at_level(logging.WARNING, logger="kvtrio.transfer"):
        assert native.cpu_helper() is None
    assert any("CPU copy helper is unavailable" in r.message for r in caplog.records)
    layout = layout_of(2, 16, 2, 16)
    both_paths(layout, layers_of(layout), [3, 6], seed=4)


@needs_compiler
def test_the_source_compiles_without_warnings() -> None:
    compiler = shutil.which("cc") or shutil.which("gcc")
    assert compiler is not None
    flags = ["-std=c11", "-O3", "-Wall", "-Wextra", "-Werror", "-fsyntax-only"]
    result = subprocess.run([compiler, *flags, str(native.SOURCE)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
