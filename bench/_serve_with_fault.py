"""``kvtrio serve`` with the test backend ``fault`` (:class:`kvtrio.testing.FaultBackend`,
which kvtrio does not install) registered, as the tests' ``fault_registered`` fixture does: for
the benches that put a latency in front of an L2 (``bench/e2e.py --scaling remote``).

    python bench/_serve_with_fault.py serve --endpoint ipc://… --l2 fault:inner=disk,latency=0.01
"""

from __future__ import annotations

import importlib.metadata
import sys
from typing import Any

from kvtrio.cli import main
from kvtrio.l2 import GROUP

_entry_points = importlib.metadata.entry_points
_FAULT = importlib.metadata.EntryPoint("fault", "kvtrio.testing:FaultBackend", GROUP)


def entry_points(**kwargs: Any) -> Any:
    """The installed entry points, and ``fault`` among the backends."""
    found = _entry_points(**kwargs)
    return [*found, _FAULT] if kwargs.get("group") == GROUP else found


if __name__ == "__main__":
    importlib.metadata.entry_points = entry_points  # type: ignore[assignment]
    main(sys.argv[1:])
