"""`bestiary chat`'s keys in a real terminal (issue 47, item 8): a pseudo-terminal that is the chat's
controlling terminal, so Ctrl-C is the byte 0x03 the terminal turns into SIGINT (and echoes as "^C"),
and what it shows is read back through tests/helpers/vt_screen.py.

- Ctrl-C during an answer: the answer stays on the screen once (the terminal's "^C" after a full-width
  line used to make Live draw its first line twice), then "(stopped)", and the next message is answered
  with the stopped answer in the history.
- Ctrl-C at the prompt: the line typed is discarded, a hint says how to leave, the conversation goes on
  (it used to leave the chat); a second Ctrl-C right away leaves; Ctrl-D at an empty prompt leaves.

The engine: a tiny random LLaMA with the word-level test tokenizer (answers are words "w12 w40 ...",
printable, so the screen can be compared with rich's rendering of the expected text).
"""

from __future__ import annotations

import argparse
import fcntl
import os
import pty
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from rich.console import Console  # noqa: E402
from rich.markdown import Markdown  # noqa: E402
from tiny_llama import make_tiny_engine  # noqa: E402
from vt_screen import Screen  # noqa: E402

from bestiary.core.cli.chat import LEAVE_HINT, sampling_config  # noqa: E402
from bestiary.core.runtime.llm import LLM  # noqa: E402

COLUMNS, ROWS = 60, 200  # narrow: an answer wraps within two seconds; tall: nothing scrolls
MAX_OUTPUT_LEN = 64
PIECE_S = 0.05  # the chat's answers arrive one piece per this (paced_bestiary.py): Ctrl-C lands mid-answer
FIRST, SECOND = "w5 w6 w7 w8", "w1 w2 w3"

PACED = Path(__file__).resolve().parents[1] / "helpers" / "paced_bestiary.py"  # one piece every PACE_S


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> Path:
    return make_tiny_engine(tmp_path_factory.mktemp("chat_keys"), tokenizer=True) / "engine"


@pytest.fixture(scope="module")
def llm(engine):
    llm = LLM(engine)
    yield llm
    llm.close()


def _controlling_terminal() -> None:
    """In the child: a session of its own with the pty (its stdin) as controlling terminal."""
    os.setsid()
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


class ChatTerminal:
    """`bestiary chat` on a COLUMNS x ROWS pseudo-terminal; `screen()` is what the terminal shows."""

    def __init__(self, engine: Path, pace_s: float) -> None:
        master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", ROWS, COLUMNS, 0, 0))
        env = {**os.environ, "PACE_S": str(pace_s), "COLUMNS": str(COLUMNS), "LINES": str(ROWS),
               "TERM": "xterm-256color"}
        cmd = [sys.executable, str(PACED), "chat", "--engine_dir", str(engine),
               "--max_output_len", str(MAX_OUTPUT_LEN)]
        self.proc = subprocess.Popen(cmd, stdin=slave, stdout=slave, stderr=slave, env=env,
                                     preexec_fn=_controlling_terminal)
        os.close(slave)
        self.master, self.raw = master, b""

    def pump(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if select.select([self.master], [], [], 0.05)[0]:
                try:
                    self.raw += os.read(self.master, 65536)
                except OSError:  # the chat is gone
                    return

    def screen(self) -> list[str]:
        screen = Screen(COLUMNS)
        screen.feed(self.raw.decode(errors="replace"))
        return screen.lines()

    def wait_for(self, ready, seconds: float = 90.0) -> list[str]:
        """Read until `ready(screen lines)` holds; the lines."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            lines = self.screen()
            if ready(lines):
                return lines
            if self.proc.poll() is not None:
                self.pump(0.2)
                break
            self.pump(0.1)
        lines = self.screen()
        assert ready(lines), "\n".join(lines)
        return lines

    def send(self, keys: bytes) -> None:
        os.write(self.master, keys)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)
        os.close(self.master)


@pytest.fixture
def terminal_of(engine):
    opened: list[ChatTerminal] = []

    def open_terminal(pace_s: float = 0.0) -> ChatTerminal:
        opened.append(ChatTerminal(engine, pace_s))
        return opened[-1]

    yield open_terminal
    for term in opened:
        term.close()


def prompts(lines: list[str]) -> list[int]:
    """Rows that show the prompt."""
    return [i for i, line in enumerate(lines) if line.startswith("you>")]


def count(lines: list[str], text: str) -> int:
    return sum(text in line for line in lines)


def rendered(text: str) -> list[str]:
    """The rows rich draws for the answer `text` (Markdown, COLUMNS wide), trailing blanks dropped."""
    console = Console(width=COLUMNS, color_system=None)
    rows = ["".join(s.text for s in line).rstrip()
            for line in console.render_lines(Markdown(text), console.options, pad=False)]
    while rows and not rows[-1]:
        rows.pop()
    return rows


def stream(llm: LLM, messages: list[dict]) -> list[str]:
    """The pieces the chat streams for this conversation (its sampling: greedy, MAX_OUTPUT_LEN at most)."""
    ids = llm.chat_ids(messages)
    args = argparse.Namespace(max_output_len=MAX_OUTPUT_LEN, temperature=0.0, top_p=1.0, top_k=0, random_seed=None)
    return list(llm.generate_stream(ids, sampling_config(args, len(ids), llm.engine.build.max_seq_len)))


def answer_rows(lines: list[str], message: str, end: str) -> list[str]:
    """The rows between the prompt row of `message` and the first row starting with `end` after it."""
    start = lines.index(f"you> {message}")
    stop = next(i for i in range(start + 1, len(lines)) if lines[i].startswith(end))
    rows = lines[start + 1:stop]
    while rows and not rows[-1]:
        rows.pop()
    return rows


def test_ctrl_c_during_an_answer_shows_it_once_and_keeps_it_in_the_conversation(terminal_of, llm):
    term = terminal_of(PIECE_S)
    term.wait_for(lambda lines: prompts(lines))
    term.send(f"{FIRST}\r".encode())
    term.wait_for(lambda lines: sum(bool(row) for row in lines[prompts(lines)[0] + 1:]) >= 2)  # two rows drawn
    term.send(b"\x03")
    term.wait_for(lambda lines: len(prompts(lines)) == 2)
    term.send(f"{SECOND}\r".encode())
    lines = term.wait_for(lambda lines: count(lines, "tokens/s]") == 2 and len(prompts(lines)) == 3)
    term.send(b"\x04")  # Ctrl-D at the empty prompt leaves
    assert term.proc.wait(timeout=60) == 0
    shown = answer_rows(lines, FIRST, "(stopped)")
    pieces = stream(llm, [{"role": "user", "content": FIRST}])
    stopped_at = [k for k in range(1, len(pieces)) if rendered("".join(pieces[:k])) == shown]
    assert stopped_at, (shown, rendered("".join(pieces)))  # the answer so far, each row once
    assert len(shown) >= 2
    partial = "".join(pieces[:stopped_at[0]])
    kept = [{"role": "user", "content": FIRST}, {"role": "assistant", "content": partial},
            {"role": "user", "content": SECOND}]
    expected = rendered("".join(stream(llm, kept)))
    assert answer_rows(lines, SECOND, "[") == expected, "the next answer follows the stopped one"
    assert expected != rendered("".join(stream(llm, [{"role": "user", "content": SECOND}])))  # the history counts
    stopped = lines.index("(stopped)")
    assert lines[stopped + 1].startswith("[") and lines[stopped + 2].startswith("you> ")


def test_ctrl_c_at_the_prompt_clears_the_line_and_a_second_one_leaves(terminal_of, llm):
    term = terminal_of()
    term.wait_for(lambda lines: prompts(lines))
    term.send(f"{FIRST}\r".encode())
    term.wait_for(lambda lines: count(lines, "tokens/s]") == 1 and len(prompts(lines)) == 2)
    term.send(b"w9 w9 w9")  # typed, then discarded by Ctrl-C
    term.wait_for(lambda lines: lines[prompts(lines)[-1]].endswith("w9 w9 w9"))
    term.send(b"\x03")
    term.wait_for(lambda lines: count(lines, LEAVE_HINT) == 1 and len(prompts(lines)) == 3)
    term.send(f"{SECOND}\r".encode())
    lines = term.wait_for(lambda lines: count(lines, "tokens/s]") == 2 and len(prompts(lines)) == 4)
    term.send(b"\x03")
    term.wait_for(lambda lines: count(lines, LEAVE_HINT) == 2)
    term.send(b"\x03")  # a second Ctrl-C right away leaves
    assert term.proc.wait(timeout=60) == 0
    first = "".join(stream(llm, [{"role": "user", "content": FIRST}]))
    kept = [{"role": "user", "content": FIRST}, {"role": "assistant", "content": first},
            {"role": "user", "content": SECOND}]
    assert answer_rows(lines, SECOND, "[") == rendered("".join(stream(llm, kept)))
    hint = lines.index(LEAVE_HINT)
    assert lines[hint - 1] == "you> w9 w9 w9^C" and lines[hint + 1] == f"you> {SECOND}"
    assert "Traceback" not in "\n".join(term.screen())

