"""An error line written while an answer streams starts on a line of its own (issue 47, item 10).

stdout and stderr go to one pipe, as a terminal shows them (`2>&1`): a rank killed during
`run --streaming` (the rank watch's `fail`), Ctrl-C during `run --streaming` and during a piped
`chat` answer (the CLI's error path, core.cli.failures). Each used to continue the half-written line:
"w40bestiary: rank 1 (pid ...) was killed by SIGKILL; stopping all 2 ranks".
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from tiny_llama import make_tiny_llama, write_tiny_tokenizer  # noqa: E402

from bestiary.core.convert.source_to_checkpoint import ConvertOptions, convert  # noqa: E402
from bestiary.core.format import stream_line  # noqa: E402

PACED = Path(__file__).resolve().parents[1] / "helpers" / "paced_bestiary.py"  # one piece every PACE_S
LIMIT_S = 60


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory) -> Path:
    """A tiny LLaMA with the word-level tokenizer; positions for answers longer than any test waits."""
    hf = make_tiny_llama(tmp_path_factory.mktemp("stream_errors"), max_position_embeddings=4096)
    write_tiny_tokenizer(hf)
    return hf


@pytest.fixture(scope="module")
def tp2(tiny_hf) -> Path:
    return convert(tiny_hf, tiny_hf.parent / "tp2", ConvertOptions(tp_size=2), show_progress=False)


@pytest.fixture(scope="module")
def tp1(tiny_hf) -> Path:
    return convert(tiny_hf, tiny_hf.parent / "tp1", show_progress=False)


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid`."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                if entry.isdigit() and int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry))
        except (OSError, ValueError):
            continue
    return found


def spawned_rank(pid: int) -> int | None:
    """Rank 1's pid: the driver's child that is not multiprocessing's resource tracker."""
    for child in children(pid):
        try:
            with open(f"/proc/{child}/cmdline", "rb") as f:
                if b"resource_tracker" not in f.read():
                    return child
        except OSError:
            continue
    return None


def start(args: list[str], stdin: str | None = None) -> tuple[subprocess.Popen, bytes]:
    """`paced_bestiary.py ARGS` (one piece every 10 ms), stdout and stderr in one pipe; returns once its
    answer has streamed a few words (and what it streamed)."""
    proc = subprocess.Popen([sys.executable, str(PACED), *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True, env={**os.environ, "PACE_S": "0.01"})
    assert proc.stdin is not None and proc.stdout is not None
    if stdin is not None:
        proc.stdin.write(stdin.encode())
        proc.stdin.flush()
    seen, deadline = b"", time.monotonic() + LIMIT_S
    while seen.count(b" w") < 3 and proc.poll() is None and time.monotonic() < deadline:
        seen += proc.stdout.read1(4096)
    assert seen.count(b" w") >= 3, seen
    return proc, seen


def finish(proc: subprocess.Popen, seen: bytes) -> tuple[int, list[str]]:
    """The exit status and every line the pipe got."""
    try:
        rest, _ = proc.communicate(timeout=LIMIT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    return proc.returncode, (seen + rest).decode().splitlines()


def assert_on_its_own_line(lines: list[str], error: str) -> None:
    """The last line is `error`; the one before it is streamed text (the words "wN"), ended by a newline."""
    assert lines[-1] == error, lines[-3:]
    assert lines[-2].split() and all(w.startswith("w") or w in ("<s>", "a", "b", "c") for w in lines[-2].split()), \
        lines[-3:]


def run_args(ckpt: Path) -> list[str]:
    return ["run", "--engine_dir", str(ckpt), "--input_text", "w1 w2 w3", "--max_output_len", "3000",
            "--ignore_eos", "--streaming", "--num_threads", "1"]


def test_a_rank_killed_during_run_streaming_is_reported_on_a_line_of_its_own(tp2):
    proc, seen = start(run_args(tp2))
    rank1 = spawned_rank(proc.pid)
    assert rank1 is not None
    os.kill(rank1, signal.SIGKILL)
    code, lines = finish(proc, seen)
    assert code == 1
    assert_on_its_own_line(lines, f"bestiary: rank 1 (pid {rank1}) was killed by SIGKILL; stopping all 2 ranks")


def test_ctrl_c_during_run_streaming_says_interrupted_on_a_line_of_its_own(tp1):
    proc, seen = start(run_args(tp1))
    os.kill(proc.pid, signal.SIGINT)
    code, lines = finish(proc, seen)
    assert code == 130
    assert_on_its_own_line(lines, "interrupted")


def test_ctrl_c_during_a_piped_chat_answer_says_interrupted_on_a_line_of_its_own(tp1):
    proc, seen = start(["chat", "--engine_dir", str(tp1), "--max_output_len", "3000"], stdin="w5 w6 w7 w8\n")
    os.kill(proc.pid, signal.SIGINT)
    code, lines = finish(proc, seen)
    assert code == 130
    assert_on_its_own_line(lines, "interrupted")


def test_error_lines_start_a_line_only_after_streamed_text_that_left_one_open(capsys):
    stream_line.write("partial answer")
    stream_line.error_line("bestiary: rank 1 failed")
    stream_line.write("next answer\n")
    stream_line.error_line("error: x")
    out, err = capsys.readouterr()
    assert out == "partial answernext answer\n"
    assert err == "\nbestiary: rank 1 failed\nerror: x\n"
    stream_line.set_mid_line(True)  # rich's Live draws
    stream_line.set_mid_line(False)  # ... and ended its line
    stream_line.error_line("error: y")
    assert capsys.readouterr().err == "error: y\n"
