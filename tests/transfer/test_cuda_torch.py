"""The pure-torch fallback's index logic (``TorchDevice`` without the extension), on CPU tensors.

On a GPU the fallback gathers an operation's chunks into a staging buffer with two torch
operations per layer (one ``index_select`` and one strided copy) and scatters them back with
``index_copy_`` (leaving blocks marked -1 alone). The same torch calls run on CPU tensors here
(the stream and the upload are the only CUDA parts, replaced), so the chunk order and the -1
handling are checked without a GPU; the GPU tests run it for real. Needs torch (the ``cuda``
tox env has its CPU build); skipped without it.
"""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np
import pytest

from kvtrio.transfer import KVLayout
from kvtrio.transfer.cuda import Operation, TorchDevice

from .._support.kv_layouts import make_layout, random_layers, reference_gather, reference_scatter

torch = pytest.importorskip("torch")


class CpuTorchDevice(TorchDevice):
    """The fallback with its CUDA parts (current stream, host-to-device upload) on the CPU."""

    def __init__(self) -> None:
        super().__init__(torch, 0, None)

    def _on(self, stream: Any) -> Any:
        return contextlib.nullcontext()

    def _upload(self, ids: Any) -> Any:
        return torch.from_numpy(np.ascontiguousarray(ids, dtype=np.int64))


def tensors(layout: KVLayout, arrays: list[Any]) -> list[Any]:
    return [torch.from_numpy(a.copy()) for a in arrays]


def op_of(layout: KVLayout, chunks: list[list[int]]) -> Operation:
    sizes = [layout.chunk_nbytes(len(ids) * layout.block_size) for ids in chunks]
    return Operation.of([(ids, 0, n) for ids, n in zip(chunks, sizes, strict=True)])


@pytest.mark.parametrize("chunks", [[[5, 0, 2]], [[5, 0], [2, 6], [1, 3]], [[4], [0, 6, 1]]],
                         ids=["one", "equal", "unequal"])  # fmt: skip
@pytest.mark.parametrize("element_size", [1, 2, 4])
@pytest.mark.parametrize("kind", ["flash_attn", "flash_infer", "mla"])
def test_fallback_gathers_and_scatters_operations(
    kind: str, element_size: int, chunks: list[list[int]]
) -> None:
    layout = make_layout(kind, element_size, 4)
    arrays = random_layers(layout)
    device = CpuTorchDevice()
    layers = tensors(layout, arrays)
    prepared = device.prepare_layers(layout, layers)
    op = op_of(layout, chunks)
    staging = torch.zeros(int(op.nbytes.sum()), dtype=torch.uint8)
    device.run(prepared, op, np.zeros(0), staging, gather=True, stream=None)
    expected = b"".join(reference_gather(layout, arrays, ids).tobytes() for ids in chunks)
    assert staging.numpy().tobytes() == expected

    targets = [[-1 if i == 0 else 6 - b for i, b in enumerate(ids)] for ids in chunks]
    want = [a.copy() for a in arrays]
    position = 0
    for ids, nbytes in zip(targets, op.nbytes.tolist(), strict=True):
        reference_scatter(layout, want, ids, staging.numpy()[position : position + nbytes])
        position += nbytes
    device.run(prepared, op_of(layout, targets), np.zeros(0), staging, gather=False, stream=None)
    assert [t.numpy().tobytes() for t in layers] == [a.tobytes() for a in want]


@pytest.mark.parametrize("chunks", [[[5, 0, -1]], [[5, 0, 2], [6, -1, -1]]], ids=["one", "equal"])
@pytest.mark.parametrize("kind", ["flash_attn", "flash_infer", "mla"])
def test_fallback_gathers_zeros_for_blocks_marked_minus_one(
    kind: str, chunks: list[list[int]]
) -> None:
    """A partial chunk's tail (block id -1) is gathered as zeros, whatever the staging buffer
    held: the copy engine then moves the whole slot."""
    layout = make_layout(kind, 2, 4)
    arrays = random_layers(layout)
    device = CpuTorchDevice()
    prepared = device.prepare_layers(layout, tensors(layout, arrays))
    op = op_of(layout, chunks)
    staging = torch.full((int(op.nbytes.sum()),), 0xA5, dtype=torch.uint8)
    device.run(prepared, op, np.zeros(0), staging, gather=True, stream=None)
    expected = b"".join(reference_gather(layout, arrays, ids).tobytes() for ids in chunks)
    assert staging.numpy().tobytes() == expected
