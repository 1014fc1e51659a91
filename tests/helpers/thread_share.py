"""Each test process's share of the usable CPUs (tests/conftest.py calls `take_share` before any test).

More threads than CPUs spin at OpenMP barriers for CPUs they do not get; `make test` runs two
pytest-xdist workers, so each takes half (core.runtime.threads.process_share: 1 thread each on 2 cores;
one process alone on a loaded machine takes the CPUs the other processes leave). The share is exported
to what the tests start: BESTIARY_NUM_THREADS for `bestiary` commands and bestiary code, OMP_NUM_THREADS
for any other torch (a `python -c`, a transformers reference). A BESTIARY_NUM_THREADS the user set is
kept. CHOSEN tells the share this file chose from the user's: the pytest-xdist controller imports
conftest.py first and its workers inherit its environment, so a worker that found only the controller's
choice (its whole share) chooses again.
"""

from __future__ import annotations

import os

import torch

from bestiary.core.runtime.threads import ENV, process_share

CHOSEN = "BESTIARY_TEST_THREADS"
OMP = "OMP_NUM_THREADS"


def take_share(workers: int) -> int:
    """Set this process's torch threads and its children's environment to its share (module docstring)."""
    chosen = os.environ.get(CHOSEN)
    if os.environ.get(ENV) in (None, "", chosen):
        share = str(process_share(workers))
        if os.environ.get(OMP) in (None, "", chosen):
            os.environ[OMP] = share
        os.environ[ENV] = os.environ[CHOSEN] = share
    torch.set_num_threads(int(os.environ[ENV]))
    return int(os.environ[ENV])
