"""Ranks meet within the join timeout, not the short step timeout (core.runtime.worker_group.join_world).

With the step timeout (BESTIARY_DIST_TIMEOUT) as the meeting's timeout too, a rank still importing torch on a
busy machine failed the world before any step ran: CI's 4-rank fault test, "Timed out after 9 seconds waiting
for clients. 2/4 clients joined". Here the step timeout is 1 s and rank 1 joins 3 s after rank 0: both join,
and a collective then still runs under the short timeout.
"""

from __future__ import annotations

import os
import subprocess
import sys

from bestiary.core.runtime.worker_group import free_port

RANK = r"""
import sys, time, torch, torch.distributed as dist
from bestiary.core.runtime.worker_group import join_world
rank, url = int(sys.argv[1]), sys.argv[2]
if rank == 1:
    time.sleep(3.0)  # still starting when rank 0 is already waiting
join_world(rank, 2, "cpu", url)
t = torch.tensor([rank + 1.0])
dist.all_reduce(t)
print(t.item(), dist.get_backend_config(), flush=True)
dist.destroy_process_group()
"""


def test_a_rank_joining_after_the_step_timeout_still_joins():
    url = f"tcp://127.0.0.1:{free_port()}"
    env = {**os.environ, "BESTIARY_DIST_TIMEOUT": "1", "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", RANK, str(rank), url], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for rank in (0, 1)]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-2000:]
        assert out.split()[0] == "3.0", out
