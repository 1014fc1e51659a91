"""How many threads bestiary's ops run on when nobody says.

The count, in order: `num_threads=` / `--num_threads`; else the environment's BESTIARY_NUM_THREADS;
else min(torch's own default (the physical cores it sees), the CPUs this process may keep busy:
its affinity mask and its cgroup CPU quota, `core.format.resources.usable_cpus`). A container
given 1 CPU of a 16-core host then runs 1 thread, not 16 that wait for one another at every
barrier. Ranks of a tp / pp engine on one host share that count.

On a shared CPU the best count changes while a model runs: two threads on two cores where
another process keeps one busy wait at every barrier for the thread that gets no CPU (measured:
0.4x of one thread's speed). Without an asked-for count, `ThreadGovernor` follows the CPUs the other
processes leave: every INTERVAL_S it reads how busy this process's CPUs were (/proc/stat, per CPU of
the affinity mask) minus this process's own time (/proc/self/stat), and runs

    threads = clamp(floor(usable - others + 0.25), 1, usable)

(others: CPUs' worth of other processes' work over the interval). OpenMP counts are per thread, so
the governor steers the thread that steps an executor; every `bestiary` command also takes its count
at start (`start_command`: on a loaded machine the CPUs others leave, sampled once), so converting,
building and loading do not spin for CPUs they do not get either. docs/runtime.md has the
measurements (benchmarks/contention.py).
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

import torch

from bestiary.core.format.errors import BestiaryError
from bestiary.core.format.resources import usable_cpus

ENV = "BESTIARY_NUM_THREADS"
_TORCH_DEFAULT = torch.get_num_threads()  # before anything here changes it: torch's choice for this host
_OURS: set[int] = set()  # counts bestiary set without being asked (defaults, the governor): not the program's own


def env_threads() -> int | None:
    """BESTIARY_NUM_THREADS as a count, None when unset or empty; anything else is a one-line error."""
    text = os.environ.get(ENV, "").strip()
    if not text:
        return None
    if not text.isdigit() or int(text) < 1:
        raise BestiaryError(f"{ENV}={text!r}: expected a whole number of threads >= 1 (or unset: the usable CPUs)")
    return int(text)


def default_threads(ranks: int = 1) -> int:
    """Threads per rank when none are asked for (module docstring), for `ranks` ranks on this host."""
    asked = env_threads()
    if asked is not None:
        return asked
    return max(1, min(_TORCH_DEFAULT, usable_cpus().amount) // ranks)


def _programs_own() -> bool:
    """Whether this thread's torch count was set by the program: neither torch's start-up default nor a count
    bestiary chose by itself."""
    count = torch.get_num_threads()
    return count != _TORCH_DEFAULT and count not in _OURS


def _choose(threads: int) -> None:
    """Set torch's count to one bestiary chose (remembered as such: a later default may replace it)."""
    _OURS.add(threads)
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


def bestiary_chooses(num_threads: int | None) -> bool:
    """True when nobody asked for a count: no num_threads, no BESTIARY_NUM_THREADS, and torch's count not set by
    the program (call before `set_threads`)."""
    return not num_threads and env_threads() is None and not _programs_own()


def set_threads(num_threads: int | None = None, ranks: int = 1) -> int:
    """Set torch's (and so the compiled kernels') thread count: `num_threads`, else the default, unless the
    program set its own with torch.set_num_threads (kept). Returns the count."""
    if not num_threads and _programs_own() and env_threads() is None:
        return torch.get_num_threads()
    asked = num_threads or env_threads()
    if asked:  # the caller's or BESTIARY_NUM_THREADS: kept as asked
        if torch.get_num_threads() != asked:
            torch.set_num_threads(asked)
        return asked
    threads = default_threads(ranks)
    _choose(threads)
    return threads


def start_command(num_threads: int | None = None) -> int:
    """A command's threads, set once torch is imported (core.cli.main, every command that runs torch):
    `set_threads(num_threads)`, and when bestiary chooses the count, on a loaded machine the CPUs the other
    processes leave now (`ThreadGovernor.settle`), so that converting, building and loading run on them too,
    not only decode steps. Returns the count."""
    governed = bestiary_chooses(num_threads)
    threads = set_threads(num_threads)
    governor = ThreadGovernor.for_this_process(threads) if governed else None
    return threads if governor is None else governor.settle()


def process_share(processes: int) -> int:
    """Threads for each of `processes` processes started together on this process's CPUs (pytest-xdist's
    workers): min(torch's default, the usable CPUs) // processes, at least 1 (default_threads without its
    BESTIARY_NUM_THREADS: this share is what the caller exports there). One process alone takes, on a
    loaded machine, the CPUs the other processes leave now (as `start_command`)."""
    usable = max(1, min(_TORCH_DEFAULT, usable_cpus().amount))
    if processes > 1 or usable == 1:
        return max(1, usable // processes)
    governor = ThreadGovernor.for_this_process(usable)
    return usable if governor is None else governor.settle()


INTERVAL_S = 0.5  # how often the governor looks (a /proc read of ~50 us)
SETTLE_S = 0.1  # the first look on a loaded machine, before an engine loads
ROOT = Path("/")


def cpu_busy_ticks(cpus: set[int], root: Path = ROOT) -> int | None:
    """Busy clock ticks (user, nice, system, irq, softirq, steal) of `cpus` so far; None without /proc/stat."""
    try:
        lines = (root / "proc" / "stat").read_text().splitlines()
    except OSError:
        return None
    total = 0
    for line in lines:
        name, *fields = line.split()
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus and len(fields) >= 8:
            user, nice, system, _idle, _iowait, irq, softirq, steal = (int(f) for f in fields[:8])
            total += user + nice + system + irq + softirq + steal
    return total


def own_ticks(root: Path = ROOT) -> int | None:
    """This process's CPU clock ticks so far (utime + stime, every thread); None without /proc."""
    try:
        text = (root / "proc" / "self" / "stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()  # after "pid (comm) ": state is field 3, utime 14, stime 15
    return int(fields[11]) + int(fields[12])


class ThreadGovernor:
    """Sets torch's thread count to the CPUs other processes leave (module docstring); `tick` once per step."""

    def __init__(self, usable: int, cpus: set[int], root: Path = ROOT, clock=time.monotonic) -> None:
        self.usable = usable
        self.cpus = cpus
        self.root = root
        self.clock = clock
        self.hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self.threads = torch.get_num_threads()
        self._last = self._sample()

    @classmethod
    def for_this_process(cls, usable: int) -> ThreadGovernor | None:
        """A governor of up to `usable` threads (`set_threads`' default count) when /proc can be read."""
        try:
            cpus = os.sched_getaffinity(0)
        except (AttributeError, OSError):
            return None
        governor = cls(usable, cpus)
        return governor if governor._last is not None else None

    def _sample(self) -> tuple[float, int, int] | None:
        busy, own = cpu_busy_ticks(self.cpus, self.root), own_ticks(self.root)
        return None if busy is None or own is None else (self.clock(), busy, own)

    def settle(self, seconds: float = SETTLE_S, loadavg=os.getloadavg) -> int:
        """On a loaded machine (1-minute load average above half the usable CPUs), look at the CPUs' use over
        `seconds` now, so that what runs before the first decode step (loading an engine: the weights' NaN
        scan, their repacking) has the count the governor would pick; returns it."""
        try:
            busy = loadavg()[0] > self.usable / 2
        except OSError:
            return self.threads
        if not busy:
            return self.threads
        self._last = self._sample()
        time.sleep(seconds)
        return self.tick(force=True)

    def tick(self, force: bool = False) -> int:
        """Re-read the CPUs' use when INTERVAL_S has passed (or `force`) and set the thread count; returns it."""
        if self._last is None or (not force and self.clock() - self._last[0] < INTERVAL_S):
            return self.threads
        now = self._sample()
        if now is None:
            return self.threads
        seconds, busy, own = (b - a for a, b in zip(self._last, now))
        self._last = now
        if seconds <= 0:
            return self.threads
        others = max(0.0, (busy - own) / (self.hz * seconds))  # CPUs' worth of other processes' work
        threads = max(1, min(self.usable, math.floor(self.usable - others + 0.25)))
        if threads != self.threads:
            _choose(threads)
            self.threads = threads
        return threads
