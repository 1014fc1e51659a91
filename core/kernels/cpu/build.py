"""Compile kernels.c for this CPU's instruction set, and load it with ctypes.

kernels.c is the one translation unit of the CPU kernels: it #includes common.h, vector.h and a
part per op family (linear_*.c, kv_cache.c, attention_*.c, ..., plan.c: the list heads kernels.c),
so a build is one compiler run. It is one source for four builds: AVX-512 with AVX512_BF16
(vdpbf16ps where both operands are bfloat16), AVX-512 (F, BW, VL with FMA and F16C), AVX2
(+ FMA, F16C) and scalar C. At load the best ISA whose flags the CPU lists (/proc/cpuinfo;
torch's CPU capability where there is no such file, which cannot tell avx512_bf16: avx512 then)
is chosen; BESTIARY_CPU_ISA=avx512bf16|avx512|avx2|scalar forces one (a BestiaryError, one line,
for an ISA this CPU lacks or an unknown name). Each ISA's library is built once per source text
(every .c and .h file beside kernels.c: a change in any part rebuilds), compiler and flags into
<cache>/cpu-kernels/<key>/ ($BESTIARY_CACHE or ~/.cache/bestiary), through a temporary file
renamed into place, so concurrent processes never load half a library. `describe()` says what
was chosen and why (`bestiary inspect` prints it).

BESTIARY_CPU_KERNELS=off (or 0) turns the kernels off: every op then runs its torch
reference. Without a C compiler (`$CC`, else cc / gcc), or if the build fails, the same
happens after one warning naming the reason.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path
from typing import NamedTuple

import torch  # (loaded first: the library then shares torch's libgomp, its thread pool)

from bestiary.core.format.cache import cache_dir
from bestiary.core.format.errors import BestiaryError

# resolved: a strict editable install's link tree holds only the files it had when it was made
SOURCE = Path(__file__).resolve().with_name("kernels.c")
ENV_VAR = "BESTIARY_CPU_KERNELS"
ISA_ENV_VAR = "BESTIARY_CPU_ISA"
FLAGS = ["-O3", "-fopenmp", "-shared", "-fPIC", "-std=gnu11"]


class Isa(NamedTuple):
    """One build of kernels.c: the /proc/cpuinfo flags it needs, its compiler flags, and the
    number its library's bst_isa() returns."""

    cpu_flags: tuple[str, ...]
    cc_flags: tuple[str, ...]
    code: int


AVX512 = ("avx512f", "avx512bw", "avx512vl", "avx2", "fma", "f16c")
AVX512_CC = ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx2", "-mfma", "-mf16c")
ISAS = {  # best first
    "avx512bf16": Isa((*AVX512, "avx512_bf16", "avx512_vnni"), (*AVX512_CC, "-mavx512bf16", "-mavx512vnni"), 3),
    "avx512": Isa(AVX512, AVX512_CC, 2),
    "avx2": Isa(("avx2", "fma", "f16c"), ("-mavx2", "-mfma", "-mf16c"), 1),
    "scalar": Isa((), (), 0),
}
TORCH_CAPABILITY_ISA = {"AVX512": "avx512", "AVX2": "avx2"}  # torch.backends.cpu.get_cpu_capability()
# shown by describe() when present and not used by the chosen build (avx512_vnni: the avx512bf16 build's
# int8 GEMV; avx_vnni, AMX: no kernel uses them, docs/runtime.md says why)
EXTRA_FLAGS = ("avx512_vnni", "avx512_bf16", "avx_vnni", "amx_bf16")

P, I64, F32, INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
SIGNATURES = {  # name -> argument types (all return void except bst_has_avx512)
    "bst_linear": [P, INT, I64, I64, P, INT, I64, P, P, I64, P, P, INT, INT],
    "bst_dequantize": [P, INT, I64, I64, P, P, I64, P, INT, INT],
    "bst_decode_attention": [P, INT, I64, P, P, INT, P, I64, P, I64, I64, I64, I64, I64, F32, P, P, INT, P, P, INT],
    "bst_prefill_attention": [P, I64, P, I64, P, I64, P, I64, I64, I64, I64, I64, F32, INT],
    "bst_kv_write": [P, P, INT, I64, P, P, INT, P, I64, I64, P],
    "bst_rms_norm": [P, P, P, P, INT, P, INT, I64, I64, F32, INT],
    "bst_rotary": [P, INT, I64, I64, I64, I64, P, P, I64, INT, I64, INT],
    "bst_act_and_mul": [P, P, INT, I64, I64, INT, INT],
    "bst_argmax_rows": [P, I64, I64, P, INT],
    "bst_lora_rows": [P, INT, I64, I64, P, P, INT, P, P, I64, P, P, INT, I64, INT],
    "bst_run_plan": [P, I64, INT],
    "bst_run_plan_timed": [P, I64, INT, P],
}
INT_FUNCTIONS = ("bst_isa", "bst_has_avx512")  # no arguments, return int


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


def torch_capability() -> str:
    """torch's view of this CPU's vector ISA: "AVX512", "AVX2", "DEFAULT", ... ("" if unknown)."""
    try:
        return str(torch.backends.cpu.get_cpu_capability())
    except (AttributeError, RuntimeError):
        return ""


def x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")


def supported_isas() -> list[str]:
    """The ISAs this CPU runs, best first: by the flags of /proc/cpuinfo, else (no such file) by
    torch's CPU capability. Always ends with "scalar"."""
    if not x86():
        return ["scalar"]
    flags = cpu_flags()
    if not flags:  # no /proc/cpuinfo: torch's capability says which vector ISA the CPU has
        best = TORCH_CAPABILITY_ISA.get(torch_capability().upper(), "scalar")
        return list(ISAS)[list(ISAS).index(best):]
    return [name for name, isa in ISAS.items() if all(f in flags for f in isa.cpu_flags)]


def chosen_isa() -> str:
    """The ISA the kernels are built for: $BESTIARY_CPU_ISA if set (and not "auto"), else the best
    this CPU runs. BestiaryError for an unknown name or an ISA the CPU lacks."""
    forced = os.environ.get(ISA_ENV_VAR, "auto").strip().lower()
    supported = supported_isas()
    if forced in ("", "auto"):
        return supported[0]
    if forced not in ISAS:
        raise BestiaryError(f"{ISA_ENV_VAR}={forced}: expected one of auto, {', '.join(ISAS)}")
    if forced not in supported:
        lacking = [f for f in ISAS[forced].cpu_flags if f not in cpu_flags()] or ["an x86 CPU"]
        raise BestiaryError(f"{ISA_ENV_VAR}={forced}: this CPU lacks {', '.join(lacking)} "
                            f"(/proc/cpuinfo flags); it runs {', '.join(supported)}")
    return forced


def isa_choice() -> tuple[str, str]:
    """(chosen_isa(), why): "forced by BESTIARY_CPU_ISA" or "best the CPU runs"; BestiaryError as
    chosen_isa's for an ISA this CPU refuses."""
    isa = chosen_isa()
    forced = os.environ.get(ISA_ENV_VAR, "auto").strip().lower() not in ("", "auto")
    return isa, f"forced by {ISA_ENV_VAR}" if forced else "best the CPU runs"


def describe() -> dict[str, str]:
    """What the CPU kernels run on, for `bestiary inspect`: the chosen ISA and why, the ISAs
    this CPU runs, extra flags present that the chosen build does not use, torch's capability,
    and whether the kernels are on."""
    try:
        isa, how = isa_choice()
    except BestiaryError as err:
        isa, how = "refused", str(err)
    if not enabled():
        state = f"off ({ENV_VAR}): torch references"
    elif compiler() is None:
        state = "off: no C compiler ($CC, cc, gcc): torch references"
    else:
        state = f"on ({compiler()})"
    used = ISAS[isa].cpu_flags if isa in ISAS else ()
    extras = [f for f in EXTRA_FLAGS if f in cpu_flags() and f not in used]
    return {"kernels": state, "isa": isa, "chosen": how, "cpu runs": ", ".join(supported_isas()),
            "cpu extras": ", ".join(extras) or "-", "torch capability": torch_capability() or "unknown"}


def enabled() -> bool:
    """False when BESTIARY_CPU_KERNELS says off."""
    return os.environ.get(ENV_VAR, "auto").strip().lower() not in ("off", "0", "false", "no")


def compiler() -> str | None:
    """The C compiler to use: $CC, else cc or gcc on PATH, else None."""
    cc = os.environ.get("CC")
    return cc if cc else (shutil.which("cc") or shutil.which("gcc"))


def sources() -> list[Path]:
    """The files a build reads: kernels.c and the parts it #includes, i.e. every .c and .h file beside
    it, by name."""
    return sorted(p for p in SOURCE.parent.iterdir() if p.suffix in (".c", ".h"))


def _key(cc: str, isa: str) -> str:
    """Hash of the sources (each file's name and text), the compiler's version and the flags of this
    ISA's build."""
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30, check=False).stdout
    text = "\n".join([*(f"{p.name}\n{p.read_text()}" for p in sources()), version, " ".join(FLAGS), isa,
                      " ".join(ISAS[isa].cc_flags)])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def compile_library(cc: str, out: Path, isa: str) -> None:
    """cc kernels.c (one translation unit: it #includes the other sources) -> out for `isa`
    (atomically: built beside it, then renamed)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        result = subprocess.run([cc, *FLAGS, *ISAS[isa].cc_flags, str(SOURCE), "-o", tmp, "-lm"], capture_output=True,
                                text=True, check=False, timeout=300)
        if result.returncode != 0:
            raise RuntimeError(f"{cc} failed on {SOURCE} ({isa}): {result.stderr.strip().splitlines()[-1:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    for name, args in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, None
    for name in INT_FUNCTIONS:
        getattr(lib, name).restype = ctypes.c_int
    return lib


def library_for(isa: str) -> ctypes.CDLL | None:
    """The kernel library built for `isa` (built if needed); None when off or unavailable (warned
    once). BestiaryError for an ISA this CPU does not run."""
    if isa not in supported_isas():
        raise BestiaryError(f"CPU kernels for {isa}: this CPU runs {', '.join(supported_isas())}")
    return built_library(isa) if enabled() else None


class CpuKernelsWarning(UserWarning):
    """The compiled CPU kernels are unavailable and every op runs its torch reference."""


def fall_back(reason: str) -> None:
    """Warn, in one line, that the CPU kernels run their torch references and why: a CpuKernelsWarning
    with no source line under it (warnings.warn would print the caller's line as a second one)."""
    warnings.warn_explicit(f"{reason}; the CPU kernels run their torch references (slower)", CpuKernelsWarning,
                           filename="bestiary", lineno=0, module=__name__)


def unwritable(directory: Path) -> str | None:
    """Why the kernels cannot be built into `directory` (created if needed), None when they can."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        return err.strerror or str(err)
    return None if os.access(directory, os.W_OK | os.X_OK) else "not writable"


@functools.cache
def built_library(isa: str) -> ctypes.CDLL | None:
    """library_for's build and load, once per process and ISA."""
    cc = compiler()
    if cc is None:
        fall_back("no C compiler found ($CC, cc, gcc)")
        return None
    try:
        path = cache_dir() / "cpu-kernels" / _key(cc, isa) / f"libbestiary_cpu_{isa}.so"
        if not path.exists():
            reason = unwritable(path.parent)
            if reason is not None:
                fall_back(f"the cache {cache_dir()} cannot hold the built kernels ({reason}; set BESTIARY_CACHE "
                          "to a writable directory)")
                return None
            compile_library(cc, path, isa)
        lib = load(path)
        if lib.bst_isa() != ISAS[isa].code:
            raise RuntimeError(f"{path} was built for ISA code {lib.bst_isa()}, not {isa}")
        return lib
    except (OSError, RuntimeError, subprocess.SubprocessError) as err:
        fall_back(f"the CPU kernels could not be built ({' '.join(str(err).split())})")
        return None


@functools.cache
def isa_name(lib) -> str:
    """The name of the ISA a loaded kernel library was built for (its bst_isa() code); "" for None."""
    if lib is None:
        return ""
    code = lib.bst_isa()
    return next((name for name, isa in ISAS.items() if isa.code == code), "")


@functools.cache
def library() -> ctypes.CDLL | None:
    """The kernel library for the chosen ISA (chosen_isa), built if needed; None when off or
    unavailable (warned once). Cached: tests that change the environment call cache_clear()."""
    return library_for(chosen_isa()) if enabled() else None
