"""Building the CUDA sources: the torch extension at first use, the host library for tests.

The sources live in ``kvtrio/transfer/cuda_ext/`` (package data: the wheel stays pure Python).

* The **extension** (kernels + torch binding) is built by ``torch.utils.cpp_extension.load``, and
  only where it can run: torch was built with CUDA (``torch.version.cuda``) and a GPU is visible.
  Its build directory is keyed by a digest of the sources, the torch and CUDA versions and the
  Python version, under the kvtrio cache (``$KVTRIO_CACHE_DIR``, else ``$XDG_CACHE_HOME/kvtrio``,
  else ``~/.cache/kvtrio``), so every process after the first loads it in milliseconds and an
  upgrade of kvtrio or torch rebuilds it. ``KVTRIO_NO_EXT=1`` skips it; a failed build is logged
  once and the pure-torch kernels take over.
* The **host library** (``kvtrio_host.cpp``: the kernels' index arithmetic compiled by the C++
  compiler, no CUDA) is what the tests load through ctypes; see :mod:`._hostlib`.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = [
    "EXTENSION_SOURCES",
    "HOST_SOURCES",
    "SOURCE_DIR",
    "build_host_library",
    "cache_root",
    "extension_build_dir",
    "extension_disabled",
    "load_extension",
    "source_digest",
]

log = logging.getLogger("kvtrio.cuda")

SOURCE_DIR = Path(__file__).with_name("cuda_ext")
HEADERS = ("kvtrio_index.h", "kvtrio_batch.h", "kvtrio_kernels.h")
EXTENSION_SOURCES = ("kvtrio_ext.cpp", "kvtrio_kernels.cu")
HOST_SOURCES = ("kvtrio_host.cpp",)

Loader = Callable[..., Any]


def source_digest(names: tuple[str, ...] = HEADERS + EXTENSION_SOURCES + HOST_SOURCES) -> str:
    """A short digest of the named source files (their names and bytes)."""
    digest = hashlib.sha256()
    for name in sorted(names):
        digest.update(name.encode() + b"\0")
        digest.update((SOURCE_DIR / name).read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def cache_root() -> Path:
    """Where built libraries are kept: ``$KVTRIO_CACHE_DIR``, ``$XDG_CACHE_HOME/kvtrio`` or
    ``~/.cache/kvtrio``, then ``cuda_ext``."""
    explicit = os.environ.get("KVTRIO_CACHE_DIR")
    if explicit:
        return Path(explicit) / "cuda_ext"
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvtrio" / "cuda_ext"


def extension_disabled() -> bool:
    """Whether ``KVTRIO_NO_EXT`` asks for the pure-torch kernels (any value but empty or 0)."""
    return os.environ.get("KVTRIO_NO_EXT", "").strip() not in ("", "0")


def extension_build_dir(torch_version: str, cuda_version: str) -> Path:
    """The build directory of the extension for these versions and these sources."""
    python = f"py{sys.version_info.major}{sys.version_info.minor}"
    safe = "".join(c if c.isalnum() or c in ".-" else "_" for c in torch_version)
    key = f"{source_digest(HEADERS + EXTENSION_SOURCES)}-torch{safe}-cu{cuda_version}-{python}"
    return cache_root() / key


def load_extension(torch: Any, loader: Loader | None = None) -> Any:
    """Build (first time) and import the extension module for this torch; raises on failure.

    Blocking (a first build takes a minute or two): call it from a worker thread.
    ``torch.utils.cpp_extension.load`` keeps the build up to date in its directory and locks it
    against concurrent builds by other processes.
    """
    if loader is None:
        from torch.utils.cpp_extension import load

        loader = load
    cuda_version = str(torch.version.cuda)
    directory = extension_build_dir(str(torch.__version__), cuda_version)
    directory.mkdir(parents=True, exist_ok=True)
    name = f"kvtrio_cuda_{directory.name.split('-')[0]}"
    return loader(
        name=name,
        sources=[str(SOURCE_DIR / source) for source in EXTENSION_SOURCES],
        extra_include_paths=[str(SOURCE_DIR)],
        extra_cflags=["-O3"],
        extra_cuda_cflags=["-O3"],
        build_directory=str(directory),
        verbose=False,
    )


def build_host_library(directory: Path | None = None, compiler: str | None = None) -> Path:
    """Compile the host library (once per source digest) and return its path.

    Raises ``RuntimeError`` with the compiler's output if it fails, or if there is no C++
    compiler (``$CXX``, ``g++`` or ``c++`` on ``PATH``).
    """
    compiler = compiler or os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not compiler:
        raise RuntimeError("no C++ compiler found (set CXX, or install g++)")
    digest = source_digest(HEADERS + HOST_SOURCES)
    directory = directory or cache_root() / f"host-{digest}"
    target = directory / f"libkvtrio_host-{digest}.so"
    if target.exists():
        return target
    directory.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f"{target.name}.{os.getpid()}.tmp")
    command = [
        compiler,
        "-O2",
        "-std=c++17",
        "-shared",
        "-fPIC",
        "-Wall",
        "-Wextra",
        "-Werror",
        "-I",
        str(SOURCE_DIR),
        str(SOURCE_DIR / HOST_SOURCES[0]),
        "-o",
        str(partial),
    ]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        partial.unlink(missing_ok=True)
        raise RuntimeError(f"building the kvtrio host library failed:\n{result.stderr}")
    os.replace(partial, target)  # atomic: concurrent builders each install a complete file
    return target
