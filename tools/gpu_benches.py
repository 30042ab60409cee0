"""The bench steps of ``tools/gpu-check.sh`` (stdlib only; used by ``tools/gpu_check.py``).

Each bench is a script under ``bench/`` run with a time limit; its output is kept (log and
JSON in the state directory) and its result lines go into the summary. In a dry run (no GPU)
each must refuse with its "needs a CUDA GPU" message. ``bench/cuda_transfer.py``'s sweep rows
are also parsed (GB/s, ratios to raw, enqueueing µs) so the summary can be checked by tests;
with the compiled kernels it also writes torch profiler traces (``profiles/`` in the state
directory, beside the summary when ``OUT`` is set).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

__all__ = ["BENCHES", "BENCH_ROW", "BenchFailed", "parse_bench", "run_bench", "summary_lines"]

ROOT = Path(__file__).resolve().parent.parent

BENCHES: dict[str, tuple[list[str], float, str]] = {
    # name: (script and arguments, seconds allowed, what it measures)
    "transfer-extension": (
        ["bench/cuda_transfer.py", "--kernels", "extension", "--profile", "{state}/profiles"],
        150.0,
        "chunk-size sweep, compiled kernels (mapped and staged), next to raw cudaMemcpy",
    ),
    "transfer-torch": (
        ["bench/cuda_transfer.py", "--kernels", "torch"], 120.0,
        "chunk-size sweep, pure-torch fallback, next to raw cudaMemcpy",
    ),
    "e2e": (
        ["bench/cuda_e2e.py"], 150.0,
        "a CUDA worker against a real kvtrio serve: 16/64/256 MiB at 2 and 32 MiB chunks",
    ),
    "prefill": (
        ["bench/cuda_prefill.py"], 240.0,
        "8B Llama prefill next to kvtrio's retrieve of the prompt's KV",
    ),
}  # fmt: skip

BENCH_ROW = re.compile(
    r"^(?P<label>[^:]+): store (?P<store>[\d.]+) GB/s = (?P<store_ratio>[\d.]+) × raw d2h "
    r"(?P<d2h>[\d.]+); retrieve (?P<retrieve>[\d.]+) GB/s = (?P<retrieve_ratio>[\d.]+) × raw h2d "
    r"(?P<h2d>[\d.]+)(?:; enqueue store (?P<enqueue_store>[\d.]+) µs, retrieve "
    r"(?P<enqueue_retrieve>[\d.]+) µs)?$"
)
NO_GPU = "needs a CUDA GPU"


class BenchFailed(Exception):
    """A bench did not run as it should; the message says how."""


def _run_group(command: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    """``subprocess.run`` in a process group of its own, killed whole on timeout (a bench may
    have started a ``kvtrio serve`` of its own)."""
    with subprocess.Popen(command, start_new_session=True, text=True, cwd=ROOT,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE) as process:  # fmt: skip
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, 9)
            process.communicate()
            raise
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def run_bench(state: Path, name: str, dry_run: bool) -> None:
    """Run bench ``name``; save ``bench-<name>.json`` (its lines, parsed rows) and a log."""
    script, timeout, _what = BENCHES[name]
    arguments = [argument.format(state=state) for argument in script[1:]]
    command = [sys.executable, str(ROOT / script[0]), *arguments]
    try:
        result = _run_group(command, timeout)
    except subprocess.TimeoutExpired as exc:
        (state / f"bench-{name}.json").write_text(json.dumps({"timed_out": timeout}))
        raise BenchFailed(f"{' '.join(script)} did not finish in {exc.timeout:.0f} s") from exc
    output = result.stdout + result.stderr
    (state / f"bench-{name}.log").write_text(output)
    if dry_run:
        if result.returncode == 0 or NO_GPU not in output:
            raise BenchFailed(f"{' '.join(script)} should refuse without a GPU, got: {output}")
        data = {"dry_run": True, "message": output.strip()}
        (state / f"bench-{name}.json").write_text(json.dumps(data))
        return
    lines = [line.rstrip() for line in result.stdout.splitlines() if line.strip()]
    data = {"lines": lines, "rows": parse_bench(result.stdout), "returncode": result.returncode}
    (state / f"bench-{name}.json").write_text(json.dumps(data, indent=1))
    if result.returncode != 0 or not lines:
        raise BenchFailed(f"{' '.join(script)} failed: {output[-2000:]}")


def parse_bench(stdout: str) -> list[dict[str, Any]]:
    """The sweep rows of bench/cuda_transfer.py's output (GB/s, ratios and µs as floats)."""
    rows = []
    for line in stdout.splitlines():
        found = BENCH_ROW.match(line.strip())
        if found:
            row: dict[str, Any] = {
                k: float(v) for k, v in found.groupdict().items() if k != "label" and v
            }
            rows.append({"label": found["label"], **row})
    return rows


def summary_lines(state: Path) -> list[str]:
    """Each bench's result lines for the summary (the order of :data:`BENCHES`)."""
    lines: list[str] = []
    for name, (script, _timeout, what) in BENCHES.items():
        path = state / f"bench-{name}.json"
        if not path.exists():
            continue
        result = json.loads(path.read_text())
        shown = [argument for argument in script if "{state}" not in argument]
        lines += ["", f"{' '.join(shown).removesuffix(' --profile')} ({what}):"]
        if result.get("dry_run"):
            lines.append(f"  (dry run) {result['message']}")
        elif "timed_out" in result:
            lines.append(f"  TIMED OUT after {result['timed_out']:.0f} s")
        else:
            lines += [f"  {line}" for line in result.get("lines", [])]
    return lines
