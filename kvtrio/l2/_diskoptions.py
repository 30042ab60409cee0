"""The disk backend's options (``--l2 disk:path=…,capacity=…``)."""

from __future__ import annotations

import attrs

from ..options import ByteSize
from ..storage import DEFAULT_EVICTION, EVICTION_POLICIES

__all__ = ["DiskOptions"]


@attrs.frozen
class DiskOptions:
    path: str = attrs.field(
        default="~/.cache/kvtrio/l2",
        metadata={"help": "Directory of the objects (created if missing)."},
    )
    capacity: ByteSize = attrs.field(
        default=ByteSize(32 << 30), metadata={"help": "Bytes kept before evicting (unlocked)."}
    )
    eviction: str = attrs.field(
        default=DEFAULT_EVICTION,
        metadata={"help": f"Eviction policy: {', '.join(sorted(EVICTION_POLICIES))}."},
    )
    fsync: bool = attrs.field(
        default=False, metadata={"help": "fdatasync every batch before it becomes visible."}
    )
    threads: int = attrs.field(default=4, metadata={"help": "Concurrent file operations."})
    segment_size: ByteSize = attrs.field(
        default=ByteSize(64 << 20),
        metadata={"help": "Bytes appended to a segment file before the next one is started."},
    )
    tenant_share: float = attrs.field(
        default=1.0,
        metadata={"help": "Fraction of capacity one tenant may hold (others: evicted fairly)."},
    )
