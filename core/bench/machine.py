"""What a figure depends on besides the code: CPU flags, the CPU kernel build, threads, load, memory
read bandwidth."""

from __future__ import annotations

import os
import platform
import time
from dataclasses import asdict, dataclass, field

import torch

CPU_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "avx_vnni",
             "amx_bf16", "amx_int8")


def cpu_flags() -> list[str]:
    """The flags of CPU_FLAGS that /proc/cpuinfo lists (empty where there is no such file)."""
    try:
        with open("/proc/cpuinfo") as f:
            listed = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return []
    return [flag for flag in CPU_FLAGS if flag in listed]


def cpu_kernels() -> tuple[str, str]:
    """The build of the compiled CPU kernels (core.kernels.cpu.build) the engines run: its ISA (avx512bf16,
    avx512, avx2, scalar; "off" when the torch references run instead) and why. Builds the library
    if needed; BestiaryError for a BESTIARY_CPU_ISA this CPU refuses (the engines would refuse it)."""
    from bestiary.core.kernels import dispatch
    from bestiary.core.kernels.cpu import build

    if dispatch.mode() != "auto":
        return "off", f"{dispatch.ENV_VAR}={dispatch.mode()}: no compiled CPU kernels"
    if not build.enabled():
        return "off", f"{build.ENV_VAR}=off: torch references"
    isa, why = build.isa_choice()
    if build.library() is None:
        return "off", "not built (no C compiler, or the build failed): torch references"
    return isa, why


def load_average() -> str:
    """The 1, 5 and 15 minute load averages (another process on few cores skews every figure)."""
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "unknown"


def read_bandwidth_gbps(mib: int = 1024, repeats: int = 5) -> float:
    """Memory read bandwidth in GB/s: the best of `repeats` torch sums over `mib` MiB of float32."""
    x = torch.ones(mib * 2**20 // 4)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - start)
    return x.numel() * 4 / best / 1e9


@dataclass
class Machine:
    """The machine a run measured on."""

    cpu: str
    cpu_flags: list[str]
    cores: int
    threads: int
    torch: str
    load_before: str
    load_after: str = ""
    read_gbps: float | None = None  # the best probe of the run (read_bandwidth_gbps before it and each later round)
    read_gbps_probes: list[float] = field(default_factory=list)  # every probe, in order
    cpu_isa: str = ""  # the CPU kernel build the engines run (cpu_kernels), "off" for none
    cpu_kernels: str = ""  # why that build: "best the CPU runs", "forced by BESTIARY_CPU_ISA", why off

    @classmethod
    def now(cls, bandwidth_mib: int) -> Machine:
        """This machine now; the read bandwidth over `bandwidth_mib` MiB (0: not measured)."""
        isa, why = cpu_kernels()
        return cls(platform.processor() or platform.machine(), cpu_flags(), os.cpu_count() or 1,
                   torch.get_num_threads(), torch.__version__, load_average(),
                   read_gbps=read_bandwidth_gbps(bandwidth_mib) if bandwidth_mib else None, cpu_isa=isa,
                   cpu_kernels=why)

    def to_json(self) -> dict:
        return asdict(self)
