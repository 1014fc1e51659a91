"""A tiny random LLaMA with a small trained byte-level BPE tokenizer and a ChatML template: an engine
that takes text and chat (the server tests; benchmarks/soak.py on a tiny engine)."""

from __future__ import annotations

from pathlib import Path

CHATML = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant.<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

CORPUS = (
    "The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with one step. "
    "Hello world! How are you today? I am fine, thank you. The capital of France is Paris. "
    "def add(a, b):\n    return a + b\n\nNumbers: 0 1 2 3 4 5 6 7 8 9 10 11 12. Café, naïve, 数字."
) * 4


def make_tiny_chat_hf(base: Path, seed: int = 0, max_position_embeddings: int = 512) -> Path:
    """base/'hf': a tiny random LlamaForCausalLM with a trained 320-token BPE tokenizer and CHATML."""
    import transformers
    from tiny_llama import make_tiny_llama
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([CORPUS], trainer)
    hf_dir = make_tiny_llama(base, seed=seed, vocab_size=tok.get_vocab_size(),
                             max_position_embeddings=max_position_embeddings)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>",
                                                eos_token="<|im_end|>", unk_token="<|endoftext|>",
                                                pad_token="<|endoftext|>")
    fast.chat_template = CHATML
    fast.save_pretrained(hf_dir)
    return hf_dir


def make_tiny_chat_engine(base: Path, max_batch_size: int = 32, max_seq_len: int = 256, seed: int = 0) -> Path:
    """base/'engine' built from make_tiny_chat_hf (float32, max_input_len 128; positions for max_seq_len)."""
    from bestiary.core.convert.checkpoint_to_engine import BuildConfig, build_engine
    from bestiary.core.convert.source_to_checkpoint import convert

    convert(make_tiny_chat_hf(base, seed, max(max_seq_len, 512)), base / "ckpt", show_progress=False)
    return build_engine(base / "ckpt", base / "engine",
                        BuildConfig(max_batch_size=max_batch_size, max_seq_len=max_seq_len, max_input_len=128,
                                    tokens_per_block=8))
