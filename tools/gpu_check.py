"""The steps of ``tools/gpu-check.sh`` that are easier in Python (stdlib only).

    python tools/gpu_check.py STEP --state DIR [--dry-run]

Each step records what it found in ``DIR`` (JSON files) and exits non-zero with one line naming
what is missing or broken; ``summary`` reads them all. Steps:

* ``preflight`` (the machine's Python): the Python version, the packages the GPU machine must
  already have, torch's CUDA build and a visible GPU, ``nvidia-smi``, ``nvcc`` and a C++ compiler.
  In a dry run the GPU parts are recorded when present but not required.
* ``imports`` (the kit's venv): everything the tests and the extension build import, ``ninja``.
* ``build``: builds the CUDA extension now, so that its time and errors are this step's. In a
  dry run: checks that torch sees no GPU (as the dry run hides it), so the tests must skip.
* ``tests``: runs the GPU tests (``GPU_TESTS``) with pytest. For real, none may skip; in a dry
  run every one must skip, with a no-GPU reason: the selection and the skipping logic still hold.
* ``bench --name N``: one bench of ``tools/gpu_benches.py`` (``transfer-extension``,
  ``transfer-torch``: ``bench/cuda_transfer.py``'s chunk-size sweep next to raw ``cudaMemcpy``;
  ``e2e``: ``bench/cuda_e2e.py``; ``prefill``: ``bench/cuda_prefill.py``), its result lines kept
  for the summary; in a dry run it must exit with its no-GPU message.
* ``summary``: the one report (text), to ``--out FILE`` or stdout.

A timeout (seconds) bounds each child process, so a hung step fails instead of eating the GPU
machine's time.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_benches import (
    BENCH_ROW,
    BENCHES,
    BenchFailed,
    parse_bench,
    run_bench,
    summary_lines,
)

__all__ = ["BENCHES", "BENCH_ROW", "StepFailed", "main", "parse_bench", "summary"]

ROOT = Path(__file__).resolve().parent.parent
# The tests that skip on a machine without a GPU, and only those: the CUDA engine on a real
# device (with the compiled kernels and with the pure-torch fallback), and the end-to-end run of
# a server process and a CUDA worker process.
GPU_TESTS = [
    "tests/transfer/test_transfer_engines.py",
    "tests/e2e/test_cuda_e2e.py",
    "-k",
    "cuda-extension or cuda-torch or test_cuda_e2e",
]
# What those tests say when they skip for want of a GPU.
NO_GPU_REASON = re.compile(r"no CUDA GPU|needs a CUDA GPU")
# The GPU machine's preinstalled packages (import names); torch must be a CUDA build there.
PREINSTALLED = [
    "torch",
    "numpy",
    "msgpack",
    "attrs",
    "xxhash",
    "prometheus_client",
    "rich",
    "pytest",
]
# What the venv must import after the offline install (beyond the above).
INSTALLED = [
    "kvtrio",
    "trio",
    "zmq",
    "cattrs",
    "hypercorn",
    "structlog",
    "pytest_trio",
    "ninja",
    "setuptools",
    "torch.utils.cpp_extension",
]
TIMEOUTS = {"tests": 240.0, "command": 30.0}


class StepFailed(Exception):
    """A step found something missing or broken; the message names it."""


def _save(state: Path, name: str, data: Any) -> None:
    (state / f"{name}.json").write_text(json.dumps(data, indent=1))


def _load(state: Path, name: str) -> Any:
    path = state / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def _run_group(
    command: list[str], timeout: float, **kwargs: Any
) -> subprocess.CompletedProcess[str]:
    """``subprocess.run`` in a process group of its own, killed whole on timeout.

    A GPU test that hangs may have started a ``kvtrio serve`` of its own: killing only pytest
    would leave that server holding the GPU (and its port) after the kit has given up.
    """
    with subprocess.Popen(command, start_new_session=True, text=True, **kwargs) as process:
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, 9)
            process.communicate()
            raise
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def _output(command: list[str]) -> str | None:
    """The stripped stdout of ``command``, or None if it is missing or fails."""
    if shutil.which(command[0]) is None:
        return None
    try:
        result = subprocess.run(
            command, capture_output=True, text=True, timeout=TIMEOUTS["command"], check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return result.stdout.strip() if result.returncode == 0 else None


def preflight(state: Path, dry_run: bool) -> None:
    """Check the machine has what the kit does not carry; record its GPU, driver and versions."""
    missing = _missing(PREINSTALLED)
    no_torch = dry_run and missing and missing[0].startswith("torch ")
    if no_torch:  # a dry run here goes on: the GPU tests skip without torch as well
        missing = missing[1:]
    if missing:
        raise StepFailed(f"missing preinstalled packages in {sys.executable}: {', '.join(missing)}")
    torch: Any = None if no_torch else __import__("torch")
    facts: dict[str, Any] = {
        "python": platform.python_version(),
        "executable": sys.executable,
        "torch_installed": torch is not None,
        "torch": str(torch.__version__) if torch else "not installed (dry run)",
        "torch_cuda": torch.version.cuda if torch else None,
        "gpu_visible": bool(torch and torch.version.cuda and torch.cuda.is_available()),
        "gpu": None,
        "driver": None,
        "nvcc": None,
        "cxx": shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++"),
    }
    smi = _output(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"])
    if smi:
        facts["gpu"], _, facts["driver"] = smi.splitlines()[0].partition(", ")
    if facts["gpu_visible"]:
        facts["gpu"] = facts["gpu"] or torch.cuda.get_device_name(0)
        facts["gpu_count"] = torch.cuda.device_count()
    nvcc = shutil.which("nvcc") or _cuda_home_nvcc()
    if nvcc:
        version = _output([nvcc, "--version"]) or ""
        found = re.search(r"release ([\d.]+)", version)
        facts["nvcc"] = f"{found.group(1) if found else '?'} ({nvcc})"
    _save(state, "facts", facts)
    if dry_run:
        return
    problems = []
    if not facts["torch_cuda"]:
        problems.append(f"torch {facts['torch']} is not a CUDA build")
    elif not facts["gpu_visible"]:
        problems.append("torch sees no GPU (CUDA_VISIBLE_DEVICES? driver?)")
    if smi is None:
        problems.append("nvidia-smi is missing or fails")
    if facts["nvcc"] is None:
        problems.append("nvcc is not on PATH nor in $CUDA_HOME/bin (the CUDA toolkit)")
    if facts["cxx"] is None:
        problems.append("no C++ compiler (g++ or c++, or $CXX)")
    if problems:
        raise StepFailed("; ".join(problems))


def _cuda_home_nvcc() -> str | None:
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    candidate = Path(home) / "bin" / "nvcc"
    return str(candidate) if candidate.exists() else None


def _missing(names: list[str]) -> list[str]:
    """Those of ``names`` that do not import, each with the error."""
    missing = []
    for name in names:
        try:
            __import__(name)
        except ImportError as exc:
            missing.append(f"{name} ({exc})")
    return missing


def imports(state: Path) -> None:
    """Check the venv imports everything the steps after this one need, and finds ninja."""
    facts = _load(state, "facts") or {}
    torchless = not facts.get("torch_installed", True)
    missing = _missing([n for n in INSTALLED if not (torchless and n.startswith("torch"))])
    ninja = _output(["ninja", "--version"])
    if ninja is None:
        missing.append("the ninja command (torch builds extensions with it) on PATH")
    if missing:
        raise StepFailed(f"not importable after the offline install: {', '.join(missing)}")
    import kvtrio

    _save(state, "installed", {"kvtrio": kvtrio.__file__, "ninja": ninja})


def build(state: Path, dry_run: bool) -> None:
    """Build (or load the cached build of) the CUDA extension; in a dry run, see no GPU."""
    from kvtrio.transfer.cuda import torch_runtime

    if dry_run:
        if torch_runtime() is not None:
            raise StepFailed("torch sees a GPU in the dry run (CUDA_VISIBLE_DEVICES not empty?)")
        _save(state, "build", {"dry_run": True})
        return
    import torch

    from kvtrio.transfer._cuda_build import extension_build_dir, load_extension

    directory = extension_build_dir(str(torch.__version__), str(torch.version.cuda))
    start = time.monotonic()
    try:
        load_extension(torch)
    except Exception as exc:  # the compiler's output is in the message
        raise StepFailed(f"building the CUDA extension in {directory} failed: {exc}") from exc
    _save(state, "build", {"directory": str(directory), "seconds": time.monotonic() - start})


def run_tests(state: Path, dry_run: bool) -> None:
    """Run the GPU tests; record passed/failed/skipped and each failure's first line."""
    junit = state / "tests.xml"
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-p",
        "no:cacheprovider",
        "-q",
        "-rfEs",
        f"--junitxml={junit}",
        *GPU_TESTS,
    ]
    log = state / "tests.log"
    with log.open("w") as out:
        try:
            _run_group(command, TIMEOUTS["tests"], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
        except subprocess.TimeoutExpired as exc:
            raise StepFailed(
                f"the GPU tests did not finish in {exc.timeout:.0f} s ({log})"
            ) from exc
    if not junit.exists():
        raise StepFailed(f"pytest wrote no report; its output is in {log}")
    results = parse_junit(junit)
    _save(state, "tests", results)
    if not results["total"]:
        raise StepFailed(f"no GPU test was collected ({' '.join(GPU_TESTS)}); see {log}")
    if dry_run:
        unexpected = [
            f"{case}: {why}"
            for case, why in results["skipped"].items()
            if not NO_GPU_REASON.search(why)
        ]
        ran = results["passed"] + len(results["failed"])
        if ran or unexpected:
            raise StepFailed(
                f"the GPU tests must all skip without a GPU: {ran} ran, "
                f"{len(unexpected)} skipped for another reason {unexpected[:3]} (see {log})"
            )
    elif results["skipped"]:
        first = next(iter(results["skipped"].items()))
        raise StepFailed(f"{len(results['skipped'])} GPU tests skipped on the GPU, e.g. {first}")


def parse_junit(path: Path) -> dict[str, Any]:
    """Counts and details from a pytest JUnit XML report."""
    passed, failed, skipped = 0, {}, {}
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        outcome = next(
            (child for child in case if child.tag in ("failure", "error", "skipped")), None
        )
        if outcome is None:
            passed += 1
        elif outcome.tag == "skipped":
            skipped[name] = outcome.get("message", "")
        else:
            failed[name] = (outcome.get("message") or "").splitlines()[0:1]
    return {
        "total": passed + len(failed) + len(skipped),
        "passed": passed,
        "failed": {k: (v[0] if v else "") for k, v in failed.items()},
        "skipped": skipped,
    }


def bench(state: Path, dry_run: bool, name: str) -> None:
    """Run the bench ``name`` of :data:`gpu_benches.BENCHES`; record its lines and rows."""
    try:
        run_bench(state, name, dry_run)
    except BenchFailed as exc:
        raise StepFailed(str(exc)) from exc


def _steps(state: Path) -> list[dict[str, Any]]:
    """The steps gpu-check.sh ran (``steps.tsv``: name, status, seconds, detail per line)."""
    path = state / "steps.tsv"
    steps = []
    for line in path.read_text().splitlines() if path.exists() else []:
        name, status, seconds, detail = [*line.split("\t", 3), "", "", ""][:4]
        steps.append(
            {"name": name, "status": status, "seconds": float(seconds or 0), "detail": detail}
        )
    return steps


def summary(state: Path, dry_run: bool) -> tuple[str, bool]:
    """The report: machine, steps and their times, tests, bench rows; from what steps saved."""
    steps = _steps(state)
    facts = _load(state, "facts") or {}
    mode = "DRY RUN (no GPU steps)" if dry_run else "GPU run"
    failed = [s for s in steps if s["status"] != "ok"]
    tests = _load(state, "tests")
    bad = failed or not steps or (tests and tests["failed"])
    lines = [
        f"kvtrio GPU check: {mode}: {'FAILED' if bad else 'OK'}",
        f"date: {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}",
        f"commit: {_output(['git', '-C', str(ROOT), 'describe', '--always', '--dirty'])}",
        f"GPU: {facts.get('gpu') or 'none'} (x{facts.get('gpu_count', 0)} visible); "
        f"driver {facts.get('driver') or 'none'}",
        f"torch {facts.get('torch')}, CUDA {facts.get('torch_cuda') or 'none'}; "
        f"nvcc {facts.get('nvcc') or 'none'}; Python {facts.get('python')}",
        "",
        "steps:",
    ]
    for step in steps:
        lines.append(
            f"  {step['name']:<26} {step['status']:<7} {step['seconds']:6.1f} s"
            + (f"  {step['detail']}" if step.get("detail") else "")
        )
    lines.append(f"  total {sum(s['seconds'] for s in steps):.0f} s")
    if tests:
        lines += [
            "",
            f"tests: {tests['passed']} passed, {len(tests['failed'])} failed, "
            f"{len(tests['skipped'])} skipped (of {tests['total']} GPU tests)",
        ]
        lines += [f"  FAILED {name}: {why}" for name, why in tests["failed"].items()]
    lines += summary_lines(state)
    lines += ["", f"logs: {state}"]
    return "\n".join(lines) + "\n", not bad


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "step", choices=["preflight", "imports", "build", "tests", "bench", "summary"]
    )
    parser.add_argument("--state", type=Path, required=True)
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--name", choices=list(BENCHES), help="bench: which one")
    parser.add_argument("--out", type=Path, help="summary: write it here, not to stdout")
    args = parser.parse_args(argv)
    args.state.mkdir(parents=True, exist_ok=True)
    try:
        if args.step == "preflight":
            preflight(args.state, args.dry_run)
        elif args.step == "imports":
            imports(args.state)
        elif args.step == "build":
            build(args.state, args.dry_run)
        elif args.step == "tests":
            run_tests(args.state, args.dry_run)
        elif args.step == "bench":
            if args.name is None:
                parser.error("bench needs --name")
            bench(args.state, args.dry_run, args.name)
        else:
            text, ok = summary(args.state, args.dry_run)
            if args.out:
                args.out.write_text(text)
            else:
                sys.stdout.write(text)
            return 0 if ok else 1
    except StepFailed as exc:
        print(f"gpu-check: {args.step}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
