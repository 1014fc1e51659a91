"""`bestiary run` on a tp 2 engine, as a user starts it: a plain `python -m bestiary run` (it
spawns its own rank), `torchrun --nproc_per_node 2` on one node, and two localhost "nodes"
(c10d rendezvous, one process each). Each prints what the tp 1 engine prints (greedy ids or
text), every process exits 0 and none is left behind."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tiny_llama import make_tiny_llama, write_tiny_tokenizer

from bestiary.core.cli.main import main
from bestiary.core.convert.checkpoint_to_engine import BuildConfig, build_engine
from bestiary.core.convert.source_to_checkpoint import ConvertOptions, convert
from bestiary.core.runtime.worker_group import free_port

RUN = ["run", "--input_ids", "3,17,45,8,60,22", "4,5,6", "--max_output_len", "12", "--num_threads", "1"]
IDS = [*RUN, "--output_ids"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def session_processes(sid: int) -> dict[int, str]:
    """pid -> command line of the live (not zombie) processes of session `sid` (/proc/PID/stat field 6)."""
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[3]) == sid and fields[0] != "Z":
                found[int(stat.parent.name)] = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode()
    return found


def left_behind(sid: int, wait_s: float = 5.0) -> dict[int, str]:
    """The processes of session `sid` still alive `wait_s` after its leader exited (none, normally: the
    spawned ranks are joined before it exits; multiprocessing's resource tracker ends just after it)."""
    deadline = time.monotonic() + wait_s
    while (found := session_processes(sid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return found


@pytest.fixture(scope="module")
def engines(tmp_path_factory) -> tuple[Path, Path]:
    """(tp 1, tp 2) engines of the tiny LLaMA with one kv head (replicated on both ranks), with a tokenizer."""
    root = tmp_path_factory.mktemp("torchrun")
    src = make_tiny_llama(root, num_key_value_heads=1)
    write_tiny_tokenizer(src)
    return tuple(build_engine(convert(src, root / f"ckpt_tp{tp}", ConvertOptions(tp_size=tp), show_progress=False),
                              root / f"engine_tp{tp}", BuildConfig()) for tp in (1, 2))


@pytest.fixture(scope="module")
def expected(engines) -> dict[str, str]:
    """What `bestiary run` prints on the tp 1 engine (in this process: no ranks), as ids and as text."""
    out = {}
    for name, args in (("ids", IDS), ("text", RUN)):
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            assert main([*args, "--engine_dir", str(engines[0])]) == 0
        out[name] = printed.getvalue()
    assert len(out["ids"].split()) == 2 * 12  # two prompts' ids, no early end
    assert len(out["text"].splitlines()) == 2 and out["text"].split() != out["ids"].split()
    return out


def test_cli_spawns_its_ranks_and_prints_tp1_text(engines, expected):
    """`python -m bestiary run` on the tp 2 engine (nothing else): it starts rank 1 itself, prints tp 1's
    greedy text (one word per id: the same ids), exits 0, and no process of its session is left."""
    proc = subprocess.Popen([sys.executable, "-m", "bestiary", *RUN, "--engine_dir", str(engines[1])],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-2000:]
    assert out == expected["text"], err[-2000:]
    assert left_behind(proc.pid) == {}, "processes outlived `bestiary run`"


@pytest.mark.slow  # the two-node launch below covers torchrun in the default suite
def test_single_node_torchrun_gives_tp1_greedy_tokens(engines, expected):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run([*TORCHRUN, "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
                          "--master_port", str(free_port()), "-m", "bestiary", *IDS, "--engine_dir", str(engines[1])],
                         capture_output=True, text=True, timeout=180, env=env, check=False)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout == expected["ids"], run.stderr[-2000:]


def test_two_localhost_nodes_give_tp1_greedy_tokens(engines, expected):
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    nodes = [subprocess.Popen(
        [*TORCHRUN, "--nnodes", "2", "--nproc_per_node", "1",
         "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", "bestiary-test",
         "-m", "bestiary", *IDS, "--engine_dir", str(engines[1])],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for _ in range(2)]
    outs = [node.communicate(timeout=180) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], [err[-2000:] for _, err in outs]
    printed = [out for out, _ in outs if out.strip()]
    assert printed == [expected["ids"]], outs
