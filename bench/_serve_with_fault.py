"""``kvtrio serve`` with the test backend ``fault`` (:class:`kvtrio.testing.FaultBackend`,
which kvtrio does not install) registered with :func:`kvtrio.l2.register`, as the tests'
``fault_registered`` fixture does: for the benches that put a latency in front of an L2
(``bench/e2e.py --scaling remote``).

    python bench/_serve_with_fault.py serve --endpoint ipc://… --l2 fault:inner=disk,latency=0.01
"""

from __future__ import annotations

import sys

from kvtrio.cli import main
from kvtrio.l2 import register

if __name__ == "__main__":
    register("fault", "kvtrio.testing:FaultBackend")
    main(sys.argv[1:])
