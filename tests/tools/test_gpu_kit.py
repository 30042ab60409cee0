"""The offline GPU kit (tools/gpu-check.sh and tools/gpu_check.py), checked without a GPU.

Any GPU is hidden from the child processes (``CUDA_VISIBLE_DEVICES=""``), so these behave the
same on a GPU machine.

The whole dry run (wheelhouse, offline install, every step) is the ``gpu-kit`` tox env; these are
the cheap parts of it: the GPU test selection and its skipping logic, the loud failures, and the
summary.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHECK = ROOT / "tools" / "gpu-check.sh"


def _load_helper() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "tools" / "gpu_check.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gpu_check = _load_helper()
NO_GPU = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}


def test_the_selection_is_every_gpu_test_and_all_skip_here(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "gpu_check.py"), "tests", "--dry-run",
         "--state", str(tmp_path)],
        env=NO_GPU, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr + (tmp_path / "tests.log").read_text()
    tests = json.loads((tmp_path / "tests.json").read_text())
    assert tests["total"] == len(tests["skipped"]) > 200
    assert any("test_cuda_e2e" in name for name in tests["skipped"])
    assert any("cuda-extension" in name for name in tests["skipped"])
    assert any("cuda-torch" in name for name in tests["skipped"])
    # Every test module that skips for want of a GPU is in the selection.
    selected = {arg for arg in gpu_check.GPU_TESTS if arg.endswith(".py")}
    skipping = {
        str(path.relative_to(ROOT))
        for path in (ROOT / "tests").rglob("test_*.py")
        if path.name != Path(__file__).name
        and re.search(r"""["'][^"'\n]*(?:no CUDA GPU|needs a CUDA GPU)""", path.read_text())
    }
    assert skipping <= selected


def test_a_dry_run_fails_if_a_selected_test_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setattr(gpu_check, "GPU_TESTS", [
        "tests/transfer/test_transfer_engines.py", "-k", "test_bad_block_ids and cpu",
    ])  # fmt: skip
    with pytest.raises(gpu_check.StepFailed, match="must all skip without a GPU: 1 ran"):
        gpu_check.run_tests(tmp_path, dry_run=True)


def _check(tmp_path: Path, wheelhouse: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**NO_GPU, "PYTHON": sys.executable, "WHEELHOUSE": str(wheelhouse),
           "VENV": str(tmp_path / "venv"), "OUT": str(tmp_path / "out")}  # fmt: skip
    return subprocess.run(["bash", str(CHECK), *args], env=env, capture_output=True, text=True,
                          timeout=120, check=False)  # fmt: skip


def _report(tmp_path: Path) -> str:
    (report,) = (tmp_path / "out").glob("gpu-check-*.txt")
    return report.read_text()


def test_the_gpu_run_stops_at_preflight_naming_what_is_missing(tmp_path: Path) -> None:
    wheelhouse = tmp_path / "wheelhouse"
    wheelhouse.mkdir()
    (wheelhouse / "kvtrio-0.0.0-py3-none-any.whl").touch()
    result = _check(tmp_path, wheelhouse)
    assert result.returncode == 1
    assert "FAILED at step 'preflight'" in result.stderr
    # Here: torch is missing, or a CPU build, or sees no GPU; and there is no nvidia-smi.
    assert re.search(r"missing preinstalled packages|not a CUDA build|sees no GPU", result.stderr)
    assert not (tmp_path / "venv").exists()
    report = _report(tmp_path)
    assert report.startswith("kvtrio GPU check: GPU run: FAILED")
    assert re.search(r"^  preflight +FAILED", report, re.MULTILINE)


def test_a_missing_wheelhouse_is_named(tmp_path: Path) -> None:
    result = _check(tmp_path, tmp_path / "nowhere", "--dry-run")
    assert result.returncode == 1
    assert f"no kvtrio wheel in {tmp_path / 'nowhere'}" in result.stderr
    assert "DRY RUN (no GPU steps): FAILED" in _report(tmp_path)


def test_bad_arguments_are_refused(tmp_path: Path) -> None:
    result = _check(tmp_path, tmp_path, "--gpu")
    assert result.returncode == 2
    assert "usage" in result.stderr


def _bench_line(label: str, store: float, d2h: float, retrieve: float, h2d: float) -> str:
    # As bench/cuda_transfer.py prints it (checked against its source below).
    return (
        f"{label}: store {store:.1f} GB/s = {store / d2h:.2f} × raw d2h {d2h:.1f}; retrieve "
        f"{retrieve:.1f} GB/s = {retrieve / h2d:.2f} × raw h2d {h2d:.1f}; enqueue store 9.5 µs, "
        "retrieve 8.25 µs"
    )


def test_bench_rows_are_parsed() -> None:
    source = (ROOT / "bench" / "cuda_transfer.py").read_text()
    for fragment in ("MiB chunks): store \"\n", "{rate['store']:.1f} GB/s = ",
                     "{rate['store'] / rate['raw d2h']:.2f} × raw d2h ",
                     "{rate['raw d2h']:.1f}; retrieve {rate['retrieve']:.1f} GB/s = ",
                     ":.2f} × raw h2d {rate['raw h2d']:.1f}; ", "enqueue store ",
                     "{rate['enqueue store']:.1f} µs, retrieve ",
                     "{rate['enqueue retrieve']:.1f} µs"):  # fmt: skip
        assert fragment in source, f"bench/cuda_transfer.py no longer prints {fragment!r}"
    output = "kernels: extension; NVIDIA H100\n" + "\n".join([
        _bench_line("mapped 16 blocks (32 MiB chunks)", 24.3, 25.0, 23.9, 25.5),
        _bench_line("staged 1 blocks (2 MiB chunks)", 12.0, 20.0, 11.0, 22.0),
        "mapped constant: one 1-block chunk: store 70.0 µs (raw 60.0), ...",
    ])  # fmt: skip
    rows = gpu_check.parse_bench(output)
    assert [row["label"] for row in rows] == [
        "mapped 16 blocks (32 MiB chunks)", "staged 1 blocks (2 MiB chunks)",
    ]  # fmt: skip
    assert rows[0]["store_ratio"] == 0.97
    assert rows[1]["retrieve_ratio"] == 0.5
    assert rows[0]["h2d"] == 25.5
    assert rows[0]["enqueue_retrieve"] == 8.25


def _state(tmp_path: Path, failed_tests: dict[str, str]) -> Path:
    (tmp_path / "steps.tsv").write_text("preflight\tok\t1.5\t\ntests\tok\t20.0\t\n")
    (tmp_path / "facts.json").write_text(json.dumps({
        "gpu": "NVIDIA H100 80GB HBM3", "gpu_count": 1, "driver": "550.54.15",
        "torch": "2.13.0+cu128", "torch_cuda": "12.8", "nvcc": "12.8 (/usr/local/cuda/bin/nvcc)",
        "python": "3.12.3",
    }))  # fmt: skip
    (tmp_path / "tests.json").write_text(json.dumps({
        "total": 257, "passed": 257 - len(failed_tests), "failed": failed_tests, "skipped": {},
    }))  # fmt: skip
    line = _bench_line("mapped 16 blocks (32 MiB chunks)", 24.3, 25.0, 23.9, 25.5)
    rows = gpu_check.parse_bench(line)
    (tmp_path / "bench-transfer-extension.json").write_text(
        json.dumps({"lines": [line], "rows": rows})
    )
    e2e = "e2e 64 MiB in 2 MiB chunks: store 40.0 GB/s (1.68 ms) = 0.90 × raw d2h 44.4; ..."
    (tmp_path / "bench-e2e.json").write_text(json.dumps({"lines": [e2e], "rows": []}))
    (tmp_path / "bench-prefill.json").write_text(json.dumps({"timed_out": 240.0}))
    return tmp_path


def test_the_summary_has_the_machine_the_tests_and_the_ratios(tmp_path: Path) -> None:
    text, ok = gpu_check.summary(_state(tmp_path, {}), dry_run=False)
    assert ok
    assert text.startswith("kvtrio GPU check: GPU run: OK")
    assert "GPU: NVIDIA H100 80GB HBM3 (x1 visible); driver 550.54.15" in text
    assert "torch 2.13.0+cu128, CUDA 12.8; nvcc 12.8" in text
    assert "tests: 257 passed, 0 failed, 0 skipped (of 257 GPU tests)" in text
    assert "  mapped 16 blocks (32 MiB chunks): store 24.3 GB/s = 0.97 × raw d2h 25.0" in text
    assert "retrieve 23.9 GB/s = 0.94 × raw h2d 25.5; enqueue store 9.5 µs" in text
    assert "bench/cuda_e2e.py (a CUDA worker against a real kvtrio serve" in text
    assert "  e2e 64 MiB in 2 MiB chunks: store 40.0 GB/s (1.68 ms) = 0.90 × raw d2h" in text
    assert "bench/cuda_prefill.py (8B Llama prefill" in text
    assert "  TIMED OUT after 240 s" in text


def test_a_failed_test_fails_the_summary(tmp_path: Path) -> None:
    failed = {"tests.e2e.test_cuda_e2e::test_x[mla]": "AssertionError: bytes differ"}
    text, ok = gpu_check.summary(_state(tmp_path, failed), dry_run=False)
    assert not ok
    assert text.startswith("kvtrio GPU check: GPU run: FAILED")
    assert "FAILED tests.e2e.test_cuda_e2e::test_x[mla]: AssertionError: bytes differ" in text


def test_junit_reports_are_counted(tmp_path: Path) -> None:
    junit = tmp_path / "junit.xml"
    junit.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="a" name="ok"/>'
        '<testcase classname="a" name="bad"><failure message="assert 1 == 2&#10;more"/></testcase>'
        '<testcase classname="a" name="err"><error message="fixture broke"/></testcase>'
        '<testcase classname="a" name="skip"><skipped message="no CUDA GPU"/></testcase>'
        "</testsuite></testsuites>"
    )
    assert gpu_check.parse_junit(junit) == {
        "total": 4,
        "passed": 1,
        "failed": {"a::bad": "assert 1 == 2", "a::err": "fixture broke"},
        "skipped": {"a::skip": "no CUDA GPU"},
    }


def test_hung_tests_fail_the_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setitem(gpu_check.TIMEOUTS, "tests", 0.01)
    with pytest.raises(gpu_check.StepFailed, match="did not finish in 0 s"):
        gpu_check.run_tests(tmp_path, dry_run=True)


def test_the_gpu_run_refuses_skipped_tests_and_a_refusing_bench(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the real run does with a machine without a GPU: both steps fail, loudly."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setattr(gpu_check, "GPU_TESTS", ["tests/e2e/test_cuda_e2e.py"])
    with pytest.raises(gpu_check.StepFailed, match=r"3 GPU tests skipped on the GPU, e\.g\."):
        gpu_check.run_tests(tmp_path, dry_run=False)
    assert json.loads((tmp_path / "tests.json").read_text())["passed"] == 0
    with pytest.raises(gpu_check.StepFailed, match=r"--kernels torch failed: .*needs a CUDA GPU"):
        gpu_check.bench(tmp_path, dry_run=False, name="transfer-torch")
    for name in ("e2e", "prefill"):  # they refuse as loudly
        with pytest.raises(gpu_check.StepFailed, match=r"failed: .*needs a CUDA GPU"):
            gpu_check.bench(tmp_path, dry_run=False, name=name)


def test_the_wheelhouse_script_wants_a_python_version() -> None:
    script = ROOT / "tools" / "gpu-wheelhouse.sh"
    for args in ([], ["3"], ["3.12", "extra"], ["python3.12"]):
        result = subprocess.run(["bash", str(script), *args], capture_output=True, text=True,
                                timeout=30, check=False)  # fmt: skip
        assert result.returncode == 2, args
        assert "usage" in result.stderr


def test_a_missing_python_is_named(tmp_path: Path) -> None:
    env = {**NO_GPU, "PYTHON": str(tmp_path / "python3.12"), "OUT": str(tmp_path / "out")}
    result = subprocess.run(["bash", str(CHECK), "--dry-run"], env=env, capture_output=True,
                            text=True, timeout=60, check=False)  # fmt: skip
    assert result.returncode == 1
    assert f"no Python: {tmp_path / 'python3.12'} (set PYTHON)" in result.stderr
    assert "preflight\tFAILED" in result.stderr
