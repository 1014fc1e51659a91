"""Keep freed memory for the next step: glibc malloc settings for a CPU engine's process.

A prefill step allocates activations of tens of MB per layer ([T, 2I] for the gated MLP: 50 MB at
8,192 tokens of SmolLM2 in bf16). glibc serves blocks that large with a fresh mmap and returns
them on free, so every layer of every step faults its pages in again (measured: 587 k minor
faults, ~1 s of system time in a 5.9 s 8,192-token step). With the threshold for mmap at its
maximum (32 MiB), freed heap kept up to TRIM_BYTES and heap growth padded by PAD_BYTES, the same
step faulted 83 k pages and ran ~10% faster.

Set once per process, on the first CPU engine loaded (core.runtime.engine.Engine.load); off with
BESTIARY_MALLOC_TUNING=0, and a no-op where the C library is not glibc.

Kept free heap is also what a load leaves behind: the weights as read, freed as each is repacked
(cpu_matmul tiles, quantized layouts). `release_freed_memory` (malloc_trim) hands it back once the
engine is loaded, so resident memory after loading is the engine's, not the load's high-water mark.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3  # glibc's mallopt parameters
MMAP_BYTES = 32 << 20  # glibc's largest mmap threshold (DEFAULT_MMAP_THRESHOLD_MAX on 64-bit)
TRIM_BYTES = 512 << 20  # free heap at its top kept before it is returned to the system
PAD_BYTES = 64 << 20  # extra heap asked for at each growth (untouched pages cost no memory)

_done: list[bool] = []  # [True] once this process has been set


def _glibc():
    """The C library, or None where it is not glibc (musl, macOS, Windows)."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")


def glibc_mallopt():
    """The C library's mallopt, or None where it is not glibc (musl, macOS, Windows)."""
    libc = _glibc()
    fn = getattr(libc, "mallopt", None)
    if fn is not None:
        fn.argtypes, fn.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return fn


class _MallInfo2(ctypes.Structure):
    """glibc's struct mallinfo2 (2.33+): fordblks is the heap's free bytes."""

    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]


_free_at_trim: list[int] = [0]  # the heap's free bytes right after the last release_freed_memory


def heap_free_bytes() -> int | None:
    """The heap's free bytes by glibc's account (mallinfo2), or None where it cannot say."""
    fn = getattr(_glibc(), "mallinfo2", None)
    if fn is None:
        return None
    fn.restype = _MallInfo2
    return int(fn().fordblks)


def release_freed_memory(min_new_free: int = 0) -> bool:
    """Return the heap's free memory to the system now (glibc malloc_trim(0)); True when it ran. With
    `min_new_free`, only once the heap's free bytes grew by that much since the last release (a trim
    per call would make the next allocations fault their pages in again)."""
    fn = getattr(_glibc(), "malloc_trim", None)
    if fn is None:
        return False
    if min_new_free:
        free = heap_free_bytes()
        if free is not None and free - _free_at_trim[0] < min_new_free:
            return False
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    fn(0)
    _free_at_trim[0] = heap_free_bytes() or 0
    return True


def keep_freed_memory() -> bool:
    """Apply the settings above once per process; True when they are in effect."""
    if _done:
        return _done[0]
    mallopt = None if os.environ.get("BESTIARY_MALLOC_TUNING", "1") == "0" else glibc_mallopt()
    ok = mallopt is not None and all(mallopt(param, value) == 1 for param, value in (
        (M_MMAP_THRESHOLD, MMAP_BYTES), (M_TRIM_THRESHOLD, TRIM_BYTES), (M_TOP_PAD, PAD_BYTES)))
    _done.append(ok)
    return ok
