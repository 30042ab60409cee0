"""Loaded by every Python process of an engine that ``bench/hit_profile.py`` starts (this folder
leads its ``PYTHONPATH``): with ``KVTRIO_HIT_TRACE`` set to a folder, times every call of the
functions in :data:`TARGETS` and appends ``pid label start seconds thread request`` lines to
``<folder>/events-<pid>.txt``. Starts are ``time.perf_counter()`` (CLOCK_MONOTONIC on Linux:
one clock for all processes). The functions are wrapped by a thread that looks for their
modules every 50 ms, so calls in the first moments of a process may be missed (start-up only).
Timing only; nothing else changes.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
import time
from typing import Any

TARGETS = [
    ("vllm.v1.engine.llm_engine", "LLMEngine", "add_request", "add_request"),
    ("vllm.v1.core.sched.scheduler", "Scheduler", "schedule", "schedule"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "execute_model", "execute_model"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "_model_forward", "forward"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "sample_tokens", "sample_tokens"),
    ("vllm.model_executor.models.llama", "LlamaForCausalLM", "compute_logits", "compute_logits"),
    ("kvtrio.integration.vllm", "KvtrioConnector", "get_num_new_matched_tokens", "lookup"),
    ("kvtrio.client._arena_worker", "ArenaCopies", "retrieve", "retrieve"),
    ("kvtrio.client._arena_worker", "ArenaCopies", "_scatter", "scatter"),
]
"""(module, class, function, label)."""

_lock = threading.Lock()
_files: dict[int, Any] = {}


def _emit(line: str) -> None:
    with _lock:
        pid = os.getpid()
        if pid not in _files:
            folder = os.environ["KVTRIO_HIT_TRACE"]
            _files[pid] = open(os.path.join(folder, f"events-{pid}.txt"), "a", buffering=1)  # noqa: SIM115
        _files[pid].write(line)


def _wrap(owner: Any, name: str, label: str) -> None:
    inner = getattr(owner, name)

    @functools.wraps(inner)
    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            took = time.perf_counter() - start
            request = args[1] if label == "add_request" and len(args) > 1 else "-"
            thread = threading.current_thread().name.replace(" ", "_")
            _emit(f"{os.getpid()} {label} {start:.6f} {took:.6f} {thread} {request}\n")

    setattr(owner, name, timed)


def _watch() -> None:
    left = list(TARGETS)
    while left:
        for target in list(left):
            module, owner, name, label = target
            found = sys.modules.get(module)
            if found is not None and hasattr(found, owner):
                _wrap(getattr(found, owner), name, label)
                left.remove(target)
        time.sleep(0.05)


if os.environ.get("KVTRIO_HIT_TRACE"):
    threading.Thread(target=_watch, daemon=True, name="hit-trace").start()
