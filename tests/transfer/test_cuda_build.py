"""Where the extension is built and cached, and which kernels are chosen (no GPU needed)."""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import pytest

from kvtrio.transfer import cuda
from kvtrio.transfer._cuda_build import (
    EXTENSION_SOURCES,
    SOURCE_DIR,
    build_host_library,
    cache_root,
    extension_build_dir,
    load_extension,
    source_digest,
)


def fake_torch(version_cuda: str | None = "12.4") -> Any:
    return types.SimpleNamespace(
        __version__="2.13.0+cu124", version=types.SimpleNamespace(cuda=version_cuda)
    )


def test_the_sources_ship_inside_the_package() -> None:
    assert SOURCE_DIR.parent.name == "transfer"
    for name in (*EXTENSION_SOURCES, "kvtrio_index.h", "kvtrio_batch.h", "kvtrio_host.cpp"):
        assert (SOURCE_DIR / name).is_file()
    assert Path(__file__).parents[2].joinpath("cuda_ext").resolve() == SOURCE_DIR.resolve()


def test_cache_location(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KVTRIO_CACHE_DIR", str(tmp_path / "c"))
    assert cache_root() == tmp_path / "c" / "cuda_ext"
    monkeypatch.delenv("KVTRIO_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert cache_root() == tmp_path / "x" / "kvtrio" / "cuda_ext"


def test_build_dir_changes_with_sources_and_versions(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("KVTRIO_CACHE_DIR", str(tmp_path))
    a = extension_build_dir("2.13.0+cu124", "12.4")
    assert a.parent == tmp_path / "cuda_ext"
    assert a.name.startswith(
        source_digest(("kvtrio_index.h", "kvtrio_batch.h", "kvtrio_kernels.h", *EXTENSION_SOURCES))
    )
    assert extension_build_dir("2.13.0+cu124", "12.4") == a  # stable: the next process reuses it
    assert extension_build_dir("2.14.0+cu124", "12.4") != a
    assert extension_build_dir("2.13.0+cu124", "12.8") != a


def test_load_extension_builds_into_the_cache(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("KVTRIO_CACHE_DIR", str(tmp_path))
    calls: list[dict[str, Any]] = []

    def loader(**kwargs: Any) -> str:
        calls.append(kwargs)
        return "module"

    assert load_extension(fake_torch(), loader) == "module"
    (call,) = calls
    assert Path(call["build_directory"]).is_dir()
    assert Path(call["build_directory"]) == extension_build_dir("2.13.0+cu124", "12.4")
    assert [Path(s).name for s in call["sources"]] == list(EXTENSION_SOURCES)
    assert call["extra_include_paths"] == [str(SOURCE_DIR)]


def test_kernel_choice(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KVTRIO_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("KVTRIO_NO_EXT", raising=False)

    def broken(**kwargs: Any) -> Any:
        raise RuntimeError("nvcc: not found")

    assert cuda.kernel_choice(fake_torch(), lambda **kw: "ext") == ("extension", "ext", "")
    assert cuda.kernel_choice(fake_torch(None), lambda **kw: "ext")[0::2] == (
        "torch", "torch was built without CUDA")  # fmt: skip
    kind, module, why = cuda.kernel_choice(fake_torch(), broken)
    assert (kind, module) == ("torch", None)
    assert "building the CUDA extension failed: nvcc: not found" in why
    monkeypatch.setenv("KVTRIO_NO_EXT", "1")
    assert cuda.kernel_choice(fake_torch(), lambda **kw: "ext")[0::2] == (
        "torch",
        "KVTRIO_NO_EXT is set",
    )
    monkeypatch.setenv("KVTRIO_NO_EXT", "0")
    assert cuda.kernel_choice(fake_torch(), lambda **kw: "ext")[0] == "extension"


def test_no_runtime_without_a_gpu() -> None:
    """Here torch (if installed) is a CPU build: no runtime, so the server refuses CUDA
    registrations and the adapter CUDA tensors, with a message (see the server tests)."""
    assert cuda.torch_runtime() is None


def test_host_library_is_built_once(tmp_path: Path) -> None:
    try:
        first = build_host_library(tmp_path)
    except RuntimeError as exc:
        pytest.skip(str(exc))
    mtime = first.stat().st_mtime_ns
    assert build_host_library(tmp_path) == first
    assert first.stat().st_mtime_ns == mtime
    with pytest.raises(RuntimeError, match="building the kvtrio host library failed"):
        build_host_library(tmp_path / "other", compiler="false")
