"""SmolLM2-135M-Instruct with a seeded random rank-8 PEFT adapter: greedy text equals transformers + PEFT.

The adapter sits on q, k, v, o, gate, up, down (alpha 16, B scaled so it changes the text but
keeps it fluent). Both sides read the same GGUF weights, fp32.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from lora_helpers import peft_adapter  # noqa: E402
from parity import greedy_mismatch, hf_greedy  # noqa: E402

from bestiary.core.convert.source_to_checkpoint import ConvertOptions, convert  # noqa: E402
from bestiary.core.lora.request import LoraRequest  # noqa: E402
from bestiary.core.runtime.llm import LLM  # noqa: E402
from bestiary.core.runtime.sampling import SamplingConfig  # noqa: E402

pytestmark = pytest.mark.slow

PROMPTS = [
    "The three primary colours are",
    "Write a haiku about a lighthouse:",
    "<|im_start|>user\nHow do I boil an egg?<|im_end|>\n<|im_start|>assistant\n",
    "In 1969, the first people to walk on the Moon",
    "def is_prime(n):\n",
]
NEW_TOKENS = 40
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def models(tmp_path_factory, smollm2_gguf, smollm2_fp32_checkpoint, hf_tokenizer):
    """The fp32 checkpoint and HF tokenizer are the session's (tests/conftest.py); the HF model is this
    module's own, as PEFT wraps it in place."""
    gguf = smollm2_gguf
    root = tmp_path_factory.mktemp("smollm2_lora")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                           dtype=torch.float32).eval()
    tok = hf_tokenizer
    peft_model = peft_adapter(hf, root / "adapter", seed=7, b_scale=0.05, r=8, lora_alpha=16, target_modules=TARGETS)
    return LLM(smollm2_fp32_checkpoint), peft_model, tok, root / "adapter"


def test_greedy_40_tokens_equal_transformers_peft(models):
    llm, peft_model, tok, adapter = models
    ids = [tok(p).input_ids for p in PROMPTS]
    sampling = SamplingConfig(temperature=0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    ours = [c.output_ids for c in llm.generate(ids, sampling, lora=LoraRequest("rand8", adapter))]
    base = [c.output_ids for c in llm.generate(ids, sampling)]
    changed = 0
    for prompt, got, plain in zip(ids, ours, base):
        ref, tie = hf_greedy(peft_model, prompt, NEW_TOKENS)
        assert greedy_mismatch(got, ref, tie) is None, greedy_mismatch(got, ref, tie)
        changed += got != plain
    assert changed == len(PROMPTS), f"the adapter changed only {changed} of {len(PROMPTS)} outputs"
    print("\n".join(repr(tok.decode(o)) for o in ours))


def test_seed_tensors_equal_the_peft_dir(models):
    """PEFT dir -> TensorRT-LLM's LoRA tensors (float32) -> request: the same logits as PEFT dir -> request."""
    from bestiary.core.lora.trtllm_convert import peft_to_trtllm
    from bestiary.registry import default_registry

    llm, _, tok, adapter = models
    registry = default_registry()
    weights, config = peft_to_trtllm(adapter, registry.get(llm.engine.config.architecture), registry, torch.float32)
    assert weights.shape[0] == 30 * len(TARGETS)
    ids = [tok(p).input_ids for p in PROMPTS]
    sampling = SamplingConfig(temperature=0, max_new_tokens=16, ignore_eos=True, output_context_logits=True)
    want = llm.generate(ids, sampling, lora=LoraRequest("peft", adapter))
    got = llm.generate(ids, sampling, lora=LoraRequest("seed", weights=weights.numpy(), config=config.numpy()))
    for w, g in zip(want, got):
        torch.testing.assert_close(g.context_logits, w.context_logits, rtol=0, atol=1e-4)
        assert g.output_ids == w.output_ids


def test_tp3_equals_tp1_with_an_adapter(models, smollm2_gguf, tmp_path):
    """SmolLM2 (9 heads, 3 kv heads) at tp 3 with the adapter: logits over prompt + tp 1's greedy
    continuation (teacher-forced) within 1e-3 of tp 1's."""
    from bestiary.core.runtime.step_broadcast import check_mirror

    llm, _, tok, adapter = models
    convert(smollm2_gguf, tmp_path / "tp3", ConvertOptions(dtype="float32", tp_size=3), show_progress=False)
    tp3 = LLM(tmp_path / "tp3", num_threads=1)
    lora = LoraRequest("rand8", adapter)
    ids = [tok(p).input_ids for p in PROMPTS[:3]]
    first = llm.generate(ids, SamplingConfig(temperature=0, max_new_tokens=16, ignore_eos=True), lora=lora)
    forced = [c.prompt_ids + c.output_ids for c in first]
    logits = SamplingConfig(temperature=0, max_new_tokens=1, output_context_logits=True)
    want = llm.generate(forced, logits, lora=lora)
    try:
        got = tp3.generate(forced, logits, lora=lora)
        for w, g in zip(want, got):
            torch.testing.assert_close(g.context_logits, w.context_logits, rtol=0, atol=1e-3)
        check_mirror(tp3.engine)
    finally:
        tp3.close()
