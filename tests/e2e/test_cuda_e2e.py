"""End to end on a GPU: a kvtrio server process and a CUDA engine worker process.

The worker registers its KV cache by CUDA IPC, stores a prompt from some blocks and retrieves it
into others; every layer's bytes must be equal. The same for a prompt whose last chunk is partial
(stored and loaded to its last whole block). Skipped where torch sees no CUDA GPU.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from kvtrio.launch import ServerProcess

WORKER = Path(__file__).with_name("cuda_engine_worker.py")


def _gpu() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.version.cuda) and torch.cuda.is_available()


pytestmark = pytest.mark.skipif(not _gpu(), reason="needs a CUDA GPU (torch with CUDA)")


@pytest.mark.parametrize("kind", ["flash_attn", "flash_infer", "mla"])
def test_store_and_retrieve_through_cuda_ipc(
    server_process: Callable[..., ServerProcess], kind: str
) -> None:
    server = server_process("--l1-size", "256MiB")
    result = subprocess.run(
        [sys.executable, str(WORKER), server.endpoint, kind],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr + server.log()
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["failed"] == []
    assert report["target"] == report["source"]  # per layer
    # Issue 38: the partial chunk is stored and loaded to its last whole block, no further.
    assert report["store_failures"] == {}
    assert report["partial_target"] == report["partial_source"]
    assert report["after_partial"][1] == report["after_partial"][0]
