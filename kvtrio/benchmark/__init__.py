"""``kvtrio bench``: a workload through a real server and a simulated engine, measured.

A top layer like the command line: it uses the client adapters exactly as an engine does, with
worker processes whose KV caches are ordinary (numpy) memory, and checks every retrieved byte.
"""

from ._options import BenchError, BenchOptions, add_arguments, options_from_args
from ._results import BenchResult, RequestRecord
from ._run import main, run_bench

__all__ = [
    "BenchError",
    "BenchOptions",
    "BenchResult",
    "RequestRecord",
    "add_arguments",
    "main",
    "options_from_args",
    "run_bench",
]
