"""Compile kernels.c into a shared library on first use, and load it with ctypes.

The library is built once per source text, compiler and CPU (it is compiled with
-march=native) into <cache>/cpu-kernels/<key>/ ($BESTIARY_CACHE or ~/.cache/bestiary), through
a temporary file renamed into place, so concurrent processes never load half a library.

BESTIARY_CPU_KERNELS=off (or 0) turns the kernels off: every op then runs its torch
reference. Without a C compiler (`$CC`, else cc / gcc), or if the build fails, the same
happens after one warning naming the reason.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch  # noqa: F401  (loads torch's libgomp first: the library then shares its thread pool)
from bestiary.core.format.cache import cache_dir

SOURCE = Path(__file__).with_name("kernels.c")
ENV_VAR = "BESTIARY_CPU_KERNELS"
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11"]

P, I64, F32, INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
SIGNATURES = {  # name -> argument types (all return void except bst_has_avx512)
    "bst_linear": [P, INT, I64, I64, P, INT, I64, P, P, I64, P, P, INT, INT],
    "bst_dequantize": [P, INT, I64, I64, P, P, I64, P, INT, INT],
    "bst_decode_attention": [P, INT, I64, P, P, INT, P, I64, P, I64, I64, I64, I64, I64, F32, P, P, INT, P, INT],
    "bst_kv_write": [P, P, INT, I64, P, P, INT, P, I64, I64, P],
    "bst_rms_norm": [P, P, P, P, INT, P, INT, I64, I64, F32, INT],
    "bst_rotary": [P, INT, I64, I64, I64, I64, P, P, I64, INT, I64, INT],
    "bst_act_and_mul": [P, P, INT, I64, I64, INT, INT],
    "bst_run_plan": [P, I64, INT],
}


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU feature flags of /proc/cpuinfo (empty where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def enabled() -> bool:
    """False when BESTIARY_CPU_KERNELS says off."""
    return os.environ.get(ENV_VAR, "auto").strip().lower() not in ("off", "0", "false", "no")


def compiler() -> str | None:
    """The C compiler to use: $CC, else cc or gcc on PATH, else None."""
    cc = os.environ.get("CC")
    return cc if cc else (shutil.which("cc") or shutil.which("gcc"))


def _key(cc: str) -> str:
    """Hash of the source, the compiler's version and flags, and this CPU's feature flags."""
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30, check=False).stdout
    text = "\n".join([SOURCE.read_text(), version, " ".join(FLAGS), " ".join(sorted(cpu_flags()))])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def compile_library(cc: str, out: Path, extra_flags: tuple[str, ...] = ()) -> None:
    """cc kernels.c -> out (atomically: built beside it, then renamed); `extra_flags` after FLAGS
    (the tests build the scalar fallback with -mno-avx512f)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        result = subprocess.run([cc, *FLAGS, *extra_flags, str(SOURCE), "-o", tmp, "-lm"], capture_output=True, text=True, check=False,
                                timeout=300)
        if result.returncode != 0:
            raise RuntimeError(f"{cc} failed on {SOURCE}: {result.stderr.strip().splitlines()[-1:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    for name, args in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, None
    lib.bst_has_avx512.restype = ctypes.c_int
    return lib


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded kernel library, built if needed; None when off or unavailable (warned once)."""
    if not enabled():
        return None
    cc = compiler()
    if cc is None:
        warnings.warn("bestiary: no C compiler found ($CC, cc, gcc): the CPU kernels run their torch "
                      "references (slower)", stacklevel=2)
        return None
    try:
        path = cache_dir() / "cpu-kernels" / _key(cc) / "libbestiary_cpu.so"
        if not path.exists():
            compile_library(cc, path)
        return load(path)
    except (OSError, RuntimeError, subprocess.SubprocessError) as err:
        warnings.warn(f"bestiary: the CPU kernels could not be built ({err}); running the torch references",
                      stacklevel=2)
        return None
