"""How much memory an engine's limits ask for, and how much this host has.

The KV pool of an engine holds `tokens` = max_tokens_in_paged_kv_cache (default max_batch_size *
max_seq_len) tokens; one token takes, over all layers, K and V:

    bytes_per_token = 2 * num_hidden_layers * num_key_value_heads * head_size * element_size

(element_size: 1 under an INT8 / FP8 kv_cache_quant_algo, else the model dtype's). `bestiary
build` refuses limits whose pool plus weights exceed this host's RAM (MemTotal; building for
a larger host: --skip_memory_check); loading refuses a pool larger than the memory available
now (core.runtime.kv_cache.check_pool_fits), which is authoritative.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Iterator

from bestiary.core.format.errors import EnvironmentFault

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
GiB = 2**30


def meminfo_bytes(field: str) -> int | None:
    """A /proc/meminfo field ("MemTotal", "MemAvailable") in bytes, None where there is none."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(f"{field}:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def host_memory_bytes() -> int:
    """This host's RAM."""
    return meminfo_bytes("MemTotal") or os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def kv_bytes_per_token(config) -> int:
    """K + V bytes of one token over all layers of a PretrainedConfig (module docstring)."""
    quant = getattr(config, "quantization", None)
    kv_quantized = bool(getattr(quant, "kv_cache_quant_algo", None))
    element = 1 if kv_quantized else DTYPE_BYTES.get(str(config.dtype), 4)
    return 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_size * element


def check_build_memory(config, pool_tokens: int, weight_bytes: int) -> None:
    """Refuse limits whose KV pool + weights exceed this host's RAM (EnvironmentFault naming the flags)."""
    pool = pool_tokens * kv_bytes_per_token(config)
    host = host_memory_bytes()
    if pool + weight_bytes > host:
        raise EnvironmentFault(
            f"the KV cache of {pool_tokens:,} tokens needs {pool / GiB:,.1f} GiB (+ {weight_bytes / GiB:.1f} GiB "
            f"weights), more than this host's {host / GiB:.1f} GiB RAM: lower --max_batch_size, --max_seq_len or "
            "--max_tokens_in_paged_kv_cache (or --skip_memory_check to build for a larger host)"
        )


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters
CONVERT_MMAP_THRESHOLD = 1 << 20  # a convert's freed blocks of 1 MiB and more go back to the OS at once
GLIBC_MMAP_THRESHOLD_MAX = 32 << 20  # where glibc's own dynamic threshold ends up after large frees


def _glibc():
    try:
        libc = ctypes.CDLL("libc.so.6")
        return libc if hasattr(libc, "mallopt") else None
    except OSError:  # not glibc (musl, macOS): nothing to tune
        return None


@contextlib.contextmanager
def freed_memory_returned() -> Iterator[None]:
    """Inside: every allocation of CONVERT_MMAP_THRESHOLD bytes or more is its own mapping, returned to
    the OS when freed, and the heap is trimmed above that too (glibc; elsewhere nothing changes).

    glibc raises its mmap threshold to the size of each large block freed (up to 32 MiB), after which
    blocks of that size come from the heap and stay resident when freed: a convert, which makes and
    drops one float32 tensor per weight, then holds the high-water mark of its temporaries for good
    (SmolLM2 W8A16: 640 MiB above the baseline, against 230 with this). On exit the threshold is set
    where glibc's own adjustment ends (32 MiB) and the trim threshold to twice that, as glibc keeps it,
    so what runs after (a build and generation in the same process) allocates as it would have."""
    global _DEPTH
    libc = _glibc()
    if libc is None:
        yield
        return
    if _DEPTH == 0:
        libc.mallopt(M_MMAP_THRESHOLD, CONVERT_MMAP_THRESHOLD)
        libc.mallopt(M_TRIM_THRESHOLD, CONVERT_MMAP_THRESHOLD)
    _DEPTH += 1  # a convert inside a convert (the tp 1 calibration) keeps the outer setting
    try:
        yield
    finally:
        _DEPTH -= 1
        if _DEPTH == 0:
            libc.mallopt(M_MMAP_THRESHOLD, GLIBC_MMAP_THRESHOLD_MAX)
            libc.mallopt(M_TRIM_THRESHOLD, 2 * GLIBC_MMAP_THRESHOLD_MAX)


_DEPTH = 0

