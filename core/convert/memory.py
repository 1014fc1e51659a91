"""How much memory an engine's limits ask for, and how much this process may use.

The KV pool of an engine holds max_tokens_in_paged_kv_cache tokens (default max_batch_size *
max_seq_len) rounded up to whole blocks of tokens_per_block, as the runtime allocates it; one
token takes, over the layers of one rank, K and V in the pool geometry the runtime allocates
(core.layers.kv_geometry.pool_geometry: kv heads of the rank, K dim, V dim; a family may state its own,
e.g. multi-head latent attention's one latent row and no V):

    bytes_per_token = ceil(num_hidden_layers / pp_size) * kv_heads * (k_dim + v_dim) * element_size
                      (standard attention: kv_heads = the rank's kv heads, k_dim = v_dim = head_size)

(element_size: 1 under an INT8 / FP8 kv_cache_quant_algo, else the model dtype's). `bestiary
build` refuses limits whose pool plus one rank's weights exceed the memory this process could use
on this host (core.format.resources.memory_capacity: RAM, cgroup limit, RLIMIT_AS / RLIMIT_DATA;
building for a larger host: --skip_memory_check); loading refuses a pool larger than the memory
available now (core.runtime.kv_cache.check_pool_fits), which is authoritative.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
from collections.abc import Iterator

from bestiary.core.format.build_config import BuildConfig, pool_blocks
from bestiary.core.format.errors import EnvironmentFault
from bestiary.core.format.resources import memory_capacity, size_text
from bestiary.core.layers.kv_geometry import pool_geometry

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def kv_bytes_per_token(config) -> int:
    """K + V bytes of one token over the layers of one rank of a PretrainedConfig (module docstring): the
    geometry of rank 0 (every rank's is the same size), as KVCache.for_model allocates it."""
    quant = getattr(config, "quantization", None)
    kv_quantized = bool(getattr(quant, "kv_cache_quant_algo", None))
    element = 1 if kv_quantized else DTYPE_BYTES.get(str(config.dtype), 4)
    mapping = getattr(config, "mapping", None)
    tp, pp = getattr(mapping, "tp_size", 1), getattr(mapping, "pp_size", 1)
    return math.ceil(config.num_hidden_layers / pp) * pool_geometry(config, tp).elements * element


def flags_to_lower(build: BuildConfig, tokens: int) -> str:
    """The build flags that set a pool of `tokens` (rounded to blocks), the one that made it large first."""
    asked = build.max_tokens_in_paged_kv_cache or build.max_batch_size * (build.max_seq_len or 1)
    if tokens >= 2 * asked:  # the rounding up to one whole block made it (at least) twice as large
        return "--tokens_per_block"
    if build.max_tokens_in_paged_kv_cache:
        return "--max_tokens_in_paged_kv_cache"
    return "--max_batch_size, --max_seq_len or --max_tokens_in_paged_kv_cache"


def check_build_memory(config, build: BuildConfig, weight_bytes: int) -> None:
    """Refuse limits whose KV pool (one rank's, as allocated) + one rank's weights exceed the memory this
    process could use (EnvironmentFault naming the sizes, the limit and the flags to lower)."""
    blocks, tokens = pool_blocks(build)
    pool = tokens * kv_bytes_per_token(config)
    cap = memory_capacity()
    if pool + weight_bytes > cap.amount:
        raise EnvironmentFault(
            f"the KV cache of {tokens:,} tokens ({blocks:,} block{'s' if blocks != 1 else ''} of "
            f"{build.tokens_per_block}) needs {size_text(pool)} (+ {size_text(weight_bytes)} weights), more than the "
            f"{cap.gib()} this process may use: lower {flags_to_lower(build, tokens)} (or --skip_memory_check to "
            "build for a larger host)"
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

