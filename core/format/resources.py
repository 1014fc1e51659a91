"""What this process may really use: memory and CPUs as the kernel limits them, not as the host has them.

A container or a `ulimit` gives a process less than /proc/meminfo and os.cpu_count() say. The
limits read here, each the smallest of:

- memory this process may still allocate (`available_memory`): MemAvailable; for each cgroup from
  the process's own up to the root of its hierarchy, the limit minus what the cgroup uses (v2:
  `memory.max - memory.current`, v1: `memory.limit_in_bytes - memory.usage_in_bytes`; the page
  cache the kernel can drop, `inactive_file` of memory.stat, counted as free); RLIMIT_AS (`ulimit -v`)
  minus the process's address space (VmSize) and RLIMIT_DATA (`ulimit -d`) minus its data (VmData);
- memory this process could use at most (`memory_capacity`, what a build for this host compares
  with): MemTotal, the cgroup limits, RLIMIT_AS and RLIMIT_DATA;
- CPUs (`usable_cpus`): the CPUs of its affinity mask (`taskset`, cpuset) and the cgroup's CPU
  quota rounded up (v2 `cpu.max`, v1 `cpu.cfs_quota_us / cpu.cfs_period_us`).

Every function takes `root` (the filesystem /proc and /sys are read under; tests pass a folder of
fake files) and reads the files anew each call: the numbers change as the process runs.
"""

from __future__ import annotations

import math
import os
import re
import resource
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

GiB, MiB = 2**30, 2**20
ROOT = Path("/")
UNLIMITED = 2**60  # cgroup v1 writes "no limit" as PAGE_COUNTER_MAX pages (about 2**63 bytes)
RLIMIT_NAMES = {resource.RLIMIT_AS: ("RLIMIT_AS (ulimit -v)", "VmSize"),
                resource.RLIMIT_DATA: ("RLIMIT_DATA (ulimit -d)", "VmData")}
GetRlimit = Callable[[int], tuple[int, int]]


@dataclass(frozen=True)
class Limit:
    """An amount (bytes, or CPUs) and what sets it, e.g. "cgroup memory.max" or "RLIMIT_AS (ulimit -v)"."""

    amount: int
    source: str

    def gib(self) -> str:
        """`12.3 GiB (source)`: how error messages name a memory limit."""
        return f"{size_text(self.amount)} ({self.source})"


def size_text(n: int) -> str:
    """Bytes as error messages write them: `3.8 GiB`, `512.0 MiB` below a GiB, `4.0 KiB` below a MiB."""
    unit, name = next(((u, name) for u, name in ((GiB, "GiB"), (MiB, "MiB")) if n >= u), (1024, "KiB"))
    return f"{n / unit:,.1f} {name}"


def _read(path: Path) -> str | None:
    """A small text file's content, None where it cannot be read (absent, no permission, not Linux)."""
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError):
        return None


def _fields(path: Path, scale: int = 1) -> dict[str, int]:
    """`name value` or `name: value [kB]` lines as {name: value * scale} (/proc/meminfo, memory.stat)."""
    out: dict[str, int] = {}
    for line in (_read(path) or "").splitlines():
        parts = line.replace(":", " ").split()
        if len(parts) >= 2 and parts[1].isdigit():
            out[parts[0]] = int(parts[1]) * scale
    return out


def _number(path: Path) -> int | None:
    """The integer a cgroup file holds; None for "max", an absent file or no limit (v1's huge value)."""
    text = (_read(path) or "").strip()
    if not text.lstrip("-").isdigit():
        return None
    value = int(text)
    return value if 0 <= value < UNLIMITED else None


def _unescape(field: str) -> str:
    r"""A mountinfo path field: spaces and tabs are written \040, \011 (octal escapes)."""
    for code in ("040", "011", "012", "134"):
        field = field.replace("\\" + code, chr(int(code, 8)))
    return field


def _mounts(root: Path, controller: str | None) -> list[tuple[str, str]]:
    """(root within the hierarchy, mount point) of each cgroup mount of `controller` (None: cgroup v2)."""
    out = []
    for line in (_read(root / "proc/self/mountinfo") or "").splitlines():
        left, sep, right = line.partition(" - ")
        fields, kind = left.split(), right.split()
        if not sep or len(fields) < 5 or len(kind) < 3:
            continue
        if (controller is None and kind[0] == "cgroup2") or (
                controller is not None and kind[0] == "cgroup" and controller in kind[2].split(",")):
            out.append((_unescape(fields[3]), _unescape(fields[4])))
    return out


def cgroup_dirs(root: Path, controller: str | None) -> list[Path]:
    """The cgroup directories that limit this process for `controller` ("memory", "cpu"; None: the v2
    hierarchy), its own first, then each parent up to the mount's root. Empty without cgroups."""
    own = None
    for line in (_read(root / "proc/self/cgroup") or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3 and ((controller is None and parts[0] == "0" and parts[1] == "")
                                or (controller is not None and controller in parts[1].split(","))):
            own = parts[2]
    if own is None:
        return []
    for mount_root, mount_point in _mounts(root, controller):
        top = root / mount_point.lstrip("/")
        rel = os.path.relpath(own, mount_root)
        here = top if rel == "." or rel.startswith("..") else top / rel  # outside the mount's root: the mount's top
        dirs = [here, *[p for p in here.parents if p.is_relative_to(top)]]
        return [d for d in dirs if d.is_dir()]
    return []


def _cgroup_memory(root: Path) -> tuple[Limit | None, Limit | None]:
    """(smallest headroom, smallest limit) over this process's memory cgroups, v2 and v1."""
    headroom: Limit | None = None
    limit: Limit | None = None
    levels = [(d, "memory.max", "memory.current", "inactive_file") for d in cgroup_dirs(root, None)]
    levels += [(d, "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
               for d in cgroup_dirs(root, "memory")]
    for directory, max_file, used_file, cache_field in levels:
        cap = _number(directory / max_file)
        if cap is None:
            continue
        used = _number(directory / used_file) or 0
        used -= min(used, _fields(directory / "memory.stat").get(cache_field, 0))
        where = f"cgroup {max_file} of /{directory.relative_to(root)}"
        if limit is None or cap < limit.amount:
            limit = Limit(cap, where)
        if headroom is None or cap - used < headroom.amount:
            headroom = Limit(max(0, cap - used), f"{where}, {size_text(used)} of it in use")
    return headroom, limit


def _rlimits(root: Path, getrlimit: GetRlimit | None) -> tuple[list[Limit], list[Limit]]:
    """([headroom], [limit]) of RLIMIT_AS and RLIMIT_DATA where they are set (soft limits)."""
    get = getrlimit or resource.getrlimit
    status = _fields(root / "proc/self/status", 1024)
    headrooms, limits = [], []
    for which, (name, field) in RLIMIT_NAMES.items():
        soft = get(which)[0]
        if soft == resource.RLIM_INFINITY or soft < 0:
            continue
        used = status.get(field, 0)
        limits.append(Limit(soft, name))
        headrooms.append(Limit(max(0, soft - used), f"{name}, {size_text(used)} of it in use"))
    return headrooms, limits


def _smallest(limits: list[Limit | None]) -> Limit:
    return min((lim for lim in limits if lim is not None), key=lambda lim: lim.amount)


def _host_memory(root: Path, field: str, label: str, pages: str, pages_label: str) -> Limit:
    """/proc/meminfo's `field` (bytes), else sysconf's `pages` times the page size."""
    info = _fields(root / "proc/meminfo", 1024)
    if field in info:
        return Limit(info[field], label)
    return Limit(os.sysconf(pages) * os.sysconf("SC_PAGE_SIZE"), pages_label)


def available_memory(root: Path = ROOT, getrlimit: GetRlimit | None = None) -> Limit:
    """The memory this process may still allocate now, and what limits it (module docstring)."""
    host = _host_memory(root, "MemAvailable", "MemAvailable", "SC_AVPHYS_PAGES", "free pages")
    headrooms, _ = _rlimits(root, getrlimit)
    return _smallest([host, _cgroup_memory(root)[0], *headrooms])


def memory_capacity(root: Path = ROOT, getrlimit: GetRlimit | None = None) -> Limit:
    """The most memory this process could use, and what limits it: the host's RAM unless a cgroup or
    an rlimit allows less (module docstring)."""
    host = _host_memory(root, "MemTotal", "this host's RAM", "SC_PHYS_PAGES", "this host's RAM")
    _, limits = _rlimits(root, getrlimit)
    return _smallest([host, _cgroup_memory(root)[1], *limits])


def _cpu_quota(directory: Path) -> int | None:
    """CPUs a cgroup's quota allows (rounded up), None without a quota."""
    v2 = (_read(directory / "cpu.max") or "").split()
    if len(v2) == 2 and v2[0].isdigit() and v2[1].isdigit() and int(v2[1]) > 0:
        return max(1, math.ceil(int(v2[0]) / int(v2[1])))
    quota, period = _number(directory / "cpu.cfs_quota_us"), _number(directory / "cpu.cfs_period_us")
    if quota and period:
        return max(1, math.ceil(quota / period))
    return None


def usable_cpus(root: Path = ROOT, affinity: Callable[[], set[int]] | None = None) -> Limit:
    """The CPUs this process may keep busy at once, and what limits it (module docstring)."""
    try:
        count = len((affinity or (lambda: os.sched_getaffinity(0)))())
        best = Limit(count, "CPU affinity")
    except (AttributeError, OSError):  # no sched_getaffinity (macOS)
        best = Limit(os.cpu_count() or 1, "os.cpu_count")
    for directory in [*cgroup_dirs(root, None), *cgroup_dirs(root, "cpu")]:
        quota = _cpu_quota(directory)
        if quota is not None and quota < best.amount:
            best = Limit(quota, f"cgroup CPU quota of /{directory.relative_to(root)}")
    return Limit(max(1, best.amount), best.source)


ASKED_PATTERNS = (re.compile(r"tried to allocate (\d+) bytes"),  # torch's CPU allocator
                  re.compile(r"[Tt]ried to allocate ([\d.]+) (B|KiB|MiB|GiB|TiB)"))  # torch's CUDA allocator
UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


def allocation_failed(err: BaseException) -> bool:
    """Whether `err` is an allocator's refusal: MemoryError, or torch's CPU / CUDA out-of-memory RuntimeError."""
    text = str(err)
    return isinstance(err, MemoryError) or (isinstance(err, RuntimeError) and (
        "can't allocate memory" in text or "out of memory" in text.lower()))


def bytes_asked(err: BaseException) -> int | None:
    """The size a failed allocation asked for, where the allocator's message says it."""
    for pattern in ASKED_PATTERNS:
        found = pattern.search(str(err))
        if found:
            unit = found.group(2) if found.lastindex == 2 else "B"
            return int(float(found.group(1)) * UNITS[unit])
    return None


def out_of_memory_message(err: BaseException) -> str:
    """One line for an allocation that failed: the size asked (where known), the memory this process may
    still use and what limits it, and the limits to lower."""
    asked = bytes_asked(err)
    what = f"allocating {asked:,} bytes ({size_text(asked)}) failed" if asked is not None else "an allocation failed"
    return (f"out of memory: {what}; {available_memory().gib()} is available to this process: use smaller limits "
            "(bestiary build --max_batch_size, --max_seq_len, --max_num_tokens, --max_tokens_in_paged_kv_cache)")
