"""`bestiary run` prints one line per prompt on stdout, losslessly, even when an answer holds newlines:
a newline is written \\n, a carriage return \\r, a backslash \\\\ (it printed the answer raw, so two
prompts, one answered "Red\\nBlue", gave three lines and a script reading a line per prompt was off by one).

The engine is a stand-in (the printing is under test, not the model): answers with newlines, carriage
returns and backslashes, in batch and --streaming mode."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

from bestiary.core.cli.commands import one_line
from bestiary.core.cli.main import main

ANSWERS = ["Red\nBlue\n", "a \\n is not a newline\r\nC:\\temp", "plain"]


def read_back(line: str) -> str:
    """docs/cli.md's rule for reading an output line back (the one in one_line's docstring)."""
    return re.sub(r"\\(.)", lambda m: {"n": "\n", "r": "\r"}.get(m[1], m[1]), line)


class StandIn:
    """What cmd_run uses of LLM, answering prompt i with ANSWERS[i]."""

    def __init__(self, *args, **kwargs) -> None:
        self.engine = SimpleNamespace(build=SimpleNamespace(max_seq_len=2048))
        self.tokenizer = object()
        self.lora_store = SimpleNamespace(bundled={})
        self.last_stats = SimpleNamespace(prompt_tokens=3, generated_tokens=4, seconds=0.5, tokens_per_second=8.0,
                                          decode_tokens_per_second=9.0, first_token_seconds=0.1)

    def generate(self, prompts, sampling, chat=False, lora=None):
        return [SimpleNamespace(text=ANSWERS[i], output_ids=[1, 2], speculative=None) for i in range(len(prompts))]

    def generate_stream(self, prompt, sampling, chat=False, lora=None):
        answer = ANSWERS[int(prompt)]
        yield from (answer[i:i + 3] for i in range(0, len(answer), 3))  # pieces that split "\r\n" and "\\"


@pytest.fixture
def stand_in(monkeypatch, tmp_path):
    monkeypatch.setattr("bestiary.core.runtime.llm.LLM", StandIn)
    # run checks MODEL before loading it (core.cli.model_arg): tmp_path passes for an engine dir
    (tmp_path / "config.json").write_text('{"format_version": 1, "pretrained_config": {}, "build_config": {}}')


@pytest.mark.parametrize("streaming", [[], ["--streaming"]], ids=["batch", "streaming"])
def test_one_line_per_prompt_read_back_exactly(stand_in, capsys, tmp_path, streaming):
    assert main(["run", "--engine_dir", str(tmp_path), "--input_text", "0", "1", "2", *streaming]) == 0
    lines = capsys.readouterr().out.split("\n")
    assert lines[-1] == "" and len(lines[:-1]) == len(ANSWERS)
    assert [read_back(line) for line in lines[:-1]] == ANSWERS
    assert lines[0] == "Red\\nBlue\\n" and lines[1] == "a \\\\n is not a newline\\r\\nC:\\\\temp"


@pytest.mark.parametrize("text", ["", "\\", "\n", "\\n", "\\\\\n\r", "é\nü \\x41", "\t tab stays"])
def test_one_line_is_one_line_and_lossless(text):
    line = one_line(text)
    assert "\n" not in line and "\r" not in line
    assert read_back(line) == text
