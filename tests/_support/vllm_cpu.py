"""What the real vLLM CPU engine tests share: their prompts' common prefix, how long a vLLM
process may take to come up, and running ``engine.py`` (``tests/integration/vllm_cpu``) over a
job in a process of its own."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

__all__ = [
    "CHUNK",
    "CONTROL",
    "ENGINE",
    "PREFIX",
    "PREFIX_CHUNKS",
    "PREFIX_HIT",
    "STARTUP",
    "run_engine",
    "tensor_parallel_binding",
]

_random = random.Random(11)
PREFIX = [_random.randrange(3, 1000) for _ in range(600)]
"""600 token ids of the tests' tiny model's vocabulary."""
CONTROL = [_random.randrange(3, 1000) for _ in range(540)]
"""Another 540, for a prompt that shares nothing with :data:`PREFIX`."""
STARTUP = 600.0
"""Seconds a vLLM process may take to come up (2 cores, shared)."""
ENGINE = Path(__file__).parents[1] / "integration" / "vllm_cpu" / "engine.py"
"""The script that runs a vLLM CPU engine over a job (:func:`run_engine`)."""
CHUNK = 128
"""The chunk size of the ``kvtrio`` fixture's server: 4 of vLLM's 32-token blocks."""
PREFIX_CHUNKS = 5
"""Chunks of :data:`PREFIX` (600 tokens): 4 full ones and a partial one (2 blocks)."""
PREFIX_HIT = 576
"""What a repeated :data:`PREFIX` loads: its whole blocks but the last token's,
``(600 - 1) // 32 * 32``."""


def run_engine(
    script: Path, model: Path, workdir: Path, name: str, job: dict[str, Any], env: dict[str, str]
) -> dict[str, Any]:
    """Run ``script`` (``engine.py``: ``vllm.LLM`` in a new process) over ``job`` with ``env``;
    its results by prompt id. Fails the test, with the end of vLLM's log, if it exits with an
    error; its whole log stays in ``workdir/NAME.log``."""
    job_path, results_path = workdir / f"{name}.job.json", workdir / f"{name}.results.json"
    job_path.write_text(json.dumps(job))
    log_path = workdir / f"{name}.log"
    with log_path.open("w") as log:
        proc = subprocess.run(
            [sys.executable, str(script), str(model), str(job_path), str(results_path)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            timeout=STARTUP,
            check=False,
        )
    if proc.returncode != 0:
        pytest.fail(f"vLLM ({name}) exited with {proc.returncode}:\n{log_path.read_text()[-6000:]}")
    return {r["id"]: r for r in json.loads(results_path.read_text())}


def tensor_parallel_binding(ranks: int) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for ``ranks`` CPU workers of one engine: this process's
    CPUs split in ``ranks`` parts (``"0|1"`` on 2 cores). vLLM's default (``auto``) binds one
    rank per NUMA node and refuses more ranks than nodes. Skips the test with fewer CPUs than
    ranks."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < ranks:
        pytest.skip(
            f"{ranks} tensor-parallel ranks need {ranks} CPUs, this process has {len(cpus)}"
        )
    share = len(cpus) // ranks
    parts = [cpus[i * share : (i + 1) * share] for i in range(ranks)]
    return "|".join(",".join(map(str, part)) for part in parts)
