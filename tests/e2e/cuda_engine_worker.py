"""A stand-in CUDA engine worker for test_cuda_e2e.py (GPU only).

Allocates a small paged KV cache on GPU 0 (torch), fills it from a seed, registers it through
the WorkerAdapter (CUDA IPC), then stores the prompt from SOURCE blocks, retrieves it into TARGET
blocks, and prints one JSON line: per-layer SHA-256 of both block sets. Then the same for a
prompt whose last chunk is partial (issue 38: 2 chunks and 5 whole blocks, then 7 tokens),
stored from PARTIAL_SOURCE and loaded into PARTIAL_TARGET, with the block after it untouched.

Usage: python cuda_engine_worker.py ENDPOINT LAYOUT
"""

from __future__ import annotations

import hashlib
import json
import sys
import time

import torch

from kvtrio.client import LoadStoreOp, WorkerAdapter

LAYERS, BLOCKS, BLOCK = 4, 256, 16
SHAPES = {
    "flash_attn": (2, BLOCKS, BLOCK, 2, 64),
    "flash_infer": (BLOCKS, 2, BLOCK, 2, 64),
    "mla": (BLOCKS, BLOCK, 96),
}
PROMPT = list(range(3000, 3000 + 4 * 256))
SOURCE = list(range(64))
TARGET = list(range(255, 191, -1))
PARTIAL_PROMPT = list(range(9000, 9000 + 2 * 256 + 5 * BLOCK + 7))
PARTIAL_SOURCE = list(range(64, 64 + 37))  # its 37 whole blocks
PARTIAL_TARGET = list(range(191, 191 - 38, -1))  # its 37 blocks and one the engine computes


def digests(tensors: list[torch.Tensor], kind: str, blocks: list[int]) -> list[str]:
    index = torch.tensor(blocks, device=tensors[0].device)
    axis = 1 if kind == "flash_attn" else 0
    return [
        hashlib.sha256(
            t.index_select(axis, index).cpu().view(torch.uint8).numpy().tobytes()
        ).hexdigest()
        for t in tensors
    ]


def main() -> None:
    endpoint, kind = sys.argv[1], sys.argv[2]
    torch.manual_seed(7)
    tensors = [
        torch.randn(SHAPES[kind], dtype=torch.float16, device="cuda:0") for _ in range(LAYERS)
    ]
    adapter = WorkerAdapter(endpoint, "m", 1, 0, BLOCK, timeout=120)
    adapter.register_kv_caches({f"layer.{i}": t for i, t in enumerate(tensors)}, layout=kind)
    deadline = time.monotonic() + 300  # the first registration may build the extension
    while not adapter.registered and time.monotonic() < deadline:
        time.sleep(0.1)
    adapter.submit_store_request("r", LoadStoreOp(SOURCE, PROMPT, end=len(PROMPT))).result(60)
    adapter.submit_retrieve_request("r", LoadStoreOp(TARGET, PROMPT, end=len(PROMPT))).result(60)
    failed = sorted(adapter.get_block_ids_with_load_errors())
    prompt, end = PARTIAL_PROMPT, len(PARTIAL_PROMPT)
    adapter.submit_store_request("p", LoadStoreOp(PARTIAL_SOURCE, prompt, end=end)).result(60)
    after = digests(tensors, kind, PARTIAL_TARGET[-1:])
    adapter.submit_retrieve_request("p", LoadStoreOp(PARTIAL_TARGET, prompt, end=end)).result(60)
    failed += sorted(adapter.get_block_ids_with_load_errors())
    print(
        json.dumps(
            {
                "source": digests(tensors, kind, SOURCE),
                "target": digests(tensors, kind, TARGET),
                "failed": failed,
                "store_failures": adapter.metrics()["store_failures"],
                "partial_source": digests(tensors, kind, PARTIAL_SOURCE),
                "partial_target": digests(tensors, kind, PARTIAL_TARGET[:-1]),
                "after_partial": [after, digests(tensors, kind, PARTIAL_TARGET[-1:])],
            }
        ),
        flush=True,
    )
    adapter.shutdown()


if __name__ == "__main__":
    main()
