"""The L2 tier: backends behind L1 (local disk, Redis, S3, plugins), found by entry points."""

from ._framing import FORMAT_VERSION, HEADER_SIZE, Corrupt, check, header
from ._interface import (
    MAX_NAMES,
    Backend,
    BackendError,
    BackendMisconfigured,
    BackendUnavailable,
    Buffers,
    Capabilities,
    Naming,
    Touching,
    UnreadableObjects,
    capabilities,
)
from ._locks import LocalLocks
from ._registry import (
    GROUP,
    BackendInfo,
    create_backend,
    describe_backends,
    load_backend_class,
    register,
    unregister,
)

__all__ = [
    "FORMAT_VERSION",
    "GROUP",
    "HEADER_SIZE",
    "MAX_NAMES",
    "Backend",
    "BackendError",
    "BackendInfo",
    "BackendMisconfigured",
    "BackendUnavailable",
    "Buffers",
    "Capabilities",
    "Corrupt",
    "LocalLocks",
    "Naming",
    "Touching",
    "UnreadableObjects",
    "capabilities",
    "check",
    "create_backend",
    "describe_backends",
    "header",
    "load_backend_class",
    "register",
    "unregister",
]
