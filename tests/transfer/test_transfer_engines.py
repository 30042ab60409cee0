"""One suite for every copy engine behind the ``Transfer`` interface.

* ``cpu``: the numpy CPU path;
* ``fake-cuda``, ``fake-cuda-staged``: the CUDA engine (``CudaTransfer``: the operation
  kernel reading and writing mapped pinned memory; or staging buffers, two streams, events) on a
  simulated device whose kernel is the host build of the real one (runs everywhere);
* ``cuda-extension``, ``cuda-extension-staged``, ``cuda-torch``: the CUDA engine on a real GPU
  with the compiled kernels (mapped and staged), and with the pure-torch fallback (staged)
  (skipped where there is no GPU).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import attrs
import numpy as np
import pytest

from kvtrio.testing import FakeCuda
from kvtrio.transfer import CPU_TRANSFER, LAYOUT_KINDS, KVLayout, Transfer
from kvtrio.transfer.cuda import (
    GPU_LAYOUT_KINDS,
    CopyPipeline,
    CudaTransfer,
    Operation,
    PinnedHost,
    TorchDevice,
    kernel_choice,
    page_aligned,
    torch_runtime,
)

from .._support.kv_layouts import (
    BLOCK_IDS,
    DTYPES,
    empty_chunk,
    make_layout,
    random_chunk,
    random_layers,
    reference_gather,
    reference_scatter,
)

Array = Any
ENGINES = ["cpu", "fake-cuda", "fake-cuda-staged", "cuda-extension", "cuda-extension-staged",
           "cuda-torch"]  # fmt: skip
MAX_CHUNK = 1 << 20


@attrs.define
class Engine:
    """A transfer engine and how to move test data into and out of its layers."""

    transfer: Transfer
    upload: Callable[[KVLayout, Sequence[Array]], list[Any]]
    download: Callable[[Sequence[Any]], list[Array]]
    kinds: Sequence[str] = LAYOUT_KINDS
    """The layout kinds it copies; it refuses the others (CUDA: the CPU-only ``vllm_cpu``)."""

    def refused(self, layout: KVLayout, layers: Sequence[Any], ids: Sequence[int]) -> bool:
        """Whether this engine does not copy ``layout``'s kind (and says so, checked here)."""
        if layout.kind in self.kinds:
            return False
        with pytest.raises(ValueError, match="CPU-only layout"):
            self.transfer.gather(layout, layers, ids, empty_chunk(layout, len(ids)))
        return True


def _cpu() -> Engine:
    return Engine(CPU_TRANSFER, lambda _l, arrays: list(arrays), lambda layers: list(layers))


def _fake(host_library: Any, mode: str) -> Engine:
    cuda = FakeCuda(host_library)

    def upload(layout: KVLayout, arrays: Sequence[Array]) -> list[Any]:
        tensors = []
        for array in arrays:
            tensor = cuda.empty(array.shape, layout.dtype, pad=64)
            tensor.array[...] = array.view(tensor.array.dtype)
            tensors.append(tensor)
        return tensors

    def download(layers: Sequence[Any]) -> list[Array]:
        return [layer.array.copy() for layer in layers]

    transfer = CudaTransfer(cuda.device(0), MAX_CHUNK, mode)
    return Engine(transfer, upload, download, GPU_LAYOUT_KINDS)


def _cuda(kernels: str, mode: str) -> Engine:
    runtime = torch_runtime()
    if runtime is None:
        pytest.skip("no CUDA GPU")
    torch = runtime.torch
    if kernels == "extension":
        kind, module, why = kernel_choice(torch)
        if kind != "extension":
            pytest.fail(f"the CUDA extension did not build: {why}")
        device = TorchDevice(torch, 0, module)
    else:
        device = TorchDevice(torch, 0, None)
    ints = {1: np.uint8, 2: np.int16, 4: np.int32}

    def upload(layout: KVLayout, arrays: Sequence[Array]) -> list[Any]:
        return [torch.from_numpy(a.view(ints[a.dtype.itemsize]).copy()).cuda() for a in arrays]

    def download(layers: Sequence[Any]) -> list[Array]:
        return [layer.cpu().numpy() for layer in layers]

    return Engine(CudaTransfer(device, MAX_CHUNK, mode), upload, download, GPU_LAYOUT_KINDS)


@pytest.fixture(params=ENGINES)
def engine(request: pytest.FixtureRequest) -> Iterator[Engine]:
    name = request.param
    if name == "cpu":
        yield _cpu()
    elif name.startswith("fake-cuda"):
        mode = "staged" if name.endswith("-staged") else "mapped"
        yield _fake(request.getfixturevalue("host_library"), mode)
    elif name == "cuda-torch":
        yield _cuda("torch", "staged")
    else:
        yield _cuda("extension", "staged" if name.endswith("-staged") else "mapped")


def same_bytes(a: Sequence[Array], b: Sequence[Array]) -> bool:
    return [np.ascontiguousarray(x).tobytes() for x in a] == [
        np.ascontiguousarray(x).tobytes() for x in b
    ]


@pytest.mark.parametrize("ids", list(BLOCK_IDS.values()), ids=list(BLOCK_IDS))
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("element_size", sorted(DTYPES))
@pytest.mark.parametrize("kind", LAYOUT_KINDS)
def test_gather_and_scatter_match_reference(
    engine: Engine, kind: str, element_size: int, block_size: int, ids: list[int]
) -> None:
    layout = make_layout(kind, element_size, block_size)
    arrays = random_layers(layout)
    layers = engine.upload(layout, arrays)
    if engine.refused(layout, layers, ids):
        return

    out = empty_chunk(layout, len(ids))
    engine.transfer.gather(layout, layers, ids, out)
    assert out.tobytes() == reference_gather(layout, arrays, ids).tobytes()
    assert same_bytes(engine.download(layers), arrays)

    src = random_chunk(layout, len(ids))
    expected = [a.copy() for a in arrays]
    reference_scatter(layout, expected, ids, src)
    engine.transfer.scatter(layout, layers, ids, src)
    assert same_bytes(engine.download(layers), expected)


@pytest.mark.parametrize("kind", LAYOUT_KINDS)
def test_round_trip_into_other_blocks(engine: Engine, kind: str) -> None:
    layout = make_layout(kind, 2, 16)
    arrays = random_layers(layout)
    layers = engine.upload(layout, arrays)
    if engine.refused(layout, layers, [6, 1, 3]):
        return
    first = empty_chunk(layout, 3)
    engine.transfer.gather(layout, layers, [6, 1, 3], first)
    engine.transfer.scatter(layout, layers, [0, 5, 2], first)
    again = empty_chunk(layout, 3)
    engine.transfer.gather(layout, layers, [0, 5, 2], again)
    assert again.tobytes() == first.tobytes()


def test_chunks_are_shared_across_layout_kinds(engine: Engine) -> None:
    """A chunk gathered from a flash_attn engine scatters into flash_infer and cpu engines and
    gathers back to the same bytes."""
    shapes = {
        kind: KVLayout(kind, 2, 7, 16, 3, 4, "float16")
        for kind in ("flash_attn", "flash_infer", "cpu", "vllm_cpu")
    }
    source = engine.upload(shapes["flash_attn"], random_layers(shapes["flash_attn"], seed=5))
    chunk = empty_chunk(shapes["flash_attn"], 3)
    engine.transfer.gather(shapes["flash_attn"], source, [4, 1, 6], chunk)
    for kind in ("flash_infer", "cpu", "vllm_cpu"):
        if kind not in engine.kinds:
            continue
        zeros = [np.zeros(shapes[kind].layer_shape, np.uint16) for _ in range(2)]
        layers = engine.upload(shapes[kind], zeros)
        engine.transfer.scatter(shapes[kind], layers, [0, 2, 3], chunk)
        back = empty_chunk(shapes[kind], 3)
        engine.transfer.gather(shapes[kind], layers, [0, 2, 3], back)
        assert back.tobytes() == chunk.tobytes(), kind


def test_bad_block_ids_are_refused(engine: Engine) -> None:
    layout = make_layout("flash_attn", 2, 4)
    arrays = random_layers(layout)
    layers = engine.upload(layout, arrays)
    with pytest.raises(ValueError, match="out of range"):
        engine.transfer.gather(layout, layers, [1, 7], empty_chunk(layout, 2))
    with pytest.raises(ValueError, match="distinct"):
        engine.transfer.scatter(layout, layers, [1, 1], random_chunk(layout, 2))
    assert same_bytes(engine.download(layers), arrays)


def test_a_store_of_a_partial_chunk_writes_zeros_after_its_blocks(engine: Engine) -> None:
    """Issue 38: the server's store of a prompt's partial chunk names -1 for the chunk's
    trailing blocks; every CUDA engine (both copy modes, the torch fallback) writes zeros there,
    in the same operation as whole chunks, whatever the pinned slot or the staging buffers held
    before (the slot is committed as written)."""
    transfer = engine.transfer
    if not isinstance(transfer, CudaTransfer):
        pytest.skip("a CPU worker writes its partial chunk itself (client/_arena_worker.py)")
    layout = make_layout("flash_attn", 2, 16)
    arrays = random_layers(layout)
    device, pipeline = transfer.device, transfer.pipeline
    prepared = device.prepare_layers(layout, engine.upload(layout, arrays))
    nbytes = layout.chunk_nbytes(3 * layout.block_size)
    host = PinnedHost(device, page_aligned(2 * nbytes))
    done = device.new_event()
    try:
        for ids in ([4, 1, 6], [0, 2, 3]):  # both staging buffers first hold whole chunks
            whole = Operation.of([(ids, 0, nbytes), ([5, 3, 0], nbytes, nbytes)])
            pipeline.store(prepared, whole, host, None, done)
            done.synchronize()
        host.memory[...] = 0xA5  # what earlier chunks left in the slots
        op = Operation.of([([4, 1, 6], 0, nbytes), ([2, 5, -1], nbytes, nbytes)])
        pipeline.store(prepared, op, host, None, done)
        done.synchronize()
        got = host.memory.tobytes()
    finally:
        host.close()
    assert got[:nbytes] == reference_gather(layout, arrays, [4, 1, 6]).tobytes()
    assert got[nbytes:] == reference_gather(layout, arrays, [2, 5, -1]).tobytes()


def test_the_copy_mode_comes_from_the_environment(
    host_library: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    device = FakeCuda(host_library).device(0)
    assert CopyPipeline(device, MAX_CHUNK).mode == "mapped"
    monkeypatch.setenv("KVTRIO_CUDA_COPY", "staged")
    assert CopyPipeline(device, MAX_CHUNK).mode == "staged"
    monkeypatch.setenv("KVTRIO_CUDA_COPY", "teleport")
    assert CopyPipeline(device, MAX_CHUNK).mode == "mapped"
    assert "KVTRIO_CUDA_COPY=teleport" in caplog.text
    with pytest.raises(ValueError, match="copy mapped/staged, not teleport"):
        CopyPipeline(device, MAX_CHUNK, mode="teleport")
