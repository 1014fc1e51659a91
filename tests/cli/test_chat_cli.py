"""`bestiary chat` through a pipe (tiny random chat engine): the history reaches the model, /reset
forgets it, /system sets the system prompt, long conversations drop their oldest turns."""

from __future__ import annotations

import os
import pty
import re
import select
import subprocess
import sys
import time

import pytest

pytest.importorskip("transformers")

from rich.console import Console  # noqa: E402
from tiny_chat import make_tiny_chat_engine  # noqa: E402

from bestiary.core.cli.chat import Conversation, prompt_ids  # noqa: E402
from bestiary.core.format.errors import BestiaryError  # noqa: E402
from bestiary.core.runtime.llm import LLM  # noqa: E402
from bestiary.core.runtime.sampling import SamplingConfig  # noqa: E402

NEW_TOKENS = 8
STATS = re.compile(r"^\[(\d+) tokens, [\d.]+ tokens/s\]$")


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return make_tiny_chat_engine(tmp_path_factory.mktemp("chat"))


@pytest.fixture(scope="module")
def llm(engine):
    llm = LLM(engine)
    yield llm
    llm.close()


def greedy_reply(llm: LLM, messages: list[dict]) -> str:
    """The answer `LLM.chat` gives to this whole conversation (greedy, NEW_TOKENS at most)."""
    (done,) = llm.chat(messages, SamplingConfig(temperature=0.0, max_new_tokens=NEW_TOKENS))
    return done.text


def chat_pipe(engine, lines: list[str], *flags: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "bestiary", "chat", "--engine_dir", str(engine),
           "--max_output_len", str(NEW_TOKENS), *flags]
    return subprocess.run(cmd, input="".join(f"{line}\n" for line in lines), capture_output=True, text=True,
                          timeout=120)


def test_pipe_two_turns_use_the_history_and_reset_forgets_it(engine, llm):
    first, second = "Hello world! How are you today?", "The capital of France"
    result = chat_pipe(engine, [first, second, "/reset", second, "/system Be brief.", first, "/exit", "never read"])
    assert result.returncode == 0, result.stderr
    a1 = greedy_reply(llm, [{"role": "user", "content": first}])
    a2 = greedy_reply(llm, [{"role": "user", "content": first}, {"role": "assistant", "content": a1},
                            {"role": "user", "content": second}])
    fresh = greedy_reply(llm, [{"role": "user", "content": second}])
    a4 = greedy_reply(llm, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": second},
                            {"role": "assistant", "content": fresh}, {"role": "user", "content": first}])
    assert a2 != fresh, "the second prompt must answer differently with and without the history"
    assert result.stdout == f"{a1}\n{a2}\n{fresh}\n{a4}\n"  # /exit: the line after it is never answered
    stats = [STATS.match(line) for line in result.stderr.splitlines() if line.startswith("[")]
    assert len(stats) == 4 and all(stats), result.stderr
    assert all(1 <= int(m.group(1)) <= NEW_TOKENS for m in stats)
    assert "conversation forgotten" in result.stderr and "Traceback" not in result.stderr


def test_long_conversation_drops_the_oldest_turns(llm):
    limit = llm.engine.build.max_input_len
    turn = "The quick brown fox jumps over the lazy dog. " * 3
    conversation = Conversation(system="Be brief.")
    for i in range(6):
        conversation.turns += [{"role": "user", "content": f"{i} {turn}"}, {"role": "assistant", "content": turn}]
    conversation.turns.append({"role": "user", "content": "last"})
    assert len(llm.chat_ids(conversation.messages())) > limit
    err = Console(stderr=True, record=True)
    ids = prompt_ids(llm, conversation, err)
    assert len(ids) <= limit
    assert ids == llm.chat_ids(conversation.messages())
    assert conversation.system == "Be brief." and conversation.turns[-1]["content"] == "last"
    assert len(conversation.turns) % 2 == 1 and conversation.turns[0]["role"] == "user"
    # one more turn would not have fitted: exactly the oldest turns that had to go were dropped
    longer = Conversation(conversation.system, [{"role": "user", "content": "5 " + turn},
                                                {"role": "assistant", "content": turn}] + conversation.turns)
    assert len(llm.chat_ids(longer.messages())) > limit
    assert "oldest turn(s) were dropped" in err.export_text()
    kept = list(conversation.turns)
    conversation.turns += [{"role": "assistant", "content": "ok"},
                           {"role": "user", "content": turn * 20}]  # too long by itself: refused, nothing dropped
    with pytest.raises(BestiaryError, match="exceed the engine's max_input_len"):
        prompt_ids(llm, conversation, err)
    assert conversation.turns[:-2] == kept


def test_a_message_too_long_alone_is_refused_and_the_chat_goes_on(engine, llm):
    huge = "The quick brown fox jumps over the lazy dog. " * 40
    result = chat_pipe(engine, [huge, "Hello"])
    assert result.returncode == 0
    assert "exceed the engine's max_input_len" in result.stderr and "Traceback" not in result.stderr
    assert result.stdout == greedy_reply(llm, [{"role": "user", "content": "Hello"}]) + "\n"


def test_missing_engine_is_a_one_line_error(tmp_path):
    result = chat_pipe(tmp_path / "nope", ["Hello"])
    assert result.returncode == 2
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_a_terminal_gets_a_prompt_the_answer_and_its_speed(engine, llm):
    """The interactive path (rich prompt, Markdown while streaming) on a pseudo-terminal."""
    answer = greedy_reply(llm, [{"role": "user", "content": "Hello"}])
    master, slave = pty.openpty()
    cmd = [sys.executable, "-m", "bestiary", "chat", "--engine_dir", str(engine), "--max_output_len", str(NEW_TOKENS)]
    proc = subprocess.Popen(cmd, stdin=slave, stdout=slave, stderr=slave, env=dict(os.environ, COLUMNS="200"))
    os.close(slave)
    seen = b""

    def read_until(marker: bytes, seconds: float = 60.0) -> None:
        nonlocal seen
        deadline = time.monotonic() + seconds
        while marker not in seen and time.monotonic() < deadline:
            if select.select([master], [], [], 0.5)[0]:
                try:
                    seen += os.read(master, 4096)
                except OSError:
                    break
        assert marker in seen, seen.decode(errors="replace")

    try:
        read_until(b"you>")
        os.write(master, b"Hello\r")
        read_until(b"tokens/s]")
        os.write(master, b"/exit\r")
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)
    text = seen.decode(errors="replace")
    assert "/reset" in text  # the help line
    words = [w for w in answer.split() if w.isalnum()]
    assert all(w in text for w in words), (answer, text)
