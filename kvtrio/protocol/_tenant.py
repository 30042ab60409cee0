"""The alphabet of tenant names: one rule for key files, ``kvtrio keygen --tenants`` and
registrations, so that no tenant's events topic (``kvtrio/<tenant>/``) can be a prefix of
another's.

A tenant name is 0 to 64 characters of ``A-Z a-z 0-9 . _ -``; ``""`` is the tenant of
``--insecure`` servers and of clients that name none. ``/`` (the topic's terminator) is outside
the alphabet, so ``kvtrio/a/`` never prefixes another tenant's topic. (``kvtrio.transport``
checks key files with the same pattern: it may not import this layer; a test keeps the two
equal.)
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["TENANT_NAME_LENGTH", "TENANT_PATTERN", "check_tenant_name", "tenant_problem"]

TENANT_NAME_LENGTH = 64
"""The longest tenant name, in characters."""
TENANT_PATTERN = r"[A-Za-z0-9._-]{0,64}"
"""A tenant name, whole (``re.fullmatch``)."""

_TENANT = re.compile(TENANT_PATTERN)


def tenant_problem(name: str) -> str | None:
    """Why ``name`` is not a tenant name, or None if it is one."""
    if _TENANT.fullmatch(name) is not None:
        return None
    if len(name) > TENANT_NAME_LENGTH:
        return f"a tenant name is at most {TENANT_NAME_LENGTH} characters, got {len(name)}"
    return f"a tenant name is made of A-Z a-z 0-9 . _ - only, got {name[:80]!r}"


def check_tenant_name(_instance: Any, _attribute: Any, value: str) -> None:
    """An attrs validator: ``ValueError`` (naming the field) if ``value`` is not a tenant
    name."""
    problem = tenant_problem(value)
    if problem is not None:
        raise ValueError(f"tenant: {problem}")
