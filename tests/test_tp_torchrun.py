"""`bestiary run` on a tp 2 engine under torchrun: two localhost "nodes" (c10d rendezvous, one
process each) print tp 1's greedy tokens, and every rank exits 0."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from bestiary.core.convert.source_to_checkpoint import convert
from bestiary.core.runtime.worker_group import free_port
from tiny_llama import make_tiny_llama

RUN = ["run", "--input_ids", "3,17,45,8,60,22", "4,5,6", "--max_output_len", "12", "--output_ids",
       "--num_threads", "1"]


def bestiary(args: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bestiary", *args], capture_output=True, text=True,
                          timeout=120, env=env, check=False)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("torchrun")
    src = make_tiny_llama(root, num_key_value_heads=1)
    return (convert(src, root / "tp1", show_progress=False),
            convert(src, root / "tp2", tp_size=2, show_progress=False))


def test_two_localhost_nodes_give_tp1_greedy_tokens(ckpts):
    tp1, tp2 = ckpts
    expected = bestiary([*RUN, "--engine_dir", str(tp1)])
    assert expected.returncode == 0, expected.stderr
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    nodes = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
         "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", "bestiary-test",
         "-m", "bestiary", *RUN, "--engine_dir", str(tp2)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for _ in range(2)]
    outs = [node.communicate(timeout=180) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], [err[-2000:] for _, err in outs]
    printed = [out for out, _ in outs if out.strip()]
    assert len(expected.stdout.split()) == 2 * 12  # two prompts' ids
    assert printed == [expected.stdout], outs
