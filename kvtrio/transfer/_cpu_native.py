"""The optional C helper of the CPU copy path, built on first use; numpy is the fallback.

``cpu_ext/kvtrio_cpu.c`` copies the ``vllm_cpu`` layout (whose K is stored transposed per block
and head) with 8×8 register-tile transposes: numpy can only move those elements one at a time,
at about half of memcpy (``bench/transfer.py``). The first :func:`vllm_cpu_copier` call of a
process compiles it with the C compiler (``$CC``, ``cc`` or ``gcc``; a fraction of a second) into
the kvtrio cache, keyed by a digest of the source, and loads it through ctypes; every later
process loads the cached library. Nothing requires a compiler: without one, with
``KVTRIO_NO_EXT=1``, or if the build fails (logged once), :func:`vllm_cpu_copier` returns None
and :mod:`._cpu` copies with numpy, byte for byte the same.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from ._cuda_build import cache_root, extension_disabled
from ._layouts import KVLayout

__all__ = ["SOURCE", "build_cpu_library", "reset", "vllm_cpu_copier"]

log = logging.getLogger("kvtrio.transfer")

SOURCE = Path(__file__).with_name("cpu_ext") / "kvtrio_cpu.c"
_ABI = 1

Array = npt.NDArray[Any]
Copier = Callable[[KVLayout, Sequence[Array], npt.NDArray[np.intp], Array, bool], None]
"""``copier(layout, layers, ids, chunk_bytes, gather)``: arguments already validated."""

_lock = threading.Lock()
_state: dict[str, Any] = {}


def _digest() -> str:
    return hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]


def build_cpu_library(directory: Path | None = None, compiler: str | None = None) -> Path:
    """Compile the helper (once per source digest) and return its path.

    Raises ``RuntimeError`` with the compiler's output if it fails, or if there is no C compiler.
    Blocking (a fraction of a second the first time); concurrent builders each install a complete
    file atomically.
    """
    compiler = compiler or os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        raise RuntimeError("no C compiler found (set CC, or install gcc)")
    digest = _digest()
    directory = directory or cache_root().parent / "cpu_ext"
    target = directory / f"libkvtrio_cpu-{digest}.so"
    if target.exists():
        return target
    directory.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f"{target.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    command = [compiler, "-O3", "-std=c11", "-shared", "-fPIC", "-Wall", "-Wextra", "-Werror",
               str(SOURCE), "-o", str(partial)]  # fmt: skip
    try:
        result = subprocess.run(command, capture_output=True, text=True, check=False, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RuntimeError(f"building the kvtrio CPU helper failed: {exc}") from exc
    if result.returncode != 0:
        partial.unlink(missing_ok=True)
        raise RuntimeError(f"building the kvtrio CPU helper failed:\n{result.stderr}")
    os.replace(partial, target)
    return target


def _load(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))  # CDLL: calls release the GIL
    lib.kvt_cpu_abi.restype = ctypes.c_int
    if lib.kvt_cpu_abi() != _ABI:
        raise RuntimeError(f"{path} has ABI {lib.kvt_cpu_abi()}, expected {_ABI}")
    i64 = ctypes.c_int64
    lib.kvt_cpu_vllm_cpu_copy.argtypes = [
        ctypes.c_void_p, i64, ctypes.c_void_p, i64, i64, i64, i64, i64, i64, i64, i64,
        ctypes.c_void_p, ctypes.c_int,
    ]  # fmt: skip
    lib.kvt_cpu_vllm_cpu_copy.restype = ctypes.c_int
    return lib


def _library() -> ctypes.CDLL | None:
    """The loaded helper, building it the first time; None if unavailable (reason logged once)."""
    if "lib" in _state:
        return _state["lib"]  # type: ignore[no-any-return]
    with _lock:
        if "lib" not in _state:
            lib = None
            if extension_disabled():
                log.info("KVTRIO_NO_EXT is set: vllm_cpu layers are copied with numpy")
            else:
                try:
                    lib = _load(build_cpu_library())
                except (RuntimeError, OSError) as exc:
                    log.warning(
                        "kvtrio: the CPU copy helper is unavailable (%s); vllm_cpu layers are "
                        "copied with numpy, at about half of memcpy speed",
                        exc,
                    )
            _state["lib"] = lib
    return _state["lib"]  # type: ignore[no-any-return]


def reset() -> None:
    """Forget the loaded helper (tests: the next call decides again)."""
    with _lock:
        _state.clear()


def _copy(
    lib: ctypes.CDLL,
    layout: KVLayout,
    layers: Sequence[Array],
    ids: npt.NDArray[np.intp],
    chunk: Array,
    gather: bool,
) -> None:
    strides = {layer.strides for layer in layers}
    if len(strides) != 1:  # one stride set per call; rare enough to split per layer
        per_layer = chunk.reshape(len(layers), -1)
        for layer, part in zip(layers, per_layer, strict=True):
            _copy(lib, layout, [layer], ids, part, gather)
        return
    ((block, head, kv, _, _),) = strides
    bases = np.fromiter((layer.ctypes.data for layer in layers), np.uint64, len(layers))
    ids64 = np.ascontiguousarray(ids, dtype=np.int64)
    code = lib.kvt_cpu_vllm_cpu_copy(
        bases.ctypes.data, len(layers), ids64.ctypes.data, len(ids64), layout.num_heads,
        layout.block_size, layout.head_dim, layout.element_size, block, head, kv,
        chunk.ctypes.data, int(gather),
    )  # fmt: skip
    if code:
        raise ValueError(f"the CPU copy helper refused the arguments (code {code})")


def vllm_cpu_copier() -> Copier | None:
    """The C copy of ``vllm_cpu`` layers, or None if the helper is unavailable (then use numpy).

    The copier trusts its arguments (validated by :mod:`._cpu`): layers of ``layout.layer_shape``
    whose last two axes are contiguous, ids in range, a C-contiguous chunk of the right size.
    """
    lib = _library()
    if lib is None:
        return None

    def copier(
        layout: KVLayout, layers: Sequence[Array], ids: npt.NDArray[np.intp], chunk: Array,
        gather: bool,
    ) -> None:  # fmt: skip
        _copy(lib, layout, layers, ids, chunk, gather)

    return copier
