"""`bestiary serve` on SmolLM2-135M-Instruct with the official openai client (slow suite): greedy text
equals `bestiary run`, the GGUF's chat template renders as transformers does, stop strings and usage."""

from __future__ import annotations

import subprocess
import sys

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
transformers = pytest.importorskip("transformers")

from bestiary.core.convert.checkpoint_to_engine import BuildConfig, build_engine  # noqa: E402
from bestiary.core.runtime.tokenizer import Tokenizer  # noqa: E402
from bestiary.core.serve.process import ServerProcess  # noqa: E402

pytestmark = pytest.mark.slow
PROMPTS = ["The capital of France is", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def engine(tmp_path_factory, smollm2_fp32_checkpoint):
    """An engine of the session's fp32 checkpoint (tests/conftest.py) with this module's limits."""
    base = tmp_path_factory.mktemp("smollm2-serve")
    return build_engine(smollm2_fp32_checkpoint, base / "engine", BuildConfig(max_batch_size=8, max_seq_len=512))


@pytest.fixture(scope="module")
def client(engine, tmp_path_factory):
    with ServerProcess(engine, "--served_model_name", "smol", log=tmp_path_factory.mktemp("log") / "s.log") as s:
        yield openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", timeout=120, max_retries=0)


def run_ids(engine, *args: str) -> list[list[int]]:
    cmd = [sys.executable, "-m", "bestiary", "run", "--engine_dir", str(engine), "--output_ids", *args]
    out = subprocess.run(cmd, capture_output=True, timeout=300)
    assert out.returncode == 0, out.stderr.decode()
    return [[int(t) for t in line.split()] for line in out.stdout.decode().splitlines()]


def test_greedy_text_equals_bestiary_run(engine, client):
    tok = Tokenizer.from_dir(engine)
    expected = run_ids(engine, "--max_output_len", "24", "--input_text", *PROMPTS)
    for prompt, ids in zip(PROMPTS, expected):
        got = client.completions.create(model="smol", prompt=prompt, max_tokens=24, temperature=0)
        text = tok.decode([i for i in ids if i not in tok.stop_ids])
        assert got.choices[0].text == text
        assert got.usage.completion_tokens == len(ids)
        assert got.usage.prompt_tokens == len(tok.encode(prompt))
    (chat_ids,) = run_ids(engine, "--chat", "--max_output_len", "32", "--input_text", "What is 12 * 7?")
    chat = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "What is 12 * 7?"}],
                                          max_tokens=32, temperature=0)
    assert chat.choices[0].message.content == tok.decode([i for i in chat_ids if i not in tok.stop_ids])
    assert chat.choices[0].finish_reason == ("stop" if chat_ids[-1] in tok.stop_ids else "length")


def test_chat_template_of_the_gguf_renders_as_transformers(engine, hf_tokenizer):
    hf = hf_tokenizer  # transformers' own tokenizer of the GGUF (tests/conftest.py)
    ours = Tokenizer.from_dir(engine)
    conversations = [
        [{"role": "user", "content": "Hi"}],
        [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"},
         {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}],
    ]
    for messages in conversations:
        for gen in (True, False):
            assert ours.apply_chat_template(messages, gen) == hf.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=gen)


def test_stop_string_and_seeded_samples(client):
    full = client.completions.create(model="smol", prompt="1, 2, 3, 4,", max_tokens=16, temperature=0).choices[0].text
    assert " 7" in full, full
    cut = client.completions.create(model="smol", prompt="1, 2, 3, 4,", max_tokens=16, temperature=0, stop=[" 7"])
    assert (cut.choices[0].text, cut.choices[0].finish_reason) == (full[: full.find(" 7")], "stop")
    kw = dict(model="smol", messages=[{"role": "user", "content": "Name a color."}], n=3, seed=3, max_tokens=16)
    first = [c.message.content for c in client.chat.completions.create(**kw).choices]
    assert len(set(first)) == 3
    assert [c.message.content for c in client.chat.completions.create(**kw).choices] == first
