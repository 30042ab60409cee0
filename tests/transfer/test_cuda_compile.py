"""The CUDA sources compile: kernels with nvcc for sm_80 and sm_90, the torch binding with g++.

Compile only (no GPU needed, nothing is linked or run). These take a while, so they run in the
``cuda`` tox env, which sets ``KVTRIO_REQUIRE_CUDA_BUILD=1``; elsewhere they are skipped. Where
nvcc is absent (a machine without the CUDA toolkit) the kernel compile skips with a message that
says so; where nvcc is present, a failing compile fails.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest

from kvtrio.transfer._cuda_build import SOURCE_DIR

REQUIRED = os.environ.get("KVTRIO_REQUIRE_CUDA_BUILD", "") not in ("", "0")
pytestmark = pytest.mark.skipif(not REQUIRED, reason="compiled in the cuda tox env")
ARCHS = ("sm_80", "sm_90")


CUDA_HOME = Path(os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda")


def find_nvcc() -> str:
    nvcc = shutil.which("nvcc") or str(CUDA_HOME / "bin" / "nvcc")
    if not Path(nvcc).exists():
        pytest.skip(
            f"nvcc not found (PATH, or $CUDA_HOME/bin={CUDA_HOME / 'bin'}): the kernels' "
            "compile check needs the CUDA toolkit and was NOT run"
        )
    return nvcc


def compile_or_fail(command: list[str]) -> None:
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    assert result.returncode == 0, f"{' '.join(command)}\n{result.stdout}\n{result.stderr}"


def test_kernels_compile_for_sm80_and_sm90(tmp_path: Path) -> None:
    nvcc = find_nvcc()
    gencode = [f"-gencode=arch=compute_{a[3:]},code={a}" for a in ARCHS]
    output = tmp_path / "kernels.o"
    compile_or_fail([
        nvcc, "-c", "-std=c++17", "-O3", "-Werror", "all-warnings", *gencode,
        "-I", str(SOURCE_DIR), str(SOURCE_DIR / "kvtrio_kernels.cu"), "-o", str(output),
    ])  # fmt: skip
    assert output.stat().st_size > 0
    # The fat binary records the ptxas options of each target's machine code.
    data = output.read_bytes()
    for arch in ARCHS:
        assert f"-arch {arch} ".encode() in data, f"no {arch} code in the object"


def test_torch_binding_compiles(tmp_path: Path) -> None:
    """kvtrio_ext.cpp against torch's headers (the CPU wheel ships the CUDA ones too, minus
    one generated header, stubbed here) and the CUDA toolkit's."""
    extension = pytest.importorskip("torch.utils.cpp_extension")
    stub = tmp_path / "stub" / "c10" / "cuda" / "impl"
    stub.mkdir(parents=True)
    (stub / "cuda_cmake_macros.h").write_text("#pragma once\n")
    cuda_include = CUDA_HOME / "include"
    if not (cuda_include / "cuda_runtime.h").exists():
        pytest.skip(
            f"no CUDA toolkit headers in $CUDA_HOME/include={cuda_include}: the binding's "
            "compile check needs the CUDA toolkit and was NOT run"
        )
    includes = [str(tmp_path / "stub"), *extension.include_paths(), str(cuda_include),
                sysconfig.get_paths()["include"], str(SOURCE_DIR)]  # fmt: skip
    compiler = os.environ.get("CXX") or shutil.which("g++") or "c++"
    compile_or_fail([
        compiler, "-std=c++20", "-fsyntax-only", "-Wall", "-Wno-unused-parameter",
        "-DTORCH_EXTENSION_NAME=kvtrio_cuda", *(f"-I{i}" for i in includes),
        str(SOURCE_DIR / "kvtrio_ext.cpp"),
    ])  # fmt: skip
