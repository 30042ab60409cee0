"""How the server's tiers are named in KV events: one vocabulary with vLLM and the routers.

vLLM 0.33 names a block's tier by ``medium`` (``GPU``, ``CPU``, ``STORAGE``: ``MEDIUM_*`` in
``vllm/distributed/kv_events.py``) and, for offloading tiers, ``locality`` (``LOCAL`` or
``REMOTE`` relative to the publisher) and ``ownership`` (the tier's identifier); llm-d's indexer
keys by the lower-cased ``medium``, Dynamo's router maps ``STORAGE`` to its disk tier. So kvtrio
says ``CPU`` for L1 and ``STORAGE`` for every L2 backend, with the backend's label (``disk``,
``redis``, ``disk#2``) as ``ownership`` and ``LOCAL`` for a disk or a store on this host,
``REMOTE`` for a shared store elsewhere (``docs/events.md`` has the table).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from attrs import frozen

__all__ = ["MEDIUM_L1", "MEDIUM_STORAGE", "Tier", "l2_tier", "l2_tiers"]

MEDIUM_L1 = "CPU"
"""The ``medium`` of L1 (vLLM's name for host memory), and L1's label."""
MEDIUM_STORAGE = "STORAGE"
"""The ``medium`` of every L2 backend (vLLM's name for its offloading tiers beyond memory)."""


@frozen
class Tier:
    """How a tier is named in events: vLLM's ``medium``, ``locality`` (``LOCAL`` or
    ``REMOTE``, relative to this server) and ``ownership`` (kvtrio's label of the backend)."""

    medium: str
    locality: str | None = "LOCAL"
    ownership: str | None = None


_LOOPBACK = ("127.", "localhost", "[::1]", "::1", "unix:", "/")


def l2_tier(label: str, kind: str, address: str = "") -> Tier:
    """The tier of an L2 backend named ``label``, of backend ``kind`` (``disk``, ``redis``,
    ``s3``, ``memory``) at ``address`` (its host or URL): ``STORAGE``, ``LOCAL`` for a disk or
    a shared store on this host, ``REMOTE`` for a shared store elsewhere."""
    host = address.split("://", 1)[-1]
    local = kind in ("disk", "memory") or not host or host.startswith(_LOOPBACK)
    return Tier(MEDIUM_STORAGE, "LOCAL" if local else "REMOTE", label)


def l2_tiers(names: Sequence[str], specs: Sequence[Any] = ()) -> dict[str, Tier]:
    """The tiers of an L2 cascade of backends ``names`` (labelled as ``l2tier`` does: the name,
    ``name#i`` when it repeats), their addresses from the ``l2`` setting's ``specs`` (options
    ``url``, ``endpoint`` or ``host``) when they are its backends."""
    tiers = {}
    for i, name in enumerate(names):
        label = name if names.count(name) == 1 else f"{name}#{i + 1}"
        options = specs[i].options if i < len(specs) and specs[i].name == name else {}
        address = next((str(options[k]) for k in ("url", "endpoint", "host") if k in options), "")
        tiers[label] = l2_tier(label, name, address)
    return tiers
