"""Running the ``kvtrio`` command of this environment, as a user does."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

__all__ = ["KVTRIO", "run"]

KVTRIO = str(Path(sys.executable).with_name("kvtrio"))
"""The ``kvtrio`` script next to this Python."""


def run(*args: str, timeout: float = 30, **kwargs: object) -> subprocess.CompletedProcess[str]:
    """``kvtrio ARGS…``, its output captured as text."""
    return subprocess.run(  # type: ignore[call-overload,no-any-return]
        [KVTRIO, *args], capture_output=True, text=True, timeout=timeout, **kwargs
    )
