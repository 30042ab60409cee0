"""What the real vLLM CPU engine tests share: their prompts' common prefix and how long a vLLM
process may take to come up."""

from __future__ import annotations

import random

__all__ = ["CONTROL", "PREFIX", "STARTUP"]

_random = random.Random(11)
PREFIX = [_random.randrange(3, 1000) for _ in range(600)]
"""600 token ids of the tests' tiny model's vocabulary."""
CONTROL = [_random.randrange(3, 1000) for _ in range(540)]
"""Another 540, for a prompt that shares nothing with :data:`PREFIX`."""
STARTUP = 600.0
"""Seconds a vLLM process may take to come up (2 cores, shared)."""
