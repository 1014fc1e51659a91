"""How many threads bestiary's ops run on when nobody says.

The count, in order: `num_threads=` / `--num_threads`; else the environment's BESTIARY_NUM_THREADS;
else min(torch's own default (the physical cores it sees), the CPUs this process may keep busy:
its affinity mask and its cgroup CPU quota, `core.format.resources.usable_cpus`). A container
given 1 CPU of a 16-core host then runs 1 thread, not 16 that wait for one another at every
barrier. Ranks of a tp / pp engine on one host share that count.

How idle OpenMP threads wait is set where bestiary is imported (bestiary/__init__.py), before
torch loads its OpenMP runtime: docs/performance.md has the measurements behind it.
"""

from __future__ import annotations

import os

import torch

from bestiary.core.format.errors import BestiaryError
from bestiary.core.format.resources import usable_cpus

ENV = "BESTIARY_NUM_THREADS"
_TORCH_DEFAULT = torch.get_num_threads()  # before anything here changes it: torch's choice for this host


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


def set_threads(num_threads: int | None = None, ranks: int = 1) -> int:
    """Set torch's (and so the compiled kernels') thread count: `num_threads`, else the default, unless the
    program set its own with torch.set_num_threads (kept). Returns the count."""
    if not num_threads and torch.get_num_threads() != _TORCH_DEFAULT and env_threads() is None:
        return torch.get_num_threads()
    threads = num_threads or default_threads(ranks)
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    return threads
