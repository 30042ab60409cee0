"""The optional C helper of the CPU copy path, built on first use; numpy is the fallback.

``cpu_ext/kvtrio_cpu.c`` copies the ``vllm_cpu`` layout (whose K is stored transposed per block
and head) with register-tile transposes, one head at a time through a stage in L1: numpy can only
move those elements one at a time, at about half of memcpy (``bench/transfer.py``). The tiles use
SSE2, or AVX2 where the CPU has it (checked at run time: the library itself assumes only
x86-64); other CPUs get a scalar loop. The helper also copies the rows of the other layouts with
plain vector moves: glibc's ``memcpy`` (which numpy uses) falls 10-20× below memory speed on the
AMD EPYC machines here when source and destination are misaligned to each other in some ways,
which is what a page-aligned arena slot and a numpy-allocated KV cache (16 mod 64) are.
The first :func:`cpu_helper` call of a process compiles it with the C compiler (``$CC``, ``cc``
or ``gcc``; a fraction of a second) into the kvtrio cache, keyed by a digest of the source, and
loads it through ctypes; every later process loads the cached library. Nothing requires a
compiler: without one, with ``KVTRIO_NO_EXT=1``, or if the build fails (logged once),
:func:`cpu_helper` returns None and :mod:`._cpu` copies with numpy, byte for byte the same.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import threading
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from ._cuda_build import cache_root, extension_disabled
from ._layouts import KVLayout

__all__ = ["ISAS", "PREFETCHES", "SOURCE", "CpuHelper", "build_cpu_library", "cpu_helper", "reset"]

log = logging.getLogger("kvtrio.transfer")

SOURCE = Path(__file__).with_name("cpu_ext") / "kvtrio_cpu.c"
_ABI = 6

ISAS = ("scalar", "sse2", "avx2")
"""The instruction sets the helper's copies can use, in the order of ``kvt_cpu_isa``'s levels."""
PREFETCHES = ("l1", "l2")
"""Where the helper's software prefetches bring lines, in the order of ``kvt_cpu_prefetch``'s
levels: L2 on AMD CPUs (into L1 they stalled the copies there), L1 elsewhere."""

Array = npt.NDArray[Any]
ChunkPart = tuple[npt.NDArray[np.intp], Array, int, int]
"""``(block ids, chunk, first, span)``: blocks ``[first, first + len(ids))`` of a canonical chunk
of ``span`` blocks (see :meth:`CpuHelper.vllm_cpu_parts`)."""

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
    # No -Werror here: a new compiler's new warning must not cost users the helper (the tests
    # compile it with -Werror).
    command = [compiler, "-O3", "-std=c11", "-shared", "-fPIC", "-Wall", "-Wextra",
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
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.kvt_cpu_vllm_cpu_copy.argtypes = [
        ptr, i64, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64, i64, i64, ctypes.c_int
    ]  # fmt: skip
    lib.kvt_cpu_vllm_cpu_copy.restype = ctypes.c_int
    lib.kvt_cpu_rows.argtypes = [ptr, i64, ptr, ptr, i64, i64, i64, ptr, ctypes.c_int]
    lib.kvt_cpu_rows.restype = ctypes.c_int
    lib.kvt_cpu_isa.argtypes = [ctypes.c_int]
    lib.kvt_cpu_isa.restype = ctypes.c_int
    lib.kvt_cpu_prefetch.argtypes = [ctypes.c_int]
    lib.kvt_cpu_prefetch.restype = ctypes.c_int
    return lib


def _library() -> ctypes.CDLL | None:
    """The loaded helper, building it the first time; None if unavailable (reason logged once)."""
    if "lib" in _state:
        return _state["lib"]  # type: ignore[no-any-return]
    with _lock:
        if "lib" not in _state:
            lib = None
            if extension_disabled():
                log.info("KVTRIO_NO_EXT is set: KV blocks are copied with numpy")
            else:
                try:
                    lib = _load(build_cpu_library())
                except (RuntimeError, OSError) as exc:
                    log.warning(
                        "kvtrio: the CPU copy helper is unavailable (%s); KV blocks are copied "
                        "with numpy (vllm_cpu layers at about half of memcpy speed)",
                        exc,
                    )
            _state["lib"] = lib
    return _state["lib"]  # type: ignore[no-any-return]


def reset() -> None:
    """Forget the loaded helper (tests: the next call decides again), lift any cap on its
    instruction set and restore the CPU's prefetch level (the library stays loaded in the
    process, with its state)."""
    with _lock:
        lib = _state.get("lib")
        if lib is not None:
            lib.kvt_cpu_isa(len(ISAS) - 1)
            lib.kvt_cpu_prefetch(-2)
        _state.clear()


_BASES: dict[tuple[int, ...], tuple[tuple[weakref.ref[Array], ...], npt.NDArray[np.uint64]]] = {}
"""Recent lists of layers (by the ids of their arrays): weak references to the arrays, and
their base addresses."""


def _bases(layers: Sequence[Array]) -> npt.NDArray[np.uint64]:
    """The base addresses of ``layers``, as ``uint64``.

    ``layer.ctypes.data`` costs ~3 µs an array here, a tenth of a 30-layer copy of 11 MiB, and an
    engine hands over the same arrays every time: so the addresses are kept while those arrays
    live (weak references tell), since an array's data never moves (a resize in place changes
    its shape, which :mod:`._cpu` checks first; NumPy 2 cannot assign ``.data``).
    """
    key = tuple(map(id, layers))
    known = _BASES.get(key)
    if known is not None and all(
        ref() is layer for ref, layer in zip(known[0], layers, strict=True)
    ):  # same length: the key has an id per layer
        return known[1]
    bases = np.fromiter((layer.ctypes.data for layer in layers), np.uint64, len(layers))
    if len(_BASES) >= 16:  # a few engines' caches at most; forget the old ones
        _BASES.clear()
    _BASES[key] = (tuple(weakref.ref(layer) for layer in layers), bases)
    return bases


class CpuHelper:
    """The C copies. Every method trusts its arguments (validated by :mod:`._cpu`) and writes
    wherever they say; all run without the GIL."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib = lib

    def isa(self, limit: str | None = None) -> str:
        """The instruction set the copies use (one of :data:`ISAS`): the best the CPU has. With
        ``limit``, first cap it there for the rest of the process (tests and benches compare the
        paths; ``ValueError`` for a name not in :data:`ISAS`)."""
        if limit is not None and limit not in ISAS:
            raise ValueError(f"unknown instruction set {limit!r}: expected one of {ISAS}")
        level = -1 if limit is None else ISAS.index(limit)
        return ISAS[self._lib.kvt_cpu_isa(level)]

    def prefetch(self, level: str | None = None) -> str:
        """Where the copies' prefetches bring lines (one of :data:`PREFETCHES`): the CPU's
        default. With ``level``, first set it there for the rest of the process (tests and
        benches compare the two; ``ValueError`` for a name not in :data:`PREFETCHES`)."""
        if level is not None and level not in PREFETCHES:
            raise ValueError(f"unknown prefetch level {level!r}: expected one of {PREFETCHES}")
        chosen = -1 if level is None else PREFETCHES.index(level)
        return PREFETCHES[self._lib.kvt_cpu_prefetch(chosen)]

    def rows(
        self, layers: Sequence[Array], rows: npt.NDArray[np.intp], row_bytes: int, chunk: Array,
        gather: bool,
    ) -> None:  # fmt: skip
        """Row ``j`` of each layer's share of ``chunk`` is row ``rows[j]`` of that C-contiguous
        layer (rows of ``row_bytes``); copy one way or the other, writing the destination in
        order (a scatter walks the layer rows sorted: head-major layouts would otherwise write
        rows of ``head_dim`` elements all over each block)."""
        bases = _bases(layers)
        layer_rows = np.ascontiguousarray(rows, dtype=np.int64)
        chunk_rows = np.arange(len(layer_rows), dtype=np.int64)
        if not gather:
            order = np.argsort(layer_rows, kind="stable")
            layer_rows, chunk_rows = layer_rows[order], chunk_rows[order]
        self._lib.kvt_cpu_rows(
            bases.ctypes.data, len(layers), layer_rows.ctypes.data, chunk_rows.ctypes.data,
            len(layer_rows), len(layer_rows), row_bytes, chunk.ctypes.data, int(gather),
        )  # fmt: skip

    def vllm_cpu(
        self, layout: KVLayout, layers: Sequence[Array], ids: npt.NDArray[np.intp], chunk: Array,
        gather: bool,
    ) -> None:  # fmt: skip
        """Blocks ``ids`` of ``vllm_cpu`` layers (last two axes contiguous) to or from ``chunk``."""
        self.vllm_cpu_parts(layout, layers, [(ids, chunk, 0, len(ids))], gather)

    def vllm_cpu_parts(
        self, layout: KVLayout, layers: Sequence[Array], parts: Sequence[ChunkPart], gather: bool
    ) -> None:
        """Several chunks in one call (the GIL is given back once): part ``(ids, chunk, first,
        span)`` moves blocks ``ids`` to or from blocks ``[first, first + len(ids))`` of ``chunk``,
        a canonical chunk of ``span`` blocks."""
        strides = {layer.strides for layer in layers}
        if len(strides) != 1:  # one stride set per call; rare enough to split per layer
            for index, layer in enumerate(layers):
                per_layer = [
                    (ids, chunk.reshape(len(layers), -1)[index], first, span)
                    for ids, chunk, first, span in parts
                ]
                self.vllm_cpu_parts(layout, [layer], per_layer, gather)
            return
        ((block, head, kv, _, _),) = strides
        bases = _bases(layers)
        kblock = layout.block_size * layout.num_heads * layout.head_dim * layout.element_size
        ids64 = np.concatenate(
            [np.asarray(ids, dtype=np.int64) for ids, _, _, _ in parts] or [np.empty(0, np.int64)]
        )
        counts = np.fromiter((len(ids) for ids, _, _, _ in parts), np.int64, len(parts))
        spans = np.fromiter((span for _, _, _, span in parts), np.int64, len(parts))
        chunks = np.fromiter(
            (chunk.ctypes.data + first * kblock for _, chunk, first, _ in parts),
            np.uint64,
            len(parts),
        )
        code = self._lib.kvt_cpu_vllm_cpu_copy(
            bases.ctypes.data, len(layers), ids64.ctypes.data, counts.ctypes.data,
            spans.ctypes.data, chunks.ctypes.data, len(parts), layout.num_heads,
            layout.block_size, layout.head_dim, layout.element_size, block, head, kv,
            int(gather),
        )  # fmt: skip
        if code == 2:
            raise MemoryError("the CPU copy helper could not allocate its stage")
        if code:
            raise ValueError(f"the CPU copy helper refused the arguments (code {code})")


def cpu_helper() -> CpuHelper | None:
    """The C copies, or None if the helper is unavailable (then copy with numpy)."""
    lib = _library()
    return None if lib is None else CpuHelper(lib)
